//! `HostBlocks`: whole KV blocks in host memory, and the block copies between a `KvCache`
//! and it — what the tiers below the pool (host RAM, SSD) move blocks through.
//!
//! A slot holds one block of every KV group: each group's bytes at its offset
//! (`KvCache::group_offset`), each group's layers in order, K then V, as raw values (f16 /
//! f32 values, or a quantized pool's codes then its groups' scales and biases; bf16 on a
//! device). Memory is taken in chunks as slots are first written, so a large budget costs
//! nothing until used.
//!
//! For a host pool a copy is a `memcpy`, done when the call returns. For a device pool the
//! memory is page-locked and a copy is queued on the cache's copy stream (`cuda::kv_copy`):
//! the call returns at once, `KvCache::fence` orders the next step after it, and this memory
//! is read or overwritten by the host only after the copies queued into or out of it finished
//! (`bytes` and `write` wait for them).

use crate::cuda::kv_copy::{CopyStream, PinnedChunk};
use crate::cuda::CudaResult;
use crate::error::{Result, RuntimeError};
use crate::kv::{host_block_parts, host_block_parts_mut, KvCache, Storage};

use std::sync::Arc;

/// Bytes of host memory taken at a time (whole slots).
const CHUNK_BYTES: usize = 256 << 20;

enum Chunk {
    Plain(Vec<u8>),
    Pinned(PinnedChunk),
}

impl Chunk {
    fn bytes(&self) -> &[u8] {
        match self {
            Chunk::Plain(v) => v,
            Chunk::Pinned(p) => p.as_slice(),
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Chunk::Plain(v) => v,
            Chunk::Pinned(p) => p.as_mut_slice(),
        }
    }
}

/// The copy stream of a device cache and the event after the last copy into or out of this
/// memory.
struct DeviceSide {
    copies: Arc<CopyStream>,
    done: cudarc::driver::CudaEvent,
}

pub struct HostBlocks {
    slot_bytes: usize,
    slots: usize,
    per_chunk: usize,
    chunks: Vec<Option<Chunk>>,
    device: Option<DeviceSide>,
}

impl HostBlocks {
    /// Room for `slots` blocks of `slot_bytes` bytes.
    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Bytes of host memory taken so far.
    pub fn allocated_bytes(&self) -> usize {
        self.chunks.iter().flatten().map(|c| c.bytes().len()).sum()
    }

    /// Wait until the copies queued into or out of this memory have finished.
    fn settle(&self) -> Result<()> {
        if let Some(d) = &self.device {
            d.done.synchronize().map_err(crate::cuda::CudaError::from)?;
        }
        Ok(())
    }

    fn locate(&self, slot: usize) -> Result<(usize, usize)> {
        if slot >= self.slots {
            return Err(RuntimeError::Shape(format!("host KV slot {slot} of {}", self.slots)));
        }
        Ok((slot / self.per_chunk, (slot % self.per_chunk) * self.slot_bytes))
    }

    /// Slot `slot`'s bytes; an error for a slot never written.
    fn slot(&self, slot: usize) -> Result<&[u8]> {
        let (c, at) = self.locate(slot)?;
        let chunk =
            self.chunks[c].as_ref().ok_or_else(|| RuntimeError::Shape(format!("host KV slot {slot} is empty")))?;
        Ok(&chunk.bytes()[at..at + self.slot_bytes])
    }

    /// Slot `slot`'s bytes to overwrite, taking its chunk's memory on first use.
    fn slot_mut(&mut self, slot: usize) -> Result<&mut [u8]> {
        let (c, at) = self.locate(slot)?;
        let bytes = self.per_chunk.min(self.slots - c * self.per_chunk) * self.slot_bytes;
        if self.chunks[c].is_none() {
            self.chunks[c] = Some(match &self.device {
                Some(d) => Chunk::Pinned(PinnedChunk::new(&d.copies, bytes)?),
                None => Chunk::Plain(vec![0; bytes]),
            });
        }
        let n = self.slot_bytes;
        let chunk = self.chunks[c].as_mut().ok_or_else(|| RuntimeError::Shape("host KV chunk".into()))?;
        Ok(&mut chunk.bytes_mut()[at..at + n])
    }

    /// The bytes of `slot` (after the copies queued into it finished).
    pub fn bytes(&self, slot: usize) -> Result<&[u8]> {
        self.settle()?;
        self.slot(slot)
    }

    /// Overwrite the start of `slot` with `bytes` (after queued copies out of it finished).
    pub fn write(&mut self, slot: usize, bytes: &[u8]) -> Result<()> {
        if bytes.len() > self.slot_bytes {
            return Err(RuntimeError::Shape(format!(
                "{} bytes for a host KV slot of {}",
                bytes.len(),
                self.slot_bytes
            )));
        }
        self.settle()?;
        self.slot_mut(slot)?[..bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn record(&self) -> CudaResult<()> {
        match &self.device {
            Some(d) => d.copies.record(&d.done),
            None => Ok(()),
        }
    }
}

impl Drop for HostBlocks {
    /// A queued copy may still read or write this memory.
    fn drop(&mut self) {
        let _ = self.settle();
    }
}

impl KvCache {
    /// Host memory for `slots` whole blocks of this cache (page-locked for a device cache).
    pub fn host_blocks(&self, slots: usize) -> Result<HostBlocks> {
        let slot_bytes = self.block_bytes();
        let device = match &self.storage {
            Storage::Host(_) => None,
            Storage::Device(d) => Some(DeviceSide { done: d.copies.new_event()?, copies: d.copies.clone() }),
        };
        let per_chunk = (CHUNK_BYTES / slot_bytes.max(1)).max(1);
        let chunks = (0..slots.div_ceil(per_chunk)).map(|_| None).collect();
        Ok(HostBlocks { slot_bytes, slots, per_chunk, chunks, device })
    }

    /// Bytes of one whole block (every group).
    pub fn block_bytes(&self) -> usize {
        (0..self.group_blocks().len()).map(|g| self.group_block_bytes(g)).sum()
    }

    /// Where `group`'s bytes start in a whole block.
    pub fn group_offset(&self, group: usize) -> usize {
        (0..group).map(|g| self.group_block_bytes(g)).sum()
    }

    fn check_host(&self, host: &HostBlocks) -> Result<()> {
        let device = matches!(self.storage, Storage::Device(_));
        if host.slot_bytes != self.block_bytes() || host.device.is_some() != device {
            return Err(RuntimeError::Shape("host KV blocks made for another cache".into()));
        }
        Ok(())
    }

    /// Copy `block` of `group` into `slot` of `host` (at the group's offset). A device
    /// cache queues the copy (see the module docs).
    pub fn save_block(&self, group: usize, block: usize, host: &mut HostBlocks, slot: usize) -> Result<()> {
        self.check_host(host)?;
        self.check_block(group, block)?;
        let at = self.group_offset(group);
        let n = self.group_block_bytes(group);
        let dst = &mut host.slot_mut(slot)?[at..at + n];
        match &self.storage {
            Storage::Host(layers) => {
                let mut off = 0;
                for part in host_block_parts(layers, group, block, self.block_size) {
                    dst[off..off + part.len()].copy_from_slice(part);
                    off += part.len();
                }
            }
            Storage::Device(d) => {
                let mut off = 0;
                for (src, len) in d.block_regions(group, block) {
                    // SAFETY: `src` addresses `len` bytes of a pool of this cache (in bounds,
                    // `check_block`), alive while `host` lives: the cache and `host` share the
                    // copy stream, whose drop waits for its copies; `dst` is page-locked
                    // memory of `host`, which waits for the event recorded below before the
                    // host touches or frees it.
                    unsafe { d.copies.save(src, &mut dst[off..off + len]) }?;
                    off += len;
                }
                host.record()?;
            }
        }
        Ok(())
    }

    /// Overwrite `block` of `group` with its bytes in `slot` of `host`. A device cache queues
    /// the copy; the next step waits for it (`fence`).
    pub fn load_block(&mut self, group: usize, block: usize, host: &HostBlocks, slot: usize) -> Result<()> {
        self.check_host(host)?;
        self.check_block(group, block)?;
        let at = self.group_offset(group);
        let n = self.group_block_bytes(group);
        let src = &host.slot(slot)?[at..at + n];
        let bs = self.block_size;
        match &mut self.storage {
            Storage::Host(layers) => {
                let mut off = 0;
                for dst in host_block_parts_mut(layers, group, block, bs) {
                    let len = dst.len();
                    dst.copy_from_slice(&src[off..off + len]);
                    off += len;
                }
            }
            Storage::Device(d) => {
                let mut off = 0;
                for (dst, len) in d.block_regions(group, block) {
                    // SAFETY: as in `save_block`, the other way: `dst` is in bounds of a pool
                    // of this cache, and `host` does not write or free `src` before the event
                    // recorded below has fired.
                    unsafe { d.copies.load(&src[off..off + len], dst) }?;
                    off += len;
                }
                host.record()?;
            }
        }
        Ok(())
    }

    /// Make the next step wait for the block copies queued so far (a device cache; a host
    /// cache copies synchronously).
    pub fn fence(&self) -> Result<()> {
        if let Storage::Device(d) = &self.storage {
            d.copies.fence()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::kv::{KvDtype, KvGroupKind, KvLayerSpec, KvLayout, KvScheme};
    use crate::KvCache;

    #[test]
    fn a_block_saved_and_loaded_moves_exactly_its_values() {
        let layout = KvLayout {
            groups: vec![KvGroupKind::Full, KvGroupKind::Sliding { window: 4 }],
            layers: vec![
                KvLayerSpec { n_kv_heads: 2, head_dim: 16, group: 0 },
                KvLayerSpec { n_kv_heads: 1, head_dim: 32, group: 1 },
                KvLayerSpec { n_kv_heads: 2, head_dim: 16, group: 0 },
            ],
            states: Vec::new(),
        };
        let cache = |dtype| {
            let scheme = KvScheme { dtype, ..Default::default() };
            KvCache::with_scheme(&layout, &[3, 3], 2, &scheme).unwrap()
        };
        let dtypes = [KvDtype::F16, KvDtype::F32, KvDtype::Int8 { group: 16 }, KvDtype::Int4 { group: 16 }];
        for dtype in dtypes {
            let mut kv = cache(dtype);
            // Two layers of group 0, K and V each: 2 heads × 2 slots of 16 values.
            let g0 = kv.group_block_bytes(0);
            assert_eq!(g0, 2 * 2 * 2 * 2 * dtype.row_bytes(16), "{dtype:?}");
            assert_eq!(kv.block_bytes(), g0 + kv.group_block_bytes(1));
            let mut host = kv.host_blocks(3).unwrap();
            let bytes: Vec<u8> = (0..kv.block_bytes()).map(|i| (i % 60) as u8 + 1).collect();
            host.write(2, &bytes).unwrap();
            kv.load_block(0, 1, &host, 2).unwrap();
            kv.save_block(0, 1, &mut host, 0).unwrap();
            assert_eq!(&host.bytes(0).unwrap()[..g0], &bytes[..g0]);
            // Its neighbours and the other group are untouched.
            for (g, b) in [(0, 0), (0, 2), (1, 1)] {
                kv.save_block(g, b, &mut host, 1).unwrap();
                let at = kv.group_offset(g);
                let part = &host.bytes(1).unwrap()[at..at + kv.group_block_bytes(g)];
                assert!(part.iter().all(|&x| x == 0), "block {b} of group {g}");
            }
            assert!(kv.save_block(0, 3, &mut host, 0).is_err());
            assert!(kv.save_block(0, 0, &mut host, 3).is_err());
            assert!(host.write(0, &vec![0; kv.block_bytes() + 1]).is_err());
            // Blocks of another cache's shape are refused.
            let other = cache(if dtype == KvDtype::F32 { KvDtype::F16 } else { KvDtype::F32 });
            assert!(other.save_block(0, 0, &mut host, 0).is_err());
        }
        let schemes: std::collections::HashSet<String> = dtypes.iter().map(|&d| cache(d).scheme()).collect();
        assert_eq!(schemes.len(), dtypes.len(), "{schemes:?}");
    }
}
