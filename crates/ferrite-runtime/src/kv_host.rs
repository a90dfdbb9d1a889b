//! `HostBlocks`: whole KV blocks in host memory, and the block copies between a `KvCache`
//! and it — what the tiers below the pool (host RAM, SSD) move blocks through.
//!
//! A slot holds one block of each KV group the memory was made for (every group, or some of
//! them: `KvCache::host_blocks_for`), in group order: each group's layers in order, K then V,
//! as raw values (f16 / f32 values, or a quantized pool's codes then its groups' scales and
//! biases; bf16 on a device); a recurrent group's block is a state slot (each state layer's
//! convolution window, then its recurrent matrices, f32). Memory is taken in chunks as slots
//! are first written, so a large budget costs nothing until used.
//!
//! For a host pool a copy is a `memcpy`, done when the call returns. For a device pool the
//! memory is page-locked and a copy is queued on the cache's copy stream (`cuda::kv_copy`):
//! the call returns at once, `KvCache::fence` orders the next step after it, and this memory
//! is read or overwritten by the host only after the copies queued into or out of it finished
//! (`bytes` and `write` wait for them).

use crate::cuda::kv_copy::{CopyStream, HostBlock, PinnedChunk};
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

/// One block of a KV group and the `HostBlocks` slot its bytes move to or from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMove {
    pub group: usize,
    pub block: usize,
    pub slot: usize,
}

pub struct HostBlocks {
    /// Where each group of the cache starts in a slot; None for a group it does not hold.
    offsets: Vec<Option<usize>>,
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

    /// Where `group`'s bytes start in a slot; an error for a group this memory does not hold.
    fn offset(&self, group: usize) -> Result<usize> {
        self.offsets
            .get(group)
            .copied()
            .flatten()
            .ok_or_else(|| RuntimeError::Shape(format!("host KV blocks hold no block of group {group}")))
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

    /// The address of slot `slot`'s bytes in page-locked memory (a device cache's, whose
    /// chunks are all taken at creation), for copies the device makes.
    fn slot_ptr(&self, slot: usize) -> Result<*mut u8> {
        let (c, at) = self.locate(slot)?;
        match &self.chunks[c] {
            Some(Chunk::Pinned(p)) => Ok(p.as_ptr().wrapping_add(at)),
            _ => Err(RuntimeError::Shape(format!("host KV slot {slot} is not page-locked memory"))),
        }
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
        self.write_many(&[(slot, bytes)])
    }

    /// Overwrite the start of each `(slot, bytes)`'s slot (distinct slots), after queued
    /// copies out of them finished; the copies run in parallel on the worker pool (a restore
    /// writes gigabytes here).
    pub fn write_many(&mut self, items: &[(usize, &[u8])]) -> Result<()> {
        let mut slots: Vec<usize> = items.iter().map(|&(s, _)| s).collect();
        slots.sort_unstable();
        slots.dedup();
        if slots.len() != items.len() || items.iter().any(|(_, b)| b.len() > self.slot_bytes) {
            return Err(RuntimeError::Shape("host KV writes to one slot twice or past a slot".into()));
        }
        self.settle()?;
        // Each slot's address, its chunk taken first; the slots are distinct, so the copies
        // below write disjoint memory.
        let mut dsts = Vec::with_capacity(items.len());
        for &(slot, _) in items {
            dsts.push(self.slot_mut(slot)?.as_mut_ptr() as usize);
        }
        use rayon::prelude::*;
        items.par_iter().zip(dsts).for_each(|(&(_, bytes), dst)| {
            // SAFETY: `dst` addresses a slot of `slot_bytes` bytes owned by `self` (borrowed
            // mutably for this call), at least `bytes.len()` long, and no other item writes it.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst as *mut u8, bytes.len()) };
        });
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
        let all: Vec<usize> = (0..self.group_blocks().len()).collect();
        self.host_blocks_for(&all, slots)
    }

    /// Host memory for `slots` blocks of `groups` of this cache (ascending), each slot their
    /// bytes in group order (page-locked for a device cache). A tier keeps a recurrent group's
    /// state slots apart from the other groups' blocks: only some blocks carry one.
    pub fn host_blocks_for(&self, groups: &[usize], slots: usize) -> Result<HostBlocks> {
        let mut offsets = vec![None; self.group_blocks().len()];
        let mut slot_bytes = 0;
        for &g in groups {
            match offsets.get_mut(g) {
                Some(o @ None) if groups.windows(2).all(|w| w[0] < w[1]) => *o = Some(slot_bytes),
                _ => return Err(RuntimeError::Shape(format!("host KV blocks of groups {groups:?}"))),
            }
            slot_bytes += self.group_block_bytes(g);
        }
        let device = match &self.storage {
            Storage::Host(_) => None,
            Storage::Device(d) => Some(DeviceSide { done: d.copies.new_event()?, copies: d.copies.clone() }),
        };
        let per_chunk = (CHUNK_BYTES / slot_bytes.max(1)).max(1);
        let chunks = (0..slots.div_ceil(per_chunk)).map(|_| None).collect();
        let mut host = HostBlocks { offsets, slot_bytes, slots, per_chunk, chunks, device };
        if host.device.is_some() {
            // Page-locking memory is slow (a 256 MiB chunk takes tens of milliseconds): take it
            // all now rather than inside the step or the restore that first needs it.
            for c in 0..host.chunks.len() {
                host.slot_mut(c * per_chunk)?;
            }
        }
        Ok(host)
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
        let held =
            (host.offsets.iter().enumerate()).filter(|(_, o)| o.is_some()).map(|(g, _)| self.group_block_bytes(g));
        if host.offsets.len() != self.group_blocks().len()
            || held.sum::<usize>() != host.slot_bytes
            || host.device.is_some() != device
        {
            return Err(RuntimeError::Shape("host KV blocks made for another cache".into()));
        }
        Ok(())
    }

    /// Check `moves` against this cache and `host`: blocks that exist, slots in range.
    fn check_moves(&self, moves: &[BlockMove], host: &HostBlocks) -> Result<()> {
        self.check_host(host)?;
        for m in moves {
            self.check_block(m.group, m.block)?;
            host.offset(m.group)?;
            host.locate(m.slot)?;
        }
        Ok(())
    }

    /// Copy each move's pool block into its slot of `host` (at the group's offset). A device
    /// cache queues the copies (see the module docs). Nothing is copied if any move is invalid.
    pub fn save_blocks(&self, moves: &[BlockMove], host: &mut HostBlocks) -> Result<()> {
        self.check_moves(moves, host)?;
        match &self.storage {
            Storage::Host(layers) => {
                for m in moves {
                    let at = host.offset(m.group)?;
                    let dst = &mut host.slot_mut(m.slot)?[at..];
                    let mut off = 0;
                    for part in host_block_parts(layers, &self.states, m.group, m.block, self.block_size) {
                        dst[off..off + part.len()].copy_from_slice(part);
                        off += part.len();
                    }
                }
            }
            Storage::Device(d) => {
                for (group, blocks) in self.host_blocks_of(moves, host)? {
                    // SAFETY: each `host` address is the group's part of a slot of `host`
                    // (page-locked: `check_host` matched a device cache), which waits for the
                    // event recorded below before the host touches or frees it; the blocks
                    // exist (`check_moves`), and the cache and `host` share the copy stream,
                    // whose drop waits for its copies.
                    unsafe { d.copies.save_blocks(group, &blocks) }?;
                }
                host.record()?;
            }
        }
        Ok(())
    }

    /// Overwrite each move's pool block with its bytes in its slot of `host`. A device cache
    /// queues the copies; the next step waits for them (`fence`). Nothing is copied if any
    /// move is invalid.
    pub fn load_blocks(&mut self, moves: &[BlockMove], host: &HostBlocks) -> Result<()> {
        self.check_moves(moves, host)?;
        let bs = self.block_size;
        match &mut self.storage {
            Storage::Host(layers) => {
                for m in moves {
                    let src = &host.slot(m.slot)?[host.offset(m.group)?..];
                    let mut off = 0;
                    for dst in host_block_parts_mut(layers, &mut self.states, m.group, m.block, bs) {
                        let len = dst.len();
                        dst.copy_from_slice(&src[off..off + len]);
                        off += len;
                    }
                }
            }
            Storage::Device(_) => {
                let groups = self.host_blocks_of(moves, host)?;
                let Storage::Device(d) = &self.storage else { unreachable!("matched above") };
                for (group, blocks) in groups {
                    // SAFETY: as in `save_blocks`, the other way: `host` does not write or
                    // free these slots before the event recorded below has fired.
                    unsafe { d.copies.load_blocks(group, &blocks) }?;
                }
                host.record()?;
            }
        }
        Ok(())
    }

    /// `moves` by group, in order: the host address of each block's group part and its pool
    /// block (a device cache's page-locked `host`, every chunk taken at its creation).
    fn host_blocks_of(&self, moves: &[BlockMove], host: &HostBlocks) -> Result<Vec<(usize, Vec<HostBlock>)>> {
        let mut out: Vec<(usize, Vec<HostBlock>)> = Vec::new();
        for m in moves {
            let at = host.offset(m.group)?;
            let ptr = host.slot_ptr(m.slot)?.wrapping_add(at);
            let block = HostBlock { host: ptr, block: m.block as u32 };
            match out.iter_mut().find(|(g, _)| *g == m.group) {
                Some((_, blocks)) => blocks.push(block),
                None => out.push((m.group, vec![block])),
            }
        }
        Ok(out)
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
    use super::BlockMove;
    use crate::kv::{KvDtype, KvGroupKind, KvLayerSpec, KvLayout, KvScheme};
    use crate::kv_state::StateSpec;
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
            let mv = |group, block, slot| BlockMove { group, block, slot };
            kv.load_blocks(&[mv(0, 1, 2)], &host).unwrap();
            kv.save_blocks(&[mv(0, 1, 0)], &mut host).unwrap();
            assert_eq!(&host.bytes(0).unwrap()[..g0], &bytes[..g0]);
            // Its neighbours and the other group are untouched.
            for (g, b) in [(0, 0), (0, 2), (1, 1)] {
                kv.save_blocks(&[mv(g, b, 1)], &mut host).unwrap();
                let at = kv.group_offset(g);
                let part = &host.bytes(1).unwrap()[at..at + kv.group_block_bytes(g)];
                assert!(part.iter().all(|&x| x == 0), "block {b} of group {g}");
            }
            assert!(kv.save_blocks(&[mv(0, 3, 0)], &mut host).is_err());
            assert!(kv.save_blocks(&[mv(0, 0, 3)], &mut host).is_err());
            assert!(host.write(0, &vec![0; kv.block_bytes() + 1]).is_err());
            // Blocks of another cache's shape are refused.
            let other = cache(if dtype == KvDtype::F32 { KvDtype::F16 } else { KvDtype::F32 });
            assert!(other.save_blocks(&[mv(0, 0, 0)], &mut host).is_err());
        }
        let schemes: std::collections::HashSet<String> = dtypes.iter().map(|&d| cache(d).scheme()).collect();
        assert_eq!(schemes.len(), dtypes.len(), "{schemes:?}");
    }

    #[test]
    fn a_recurrent_groups_block_is_a_state_slot_and_memory_may_hold_some_groups_only() {
        let spec = |group| StateSpec { conv_channels: 3, conv_kernel: 3, heads: 2, k_dim: 2, v_dim: 4, group };
        let layout = KvLayout {
            groups: vec![KvGroupKind::Recurrent, KvGroupKind::Full],
            layers: vec![KvLayerSpec { n_kv_heads: 1, head_dim: 8, group: 1 }],
            states: vec![spec(0), spec(0)],
        };
        let mut kv = KvCache::new(&layout, &[3, 4], 2).unwrap();
        // Two state layers of 6 conv and 16 matrix values each.
        assert_eq!(kv.group_block_bytes(0), 2 * 4 * (6 + 16));
        assert_eq!(kv.block_bytes(), kv.group_block_bytes(0) + 2 * 2 * 8 * 2);
        kv.state_mut(1).unwrap().ssm_mut(2).unwrap().iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 + 0.5);
        kv.state_mut(0).unwrap().conv_mut(2).unwrap().fill(-1.0);
        let mut states = kv.host_blocks_for(&[0], 2).unwrap();
        let mut blocks = kv.host_blocks_for(&[1], 2).unwrap();
        assert_eq!(states.slot_bytes(), kv.group_block_bytes(0));
        assert_eq!(blocks.slot_bytes(), kv.group_block_bytes(1));
        let mv = |group, block, slot| BlockMove { group, block, slot };
        // Memory of one group takes no block of another.
        assert!(kv.save_blocks(&[mv(1, 0, 0)], &mut states).is_err());
        assert!(kv.save_blocks(&[mv(0, 0, 0)], &mut blocks).is_err());
        assert!(kv.host_blocks_for(&[1, 0], 1).is_err());
        kv.save_blocks(&[mv(0, 2, 1)], &mut states).unwrap();
        kv.load_blocks(&[mv(0, 0, 1)], &states).unwrap();
        for layer in 0..2 {
            let s = kv.state_mut(layer).unwrap();
            let (conv, ssm) = (s.conv(2).unwrap().to_vec(), s.ssm(2).unwrap().to_vec());
            assert_eq!((s.conv(0).unwrap(), s.ssm(0).unwrap()), (&conv[..], &ssm[..]), "state layer {layer}");
            assert!(s.ssm(1).unwrap().iter().all(|&x| x == 0.0), "a neighbour slot is untouched");
        }
        assert_eq!(kv.state_mut(1).unwrap().ssm(0).unwrap()[3], 3.5);
    }
}
