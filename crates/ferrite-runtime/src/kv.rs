//! `KvCache`: the physical storage of the paged KV cache.
//!
//! Every KV-owning layer has a K and a V pool of `num_blocks` blocks; a block holds
//! `block_size` positions. The layout of one pool is `[block][kv_head][slot][head_dim]`, so
//! the attention loop reads one head's keys contiguously. Which blocks a sequence owns is the
//! engine's business (block tables); this type only stores values.
//!
//! The pools live in host memory (the CPU op set) or on a CUDA device (the CUDA op set: bf16,
//! or int8 / int4 / fp8 codes read in place, `cuda::ops::kv_pool`); a model reads the storage
//! its ops need and gets an error for the other.
//!
//! Host pools hold f16 by default (`KvDtype`), or group-affine int8 / int4 codes read in place
//! by the attention kernels (`kv_quant`; a `KvScheme` picks the type of each layer). f16 over
//! f32: decode attention streams the whole cache every step and waits on memory, so half the
//! bytes of f32 is most of the time saved (SmolLM2, 8 rows of ~200 positions: attention 5.6 →
//! 4.1 ms a step). f16 keeps 11 bits of mantissa (bf16 only 8) and K/V values lie far inside
//! its range; every value is rounded once, when it is written, the same way whatever the
//! batch. f32 pools are the exact choice (parity tests against transformers' f32 logits). A
//! quantized cache may also keep f16 twin pools for rows before a delayed start (`kv_twin`).

use half::f16;

use std::sync::Arc;

use cudarc::driver::DevicePtr;

use crate::cuda::kv_copy::{CopyStream, KvRegion};
use crate::cuda::ops::{DeviceKv, DeviceStatePool};
use crate::cuda::Gpu;
use crate::error::{Result, RuntimeError};
use crate::hugemem::HugeVec;
use crate::kv_quant::{KvBits, QuantPool, KV_GROUP_SIZES};
use crate::kv_state::{StatePool, StateSpec};

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
    /// A fixed-size recurrent state per sequence (linear attention): its "blocks" are state
    /// slots of the layers in `KvLayout::states` (`kv_state`).
    Recurrent,
}

/// The KV layout of a model: its groups, its KV-owning layers and its recurrent-state layers.
/// Layers that read another layer's KV (shared / donor layers) own nothing and are not listed;
/// the model maps them to their donor's index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    pub groups: Vec<KvGroupKind>,
    pub layers: Vec<KvLayerSpec>,
    /// Layers keeping a recurrent state (gated DeltaNet), in a `Recurrent` group's slots.
    pub states: Vec<StateSpec>,
}

impl KvLayout {
    /// One full-attention group for `n` identical layers.
    pub fn uniform(n: usize, n_kv_heads: usize, head_dim: usize, kind: KvGroupKind) -> KvLayout {
        KvLayout {
            groups: vec![kind],
            layers: vec![KvLayerSpec { n_kv_heads, head_dim, group: 0 }; n],
            states: Vec::new(),
        }
    }

    /// The recurrent group, if the model keeps recurrent state.
    pub fn recurrent_group(&self) -> Option<usize> {
        self.groups.iter().position(|g| *g == KvGroupKind::Recurrent)
    }

    /// Host bytes (default `KvDtype`) one block of `block_size` positions takes, per group.
    pub fn block_bytes(&self, block_size: usize) -> Vec<usize> {
        self.block_bytes_with(block_size, &vec![KvDtype::default(); self.layers.len()])
    }

    /// Bytes one block of `block_size` positions takes, per group, with layer `i`'s pools
    /// holding `dtypes[i]`.
    pub fn block_bytes_with(&self, block_size: usize, dtypes: &[KvDtype]) -> Vec<usize> {
        let mut out = vec![0; self.groups.len()];
        for (l, d) in self.layers.iter().zip(dtypes) {
            out[l.group] += 2 * l.n_kv_heads * d.head_block_bytes(block_size, l.head_dim);
        }
        // A state slot is one "block" of a recurrent group, whatever the block size.
        for s in &self.states {
            out[s.group] += s.slot_bytes();
        }
        out
    }

    /// The value type of each layer's pools under `scheme`; an error names a group size the
    /// head dim does not take.
    pub fn layer_dtypes(&self, scheme: &KvScheme) -> Result<Vec<KvDtype>> {
        let n = self.layers.len();
        self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let sliding = matches!(self.groups.get(l.group), Some(KvGroupKind::Sliding { .. }));
                let dtype = if scheme.skip.keeps(i, n, sliding) { KvDtype::default() } else { scheme.dtype };
                dtype.check(l.head_dim).map(|()| dtype)
            })
            .collect()
    }
}

/// Value type of KV pools. On a CUDA device `F16` stands for the device's 16-bit pools,
/// which hold bf16 (the same bytes a value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    F32,
    #[default]
    F16,
    /// fp8 e4m3 codes with one f32 scale per layer and KV head (CUDA pools only; each
    /// block carries the scale of each of its heads, `cuda::ops::kv_pool`).
    Fp8,
    /// Group-affine codes (`kv_quant`), `group` values a scale and bias.
    Int8 {
        group: usize,
    },
    Int4 {
        group: usize,
    },
}

impl KvDtype {
    /// Bytes one row (a token's head) of `head_dim` values takes.
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            KvDtype::F32 => 4 * head_dim,
            KvDtype::F16 => 2 * head_dim,
            KvDtype::Fp8 => head_dim,
            KvDtype::Int8 { group } => head_dim + 4 * head_dim / group,
            KvDtype::Int4 { group } => head_dim / 2 + 4 * head_dim / group,
        }
    }

    /// Bytes one block of `block_size` slots of one KV head takes: its rows, and an fp8
    /// block's scale.
    pub fn head_block_bytes(self, block_size: usize, head_dim: usize) -> usize {
        block_size * self.row_bytes(head_dim) + if self == KvDtype::Fp8 { 4 } else { 0 }
    }

    /// The group-affine code width and group size, for int8 and int4.
    pub fn quantized(self) -> Option<(KvBits, usize)> {
        match self {
            KvDtype::F32 | KvDtype::F16 | KvDtype::Fp8 => None,
            KvDtype::Int8 { group } => Some((KvBits::Int8, group)),
            KvDtype::Int4 { group } => Some((KvBits::Int4, group)),
        }
    }

    /// Whether rows of `head_dim` values can be held: a quantized type's group size must be
    /// one of `KV_GROUP_SIZES` and divide the head dim.
    pub fn check(self, head_dim: usize) -> Result<()> {
        match self.quantized() {
            Some((_, group)) if !KV_GROUP_SIZES.contains(&group) => {
                Err(RuntimeError::Shape(format!("KV group size {group} is not one of {KV_GROUP_SIZES:?}")))
            }
            Some((_, group)) if !head_dim.is_multiple_of(group) => {
                Err(RuntimeError::Shape(format!("KV group size {group} does not divide the head dim {head_dim}")))
            }
            _ => Ok(()),
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvDtype::F32 => f.write_str("f32"),
            KvDtype::F16 => f.write_str("f16"),
            KvDtype::Fp8 => f.write_str("fp8"),
            KvDtype::Int8 { group } => write!(f, "int8/g{group}"),
            KvDtype::Int4 { group } => write!(f, "int4/g{group}"),
        }
    }
}

/// Layers whose pools stay at full precision under a quantized `KvScheme`
/// (`--kv-cache-skip-layers`). Layer indices count KV-owning layers (`KvLayout::layers`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum KvSkip {
    #[default]
    None,
    /// Sliding-window layers.
    Sliding,
    First(usize),
    Last(usize),
    List(Vec<usize>),
}

impl KvSkip {
    /// Whether layer `i` of `n` (sliding or not) keeps full precision.
    fn keeps(&self, i: usize, n: usize, sliding: bool) -> bool {
        match self {
            KvSkip::None => false,
            KvSkip::Sliding => sliding,
            KvSkip::First(k) => i < *k,
            KvSkip::Last(k) => i + k >= n,
            KvSkip::List(l) => l.contains(&i),
        }
    }
}

impl std::str::FromStr for KvSkip {
    type Err = String;

    /// `sliding`, `first:N`, `last:N` or a comma-separated list of layer indices.
    fn from_str(s: &str) -> std::result::Result<KvSkip, String> {
        let s = s.trim();
        let num = |v: &str| v.trim().parse::<usize>().map_err(|_| format!("'{v}' is not a layer count or index"));
        if s.eq_ignore_ascii_case("sliding") {
            Ok(KvSkip::Sliding)
        } else if let Some(n) = s.strip_prefix("first:") {
            num(n).map(KvSkip::First)
        } else if let Some(n) = s.strip_prefix("last:") {
            num(n).map(KvSkip::Last)
        } else {
            s.split(',').map(num).collect::<std::result::Result<_, _>>().map(KvSkip::List)
        }
    }
}

/// What the host KV pools hold: a value type for the cache and the layers it skips.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KvScheme {
    pub dtype: KvDtype,
    pub skip: KvSkip,
}

impl std::fmt::Display for KvScheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.skip {
            KvSkip::None => write!(f, "{}", self.dtype),
            skip => write!(f, "{} (full precision: {skip:?})", self.dtype),
        }
    }
}

/// One host pool (K or V of a layer), `[block][kv_head][slot][head_dim]`.
pub enum KvPool {
    F32(HugeVec<f32>),
    F16(HugeVec<f16>),
    Quant(QuantPool),
}

impl KvPool {
    /// `n` zeros, in the process's own mapping (`HugeVec`): the pool is sized for the worst
    /// case and mostly never written, and a fresh mapping stays unbacked until first use.
    /// A quantized `n` is a whole number of groups (`KvDtype::check`).
    ///
    /// # Panics
    /// For fp8, which has no host pool (`KvCache::with_scheme` refuses it before).
    pub fn zeroed(dtype: KvDtype, n: usize) -> KvPool {
        match dtype {
            KvDtype::F32 => KvPool::F32(HugeVec::zeroed(n)),
            KvDtype::F16 => KvPool::F16(HugeVec::zeroed(n)),
            KvDtype::Int8 { group } => KvPool::Quant(QuantPool::zeroed(KvBits::Int8, group, n)),
            KvDtype::Int4 { group } => KvPool::Quant(QuantPool::zeroed(KvBits::Int4, group, n)),
            KvDtype::Fp8 => panic!("{FP8_ON_HOST}"),
        }
    }

    /// The pool's raw bytes, as a block's are serialised: the values of a float pool (one
    /// part), or a quantized pool's codes then its groups' (scale, bias) (for tests and tools
    /// that copy a host pool into a device one).
    pub fn raw_parts(&self) -> [&[u8]; 2] {
        self.bytes(0..self.len())
    }

    fn len(&self) -> usize {
        match self {
            KvPool::F32(v) => v.len(),
            KvPool::F16(v) => v.len(),
            KvPool::Quant(q) => q.len(),
        }
    }

    /// Values whose memory `POPULATE_BYTES` covers.
    fn values_per_populate(&self) -> usize {
        match self {
            KvPool::F32(_) => POPULATE_BYTES / 4,
            KvPool::F16(_) => POPULATE_BYTES / 2,
            KvPool::Quant(q) => POPULATE_BYTES * 8 / q.bits().bits(),
        }
    }

    /// Back values `range` with memory now, in one call (`MADV_POPULATE_WRITE`), instead of
    /// one page fault per 4 KiB page on first write. Advice only: where the kernel lacks it,
    /// the pages fault in on first write as before.
    fn populate(&mut self, range: std::ops::Range<usize>) {
        let regions = match self {
            KvPool::F32(v) => {
                [(v.as_mut_ptr() as *mut u8, range.start * 4..range.end * 4), (std::ptr::null_mut(), 0..0)]
            }
            KvPool::F16(v) => {
                [(v.as_mut_ptr() as *mut u8, range.start * 2..range.end * 2), (std::ptr::null_mut(), 0..0)]
            }
            KvPool::Quant(q) => q.regions_mut(range),
        };
        for (ptr, bytes) in regions {
            let start = (ptr as usize + bytes.start) & !(PAGE - 1);
            let end = ptr as usize + bytes.end;
            if !ptr.is_null() && end > start {
                // SAFETY: the range lies in this pool's allocation (its start rounded down to
                // a page, which holds pool or allocator memory of this process), kept alive by
                // `&mut self`; populating does not change memory contents.
                unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_POPULATE_WRITE) };
            }
        }
    }

    /// What the pool holds.
    fn dtype(&self) -> KvDtype {
        match self {
            KvPool::F32(_) => KvDtype::F32,
            KvPool::F16(_) => KvDtype::F16,
            KvPool::Quant(q) => match q.bits() {
                KvBits::Int8 => KvDtype::Int8 { group: q.group() },
                KvBits::Int4 => KvDtype::Int4 { group: q.group() },
            },
        }
    }

    /// The raw bytes of values `range` (what a block serialises to): the values of a float
    /// pool; the codes, then the groups' (scale, bias), of a quantized one.
    fn bytes(&self, range: std::ops::Range<usize>) -> [&[u8]; 2] {
        match self {
            KvPool::F32(v) => [bytemuck::cast_slice(&v[range]), &[]],
            KvPool::F16(v) => [bytemuck::cast_slice(&v[range]), &[]],
            KvPool::Quant(q) => q.bytes(range),
        }
    }

    /// The raw bytes of values `range`, to overwrite, as `bytes` gives them.
    fn bytes_mut(&mut self, range: std::ops::Range<usize>) -> [&mut [u8]; 2] {
        match self {
            KvPool::F32(v) => [bytemuck::cast_slice_mut(&mut v[range]), &mut []],
            KvPool::F16(v) => [bytemuck::cast_slice_mut(&mut v[range]), &mut []],
            KvPool::Quant(q) => q.bytes_mut(range),
        }
    }

    /// The pool's values as f32 (a copy, dequantized; for tests and inspection).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            KvPool::F32(v) => v.to_vec(),
            KvPool::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            KvPool::Quant(q) => {
                let mut out = vec![0.0; q.len()];
                q.widen(0, &mut out);
                out
            }
        }
    }
}

pub struct LayerKv {
    pub spec: KvLayerSpec,
    pub k: KvPool,
    pub v: KvPool,
    /// Values of each pool, from the start, already backed by memory (`populate_to`).
    populated: usize,
    /// The full-precision (f16) twin pools of a quantized cache with a delayed start
    /// (`kv_twin`): the blocks of rows before their transition, by their own block ids.
    pub full: Option<Box<LayerKv>>,
    /// `[n_kv_heads][head_dim]` subtracted from every key a quantized K pool stores
    /// (`KvCache::set_key_offsets`).
    pub key_offset: Option<Vec<f32>>,
}

/// Why a host cache has no fp8 pools.
const FP8_ON_HOST: &str = "an fp8 KV cache needs a GPU; on the CPU use int8 (the same bytes a value, group-affine)";

/// Bytes of a page (the unit `madvise` takes).
const PAGE: usize = 4096;
/// Bytes of each pool backed at a time once writes pass the backed part.
const POPULATE_BYTES: usize = 2 << 20;

/// Where the pools are.
pub(crate) enum Storage {
    Host(Vec<LayerKv>),
    Device(DevicePools),
}

/// Pools on a CUDA device: each layer's, the KV group of each, the recurrent states of
/// `KvLayout::states` (slots of their group, as the layers' blocks: a slot is a block of the
/// recurrent group to the block copies), and the stream block copies to and from host memory
/// run on (`kv_host`).
pub(crate) struct DevicePools {
    layers: Vec<DeviceKv>,
    groups: Vec<usize>,
    states: Vec<DeviceStatePool>,
    pub(crate) copies: Arc<CopyStream>,
}

impl DevicePools {
    fn group_block_bytes(&self, group: usize) -> usize {
        let kv: usize =
            self.layers.iter().zip(&self.groups).filter(|(_, &g)| g == group).map(|(l, _)| 2 * l.block_bytes()).sum();
        kv + self.states.iter().filter(|s| s.spec.group == group).map(|s| s.spec.slot_bytes()).sum::<usize>()
    }

    /// The pieces of a block of each of `n_groups` groups, in the order of a whole block's
    /// bytes as a host cache's (`host_block_parts`): each layer's K block, then its V block (a
    /// quantized pool's codes, then its parameters); then each state layer's slot, its
    /// convolution window, then its recurrent matrices. For the block copies (`kv_copy.rs`).
    fn block_pieces(
        gpu: &Gpu,
        layers: &[DeviceKv],
        groups: &[usize],
        states: &[DeviceStatePool],
        n_groups: usize,
    ) -> Vec<Vec<KvRegion>> {
        let mut out = vec![Vec::new(); n_groups];
        let region = |base: u64, len: usize| KvRegion { base, stride: len as u64, len: len as u64, offset: 0 };
        for (l, &g) in layers.iter().zip(groups) {
            for pool in [&l.k, &l.v] {
                for (len, part) in l.block_part_bytes().into_iter().zip(pool.parts()) {
                    if let Some(part) = part.filter(|_| len > 0) {
                        out[g].push(region(part.device_ptr(gpu.stream()).0, len));
                    }
                }
            }
        }
        for s in states {
            let parts = [(&s.conv, s.spec.conv_values()), (&s.ssm, s.spec.ssm_values())];
            for (values, n) in parts.into_iter().filter(|&(_, n)| n > 0) {
                out[s.spec.group].push(region(values.device_ptr(gpu.stream()).0, 4 * n));
            }
        }
        out
    }
}

pub struct KvCache {
    /// Unique per cache in this process (a captured graph remembers which cache it writes).
    id: u64,
    pub(crate) storage: Storage,
    /// The recurrent states of `KvLayout::states` (host memory only).
    pub(crate) states: Vec<StatePool>,
    group_blocks: Vec<usize>,
    pub(crate) block_size: usize,
    /// Blocks per group of the full-precision twin pools (`kv_twin`); empty without them.
    pub(crate) full_blocks: Vec<usize>,
}

/// The raw bytes of `block` of `group` in host pools, in the order of a whole block's bytes
/// (each layer's K block, then its V block; a quantized pool's codes, then its parameters);
/// a recurrent group's block is a state slot: each state layer's convolution window, then its
/// recurrent matrices. `block` must exist.
pub(crate) fn host_block_parts<'a>(
    layers: &'a [LayerKv],
    states: &'a [StatePool],
    group: usize,
    block: usize,
    block_size: usize,
) -> impl Iterator<Item = &'a [u8]> {
    let kv = layers.iter().filter(move |l| l.spec.group == group).flat_map(move |l| {
        let range = l.block_range(block_size, block);
        l.k.bytes(range.clone()).into_iter().chain(l.v.bytes(range))
    });
    kv.chain(states.iter().filter(move |s| s.spec.group == group).flat_map(move |s| s.slot_parts(block)))
}

/// `host_block_parts`, to overwrite.
pub(crate) fn host_block_parts_mut<'a>(
    layers: &'a mut [LayerKv],
    states: &'a mut [StatePool],
    group: usize,
    block: usize,
    block_size: usize,
) -> impl Iterator<Item = &'a mut [u8]> {
    let kv = layers.iter_mut().filter(move |l| l.spec.group == group).flat_map(move |l| {
        let range = l.block_range(block_size, block);
        let (k, v) = (&mut l.k, &mut l.v);
        k.bytes_mut(range.clone()).into_iter().chain(v.bytes_mut(range))
    });
    kv.chain(states.iter_mut().filter(move |s| s.spec.group == group).flat_map(move |s| s.slot_parts_mut(block)))
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
        KvCache::with_scheme(layout, group_blocks, block_size, &KvScheme::default())
    }

    /// Host storage with each layer's pools of the value type `scheme` gives it, as `new`.
    pub fn with_scheme(
        layout: &KvLayout,
        group_blocks: &[usize],
        block_size: usize,
        scheme: &KvScheme,
    ) -> Result<KvCache> {
        check_blocks(layout, group_blocks, block_size)?;
        let dtypes = layout.layer_dtypes(scheme)?;
        if dtypes.contains(&KvDtype::Fp8) {
            return Err(RuntimeError::Unsupported(FP8_ON_HOST.into()));
        }
        let layers = layout
            .layers
            .iter()
            .zip(dtypes)
            .map(|(&spec, dtype)| {
                let n = group_blocks[spec.group] * block_size * spec.n_kv_heads * spec.head_dim;
                LayerKv::new(spec, KvPool::zeroed(dtype, n), KvPool::zeroed(dtype, n))
            })
            .collect();
        let states = layout.states.iter().map(|&spec| StatePool::zeroed(spec, group_blocks[spec.group])).collect();
        Ok(KvCache {
            id: next_id(),
            storage: Storage::Host(layers),
            states,
            group_blocks: group_blocks.to_vec(),
            block_size,
            full_blocks: Vec::new(),
        })
    }

    /// Device (bf16) storage on `gpu`, same shapes as `new`.
    pub fn on_device(gpu: &Gpu, layout: &KvLayout, group_blocks: &[usize], block_size: usize) -> Result<KvCache> {
        KvCache::on_device_with_scheme(gpu, layout, group_blocks, block_size, &KvScheme::default())
    }

    /// Device storage with each layer's pools of the type `scheme` gives it (`F16`: bf16;
    /// int8, int4 or fp8: read in place by the attention kernels), as `on_device`.
    pub fn on_device_with_scheme(
        gpu: &Gpu,
        layout: &KvLayout,
        group_blocks: &[usize],
        block_size: usize,
        scheme: &KvScheme,
    ) -> Result<KvCache> {
        check_blocks(layout, group_blocks, block_size)?;
        let states = (layout.states.iter())
            .map(|&spec| DeviceStatePool::zeroed(gpu, spec, group_blocks[spec.group]))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let layers = layout
            .layers
            .iter()
            .zip(layout.layer_dtypes(scheme)?)
            .map(|(spec, dtype)| {
                DeviceKv::with_dtype(gpu, group_blocks[spec.group], block_size, spec.n_kv_heads, spec.head_dim, dtype)
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let groups: Vec<usize> = layout.layers.iter().map(|l| l.group).collect();
        let pieces = DevicePools::block_pieces(gpu, &layers, &groups, &states, layout.groups.len());
        let copies = Arc::new(CopyStream::new(gpu, pieces)?);
        let pools = DevicePools { layers, groups, states, copies };
        Ok(KvCache {
            id: next_id(),
            storage: Storage::Device(pools),
            states: Vec::new(),
            group_blocks: group_blocks.to_vec(),
            block_size,
            full_blocks: Vec::new(),
        })
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
            Storage::Device(d) => d.layers.len(),
        }
    }

    /// What a block's bytes mean: the storage and value type of the pools (part of the
    /// prefix cache's namespace, so bytes are never restored into pools of another kind).
    pub fn scheme(&self) -> String {
        match &self.storage {
            Storage::Host(l) => {
                let offsets = if l.iter().any(|l| l.key_offset.is_some()) { "-key-offsets" } else { "" };
                format!("host-{:?}{offsets}", l.iter().map(|l| l.k.dtype()).collect::<Vec<_>>())
            }
            // All bf16: the name it has always had (SSD files written before stay valid).
            Storage::Device(d) if d.layers.iter().all(|l| l.dtype == KvDtype::F16) => "device-bf16".into(),
            Storage::Device(d) => format!("device-{:?}", d.layers.iter().map(|l| l.dtype).collect::<Vec<_>>()),
        }
    }

    /// Bytes of one block of `group` (`kv_host` gives their order): K then V of each of
    /// the group's layers, in layer order; a recurrent group's block is a state slot.
    pub fn group_block_bytes(&self, group: usize) -> usize {
        match &self.storage {
            Storage::Host(l) => host_block_parts(l, &self.states, group, 0, self.block_size).map(<[u8]>::len).sum(),
            Storage::Device(d) => d.group_block_bytes(group),
        }
    }

    pub(crate) fn check_block(&self, group: usize, block: usize) -> Result<()> {
        match self.group_blocks.get(group) {
            Some(&n) if block < n => Ok(()),
            _ => Err(RuntimeError::Shape(format!("KV block {block} of group {group} does not exist"))),
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

    /// The recurrent state of state layer `i` (`KvLayout::states`).
    pub fn state_mut(&mut self, i: usize) -> Result<&mut StatePool> {
        let n = self.states.len();
        self.states.get_mut(i).ok_or_else(|| RuntimeError::Shape(format!("state layer {i} of {n}")))
    }

    /// The device recurrent state of state layer `i` (`KvLayout::states`); an error for host
    /// storage or a state layer that does not exist.
    pub fn device_state_mut(&mut self, i: usize) -> Result<&mut DeviceStatePool> {
        match &mut self.storage {
            Storage::Device(d) => {
                let n = d.states.len();
                d.states.get_mut(i).ok_or_else(|| RuntimeError::Shape(format!("state layer {i} of {n}")))
            }
            Storage::Host(_) => Err(RuntimeError::Shape("a CUDA model was given a KV cache in host memory".into())),
        }
    }

    /// Device layer `i`; an error for host storage or a layer that does not exist.
    pub fn device_layer_mut(&mut self, i: usize) -> Result<&mut DeviceKv> {
        match &mut self.storage {
            Storage::Device(d) => {
                let n = d.layers.len();
                d.layers.get_mut(i).ok_or_else(|| RuntimeError::Shape(format!("KV layer {i} of {n}")))
            }
            Storage::Host(_) => Err(RuntimeError::Shape("a CUDA model was given a KV cache in host memory".into())),
        }
    }
}

impl LayerKv {
    pub fn new(spec: KvLayerSpec, k: KvPool, v: KvPool) -> LayerKv {
        LayerKv { spec, k, v, populated: 0, full: None, key_offset: None }
    }

    /// Back both pools up to value `end` before a write reaches it, `POPULATE_BYTES` of each
    /// pool at a time. Blocks are first handed out in order, so the write front moves up the
    /// pools; fresh pages faulted in one by one cost ~11 ms of a 1,024-token SmolLM2 prefill.
    pub(crate) fn populate_to(&mut self, end: usize) {
        if end <= self.populated {
            return;
        }
        let per = self.k.values_per_populate();
        let to = end.next_multiple_of(per).min(self.k.len());
        self.k.populate(self.populated..to);
        self.v.populate(self.populated..to);
        self.populated = to;
    }

    /// Values of one block of one pool.
    pub(crate) fn block_values(&self, block_size: usize) -> usize {
        self.spec.n_kv_heads * block_size * self.spec.head_dim
    }

    /// The values of `block` in `k`/`v` (a block is contiguous: `[kv_head][slot][head_dim]`).
    pub(crate) fn block_range(&self, block_size: usize, block: usize) -> std::ops::Range<usize> {
        let start = self.offset(block_size, block, 0, 0);
        start..start + self.block_values(block_size)
    }

    /// Offset of (block, head, slot) in `k`/`v`.
    #[inline]
    pub fn offset(&self, block_size: usize, block: usize, head: usize, slot: usize) -> usize {
        ((block * self.spec.n_kv_heads + head) * block_size + slot) * self.spec.head_dim
    }
}
