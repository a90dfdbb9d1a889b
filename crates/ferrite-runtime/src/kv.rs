//! `KvCache`: the physical storage of the paged KV cache.
//!
//! Every KV-owning layer has a K and a V pool of `num_blocks` blocks; a block holds
//! `block_size` positions. The layout of one pool is `[block][kv_head][slot][head_dim]`, so
//! the attention loop reads one head's keys contiguously. Which blocks a sequence owns is the
//! engine's business (block tables); this type only stores values.
//!
//! The pools live in host memory (the CPU op set) or on a CUDA device as bf16 (the CUDA op
//! set); a model reads the storage its ops need and gets an error for the other.
//!
//! Host pools hold f16 by default (`KvDtype`): decode attention streams the whole cache every
//! step and waits on memory, so half the bytes of f32 is most of the time saved (SmolLM2, 8
//! rows of ~200 positions: attention 5.6 → 4.1 ms a step). f16 keeps 11 bits of mantissa
//! (bf16 only 8) and K/V values lie far inside its range; every value is rounded once, when it
//! is written, the same way whatever the batch. f32 pools are the exact choice (parity tests
//! against transformers' f32 logits).

use half::f16;

use crate::cuda::ops::DeviceKv;
use crate::cuda::Gpu;
use crate::error::{Result, RuntimeError};
use crate::hugemem::HugeVec;

/// Shape of one KV-owning layer and the KV group whose blocks it uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayerSpec {
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub group: usize,
}

/// How a KV group keeps its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvGroupKind {
    /// Every position stays.
    Full,
    /// Only the last `window` positions are read; older blocks are released.
    Sliding { window: usize },
}

/// The KV layout of a model: its groups and its KV-owning layers. Layers that read another
/// layer's KV (shared / donor layers) own nothing and are not listed; the model maps them to
/// their donor's index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    pub groups: Vec<KvGroupKind>,
    pub layers: Vec<KvLayerSpec>,
}

impl KvLayout {
    /// One full-attention group for `n` identical layers.
    pub fn uniform(n: usize, n_kv_heads: usize, head_dim: usize, kind: KvGroupKind) -> KvLayout {
        KvLayout { groups: vec![kind], layers: vec![KvLayerSpec { n_kv_heads, head_dim, group: 0 }; n] }
    }

    /// Host bytes (default `KvDtype`) one block of `block_size` positions takes, per group.
    pub fn block_bytes(&self, block_size: usize) -> Vec<usize> {
        self.block_bytes_of(block_size, KvDtype::default().bytes())
    }

    /// Bytes one block of `block_size` positions takes, per group, at `elem_bytes` a value.
    pub fn block_bytes_of(&self, block_size: usize, elem_bytes: usize) -> Vec<usize> {
        let mut out = vec![0; self.groups.len()];
        for l in &self.layers {
            out[l.group] += 2 * l.n_kv_heads * l.head_dim * block_size * elem_bytes;
        }
        out
    }
}

/// Value type of host KV pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    F32,
    #[default]
    F16,
}

impl KvDtype {
    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => std::mem::size_of::<f32>(),
            KvDtype::F16 => std::mem::size_of::<f16>(),
        }
    }
}

/// One host pool (K or V of a layer), `[block][kv_head][slot][head_dim]`.
pub enum KvPool {
    F32(HugeVec<f32>),
    F16(HugeVec<f16>),
}

impl KvPool {
    /// `n` zeros, in the process's own mapping (`HugeVec`): the pool is sized for the worst
    /// case and mostly never written, and a fresh mapping stays unbacked until first use.
    pub fn zeroed(dtype: KvDtype, n: usize) -> KvPool {
        match dtype {
            KvDtype::F32 => KvPool::F32(HugeVec::zeroed(n)),
            KvDtype::F16 => KvPool::F16(HugeVec::zeroed(n)),
        }
    }

    fn len(&self) -> usize {
        match self {
            KvPool::F32(v) => v.len(),
            KvPool::F16(v) => v.len(),
        }
    }

    fn dtype(&self) -> KvDtype {
        match self {
            KvPool::F32(_) => KvDtype::F32,
            KvPool::F16(_) => KvDtype::F16,
        }
    }

    /// Back values `range` with memory now, in one call (`MADV_POPULATE_WRITE`), instead of
    /// one page fault per 4 KiB page on first write. Advice only: where the kernel lacks it,
    /// the pages fault in on first write as before.
    fn populate(&mut self, range: std::ops::Range<usize>) {
        let size = self.dtype().bytes();
        let ptr = match self {
            KvPool::F32(v) => v.as_mut_ptr() as usize,
            KvPool::F16(v) => v.as_mut_ptr() as usize,
        };
        let start = (ptr + range.start * size) & !(PAGE - 1);
        let end = ptr + range.end * size;
        if end > start {
            // SAFETY: the range lies in this pool's allocation (its start rounded down to a
            // page, which holds pool or allocator memory of this process), kept alive by
            // `&mut self`; populating does not change memory contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_POPULATE_WRITE) };
        }
    }

    /// The pool's values as f32 (a copy; for tests and inspection).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            KvPool::F32(v) => v.to_vec(),
            KvPool::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
}

pub struct LayerKv {
    pub spec: KvLayerSpec,
    pub k: KvPool,
    pub v: KvPool,
    /// Values of each pool, from the start, already backed by memory (`populate_to`).
    populated: usize,
}

/// Bytes of a page (the unit `madvise` takes).
const PAGE: usize = 4096;
/// Bytes of each pool backed at a time once writes pass the backed part.
const POPULATE_BYTES: usize = 2 << 20;

/// Where the pools are.
enum Storage {
    Host(Vec<LayerKv>),
    Device(Vec<DeviceKv>),
}

pub struct KvCache {
    /// Unique per cache in this process (a captured graph remembers which cache it writes).
    id: u64,
    storage: Storage,
    group_blocks: Vec<usize>,
    block_size: usize,
}

fn next_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

fn check_blocks(layout: &KvLayout, group_blocks: &[usize], block_size: usize) -> Result<()> {
    if block_size == 0 || group_blocks.len() != layout.groups.len() || group_blocks.contains(&0) {
        return Err(RuntimeError::Shape(format!(
            "KV cache needs blocks for each of its {} groups: {group_blocks:?} blocks of {block_size}",
            layout.groups.len()
        )));
    }
    Ok(())
}

impl KvCache {
    /// Host storage (f16, the default `KvDtype`) for `layout` with `group_blocks[g]` blocks of
    /// `block_size` in group `g`.
    pub fn new(layout: &KvLayout, group_blocks: &[usize], block_size: usize) -> Result<KvCache> {
        KvCache::with_dtype(layout, group_blocks, block_size, KvDtype::default())
    }

    /// Host storage of `dtype` values, as `new`.
    pub fn with_dtype(layout: &KvLayout, group_blocks: &[usize], block_size: usize, dtype: KvDtype) -> Result<KvCache> {
        check_blocks(layout, group_blocks, block_size)?;
        let layers = layout
            .layers
            .iter()
            .map(|&spec| {
                let n = group_blocks[spec.group] * block_size * spec.n_kv_heads * spec.head_dim;
                LayerKv::new(spec, KvPool::zeroed(dtype, n), KvPool::zeroed(dtype, n))
            })
            .collect();
        Ok(KvCache { id: next_id(), storage: Storage::Host(layers), group_blocks: group_blocks.to_vec(), block_size })
    }

    /// Device (bf16) storage on `gpu`, same shapes as `new`.
    pub fn on_device(gpu: &Gpu, layout: &KvLayout, group_blocks: &[usize], block_size: usize) -> Result<KvCache> {
        check_blocks(layout, group_blocks, block_size)?;
        let layers = layout
            .layers
            .iter()
            .map(|spec| DeviceKv::new(gpu, group_blocks[spec.group], block_size, spec.n_kv_heads, spec.head_dim))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(KvCache { id: next_id(), storage: Storage::Device(layers), group_blocks: group_blocks.to_vec(), block_size })
    }

    pub fn group_blocks(&self) -> &[usize] {
        &self.group_blocks
    }

    /// This cache's identity, unique in the process.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_layers(&self) -> usize {
        match &self.storage {
            Storage::Host(l) => l.len(),
            Storage::Device(l) => l.len(),
        }
    }

    /// Host layer `i`; an error for device storage or a layer that does not exist.
    pub fn layer_mut(&mut self, i: usize) -> Result<&mut LayerKv> {
        match &mut self.storage {
            Storage::Host(l) => {
                let n = l.len();
                l.get_mut(i).ok_or_else(|| RuntimeError::Shape(format!("KV layer {i} of {n}")))
            }
            Storage::Device(_) => Err(RuntimeError::Shape("a CPU model was given a KV cache on a CUDA device".into())),
        }
    }

    /// Device layer `i`; an error for host storage or a layer that does not exist.
    pub fn device_layer_mut(&mut self, i: usize) -> Result<&mut DeviceKv> {
        match &mut self.storage {
            Storage::Device(l) => {
                let n = l.len();
                l.get_mut(i).ok_or_else(|| RuntimeError::Shape(format!("KV layer {i} of {n}")))
            }
            Storage::Host(_) => Err(RuntimeError::Shape("a CUDA model was given a KV cache in host memory".into())),
        }
    }
}

impl LayerKv {
    pub fn new(spec: KvLayerSpec, k: KvPool, v: KvPool) -> LayerKv {
        LayerKv { spec, k, v, populated: 0 }
    }

    /// Back both pools up to value `end` before a write reaches it, `POPULATE_BYTES` of each
    /// pool at a time. Blocks are first handed out in order, so the write front moves up the
    /// pools; fresh pages faulted in one by one cost ~11 ms of a 1,024-token SmolLM2 prefill.
    pub(crate) fn populate_to(&mut self, end: usize) {
        if end <= self.populated {
            return;
        }
        let per = POPULATE_BYTES / self.k.dtype().bytes();
        let to = end.next_multiple_of(per).min(self.k.len());
        self.k.populate(self.populated..to);
        self.v.populate(self.populated..to);
        self.populated = to;
    }

    /// Offset of (block, head, slot) in `k`/`v`.
    #[inline]
    pub fn offset(&self, block_size: usize, block: usize, head: usize, slot: usize) -> usize {
        ((block * self.spec.n_kv_heads + head) * block_size + slot) * self.spec.head_dim
    }
}
