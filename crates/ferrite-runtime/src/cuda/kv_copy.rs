//! The stream that moves KV blocks between a device pool and host memory, beside the stream
//! that runs the steps.
//!
//! Copies of blocks (saves: device to host; loads: host to device) are queued on their own
//! stream, so they run on the copy engines while the step in flight computes and the host
//! never waits for them. Ordering across the two streams is by events only:
//!
//! - A load writes device blocks that queued work on the compute stream may still use, so the
//!   first load after a fence makes the copy stream wait for what the compute stream has
//!   queued so far.
//! - A save reads full blocks registered in the prefix cache, which the host registers once
//!   the step that computed them landed — but a step with no logits rows (a prefill chunk
//!   before the last) lands as soon as it is queued, its KV writes still ahead on the compute
//!   stream. So every save makes the copy stream wait for what the compute stream has queued
//!   so far (an event; the host never waits). An SSD publish right after such a chunk copied
//!   blocks the chunk had not written yet before this (cuda_tiers).
//! - `fence` makes the compute stream wait for every copy queued so far (once, before the next
//!   step): a step never reads a block before its load finished, and never overwrites a block
//!   before its save finished.
//!
//! Host memory copies go to or come from is page-locked (`PinnedChunk`), so the copies are
//! truly asynchronous; whoever owns that memory waits on an event recorded after its last copy
//! before touching or freeing it.
//!
//! A block is many small pieces (each layer's K and V pool part: 64 pieces of 32 KiB for an
//! 8B model), and one bus copy per piece costs more in per-copy overhead than in bytes. So
//! whole blocks move in batches through a staging buffer in device memory: one bus copy per
//! run of host-contiguous blocks, and one `kv_blocks_move` launch that scatters the staged
//! blocks into their pool pieces (a load) or gathers them from there (a save), at device
//! memory speed.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    result, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::error::{CudaError, CudaResult};
use super::Gpu;

/// Bytes of device memory blocks are staged in at most (whole blocks; at least one).
const STAGE_BYTES: usize = 64 << 20;
/// Blocks one `kv_blocks_move` launch moves at most (`KV_MOVE_MAX_BLOCKS` in copy.cu).
const MAX_MOVE_BLOCKS: usize = 256;

/// One piece of a pool block: in pool block `b` it is `len` bytes at `base + b * stride`;
/// in a whole block's bytes it is at `offset` (the pieces in order, back to back).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KvRegion {
    pub base: u64,
    pub stride: u64,
    pub len: u64,
    pub offset: u64,
}

// SAFETY: four u64 fields, laid out as copy.cu's `KvRegion`.
unsafe impl DeviceRepr for KvRegion {}

/// The pool blocks one launch moves (copy.cu's `KvMoveBlocks`, passed by value).
#[repr(C)]
struct MoveBlocks {
    id: [u32; MAX_MOVE_BLOCKS],
}

// SAFETY: a plain array of u32, laid out as copy.cu's `KvMoveBlocks`.
unsafe impl DeviceRepr for MoveBlocks {}

/// The pieces of each KV group's blocks, on the device, and the staging buffer.
struct BlockMover {
    func: CudaFunction,
    /// Per group: its pieces and the bytes of one of its blocks.
    groups: Vec<(CudaSlice<KvRegion>, u32, usize)>,
    stage: CudaSlice<u8>,
}

pub(crate) struct CopyStream {
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    mover: BlockMover,
    /// Copies were queued since the last fence.
    queued: AtomicBool,
    /// The copy stream already waits for the compute stream's work up to the last fence.
    joined: AtomicBool,
}

/// A block's bytes in page-locked host memory, and the pool block they move to or from.
pub(crate) struct HostBlock {
    pub host: *mut u8,
    pub block: u32,
}

impl CopyStream {
    /// A copy stream beside `gpu`'s compute stream, for pools whose group `g` blocks are the
    /// pieces `groups[g]` (`KvRegion::offset` is filled in here).
    pub fn new(gpu: &Gpu, groups: Vec<Vec<KvRegion>>) -> CudaResult<CopyStream> {
        let compute = gpu.stream().clone();
        let mut tables = Vec::with_capacity(groups.len());
        for mut pieces in groups {
            let mut offset = 0;
            for p in &mut pieces {
                p.offset = offset;
                offset += p.len;
            }
            tables.push((gpu.upload(&pieces)?, pieces.len() as u32, offset as usize));
        }
        let largest = tables.iter().map(|t| t.2).max().unwrap_or(0).max(1);
        let stage = gpu.alloc(largest * (STAGE_BYTES / largest).clamp(1, MAX_MOVE_BLOCKS))?;
        let mover = BlockMover { func: gpu.fns.kv_blocks_move.clone(), groups: tables, stage };
        Ok(CopyStream {
            copy: compute.context().new_stream()?,
            compute,
            mover,
            queued: AtomicBool::new(false),
            joined: AtomicBool::new(false),
        })
    }

    /// An event for memory the copies of this stream use.
    pub fn new_event(&self) -> CudaResult<CudaEvent> {
        Ok(self.copy.context().new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?)
    }

    /// Record on `event` every copy queued so far.
    pub fn record(&self, event: &CudaEvent) -> CudaResult<()> {
        Ok(event.record(&self.copy)?)
    }

    /// Blocks of `group` the staging buffer holds at a time, and the bytes of one.
    fn batch(&self, group: usize) -> CudaResult<(usize, usize)> {
        let (_, _, bytes) =
            self.mover.groups.get(group).ok_or_else(|| CudaError::Unsupported(format!("KV group {group}")))?;
        Ok(((self.mover.stage.len() / bytes.max(&1)).clamp(1, MAX_MOVE_BLOCKS), *bytes))
    }

    /// Launch the move of `blocks` of `group` between the pools and the staging buffer.
    fn launch_move(&self, group: usize, blocks: &[HostBlock], to_pool: bool) -> CudaResult<()> {
        let (table, pieces, bytes) = &self.mover.groups[group];
        let mut ids = MoveBlocks { id: [0; MAX_MOVE_BLOCKS] };
        for (id, b) in ids.id.iter_mut().zip(blocks) {
            *id = b.block;
        }
        let (table, stage) = (table.device_ptr(&self.copy).0, self.mover.stage.device_ptr(&self.copy).0);
        let (bytes, to_pool) = (*bytes as u64, i32::from(to_pool));
        let mut launch = self.copy.launch_builder(&self.mover.func);
        launch.arg(&table).arg(&stage).arg(&bytes).arg(&ids).arg(&to_pool);
        let cfg =
            LaunchConfig { grid_dim: (*pieces, blocks.len() as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match `kv_blocks_move`'s parameters; the table's pieces lie in
        // this cache's pools for every block id below the pool's block count (the caller's
        // contract), and the staging buffer holds `blocks.len()` blocks (`batch`).
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// Runs of `blocks` (staged in order) whose host bytes are contiguous: (first index, count).
    fn host_runs(blocks: &[HostBlock], bytes: usize) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            match runs.last_mut() {
                Some((first, n)) if blocks[*first].host.wrapping_add(*n * bytes) == b.host => *n += 1,
                _ => runs.push((i, 1)),
            }
        }
        runs
    }

    /// Queue the copies of whole blocks of `group` from host memory into the pools: each
    /// `blocks[i]` copies the group's bytes of one block at `host` into pool block `block`,
    /// after the compute stream's queued work.
    ///
    /// # Safety
    /// Each `host` must address the group's bytes of one block in page-locked memory that
    /// nothing writes or frees until an event recorded after these copies has fired; each
    /// `block` must be a block of this cache's pools of that group.
    pub unsafe fn load_blocks(&self, group: usize, blocks: &[HostBlock]) -> CudaResult<()> {
        if !self.joined.swap(true, Relaxed) {
            self.copy.join(&self.compute)?;
        }
        self.copy.context().bind_to_thread()?;
        let (batch, bytes) = self.batch(group)?;
        let stage = self.mover.stage.device_ptr(&self.copy).0;
        for chunk in blocks.chunks(batch) {
            for (first, n) in Self::host_runs(chunk, bytes) {
                // SAFETY: per this function's contract, `n` blocks of `bytes` from `host`.
                let src = unsafe { std::slice::from_raw_parts(chunk[first].host.cast_const(), n * bytes) };
                // SAFETY: the staging buffer holds `batch` blocks; `src` is page-locked.
                unsafe { result::memcpy_htod_async(stage + (first * bytes) as u64, src, self.copy.cu_stream()) }?;
            }
            self.launch_move(group, chunk, true)?;
        }
        self.queued.store(true, Relaxed);
        Ok(())
    }

    /// Queue the copies of whole blocks of `group` from the pools into host memory: each
    /// `blocks[i]` copies pool block `block`'s bytes to `host`, after the compute stream's
    /// queued work (which may still be writing them, see the module docs).
    ///
    /// # Safety
    /// Each `host` must address room for the group's bytes of one block in page-locked memory
    /// that nothing reads, writes or frees until an event recorded after these copies has
    /// fired; each `block` must be a block of this cache's pools of that group.
    pub unsafe fn save_blocks(&self, group: usize, blocks: &[HostBlock]) -> CudaResult<()> {
        self.copy.join(&self.compute)?;
        self.copy.context().bind_to_thread()?;
        let (batch, bytes) = self.batch(group)?;
        let stage = self.mover.stage.device_ptr(&self.copy).0;
        for chunk in blocks.chunks(batch) {
            self.launch_move(group, chunk, false)?;
            for (first, n) in Self::host_runs(chunk, bytes) {
                // SAFETY: per this function's contract, room for `n` blocks at `host`.
                let dst = unsafe { std::slice::from_raw_parts_mut(chunk[first].host, n * bytes) };
                // SAFETY: the staging buffer holds `batch` blocks; `dst` is page-locked.
                unsafe { result::memcpy_dtoh_async(dst, stage + (first * bytes) as u64, self.copy.cu_stream()) }?;
            }
        }
        self.queued.store(true, Relaxed);
        Ok(())
    }

    /// Make the compute stream's next work wait for every copy queued so far (no host wait).
    pub fn fence(&self) -> CudaResult<()> {
        if self.queued.swap(false, Relaxed) {
            self.compute.join(&self.copy)?;
            self.joined.store(false, Relaxed);
        }
        Ok(())
    }
}

impl Drop for CopyStream {
    /// A copy still queued reads or writes pools and host memory about to be freed.
    fn drop(&mut self) {
        let _ = self.copy.synchronize();
    }
}

/// Page-locked host bytes for block copies (freed after the copies that use them finished:
/// their owner waits first).
pub(crate) struct PinnedChunk {
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: the memory is owned by this value alone.
unsafe impl Send for PinnedChunk {}
// SAFETY: shared access only reads (`as_slice`); writes need `&mut`.
unsafe impl Sync for PinnedChunk {}

impl PinnedChunk {
    pub fn new(copies: &CopyStream, bytes: usize) -> CudaResult<PinnedChunk> {
        let bytes = bytes.max(1);
        copies.copy.context().bind_to_thread()?;
        // SAFETY: a plain page-locked allocation of `bytes`, freed once, in `drop`.
        let ptr = unsafe { result::malloc_host(bytes, 0) }? as *mut u8;
        // SAFETY: `ptr` holds `bytes` writable bytes; zeroed once so every byte is initialised.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Ok(PinnedChunk { ptr, bytes })
    }

    /// The start of the memory, for copies the device makes into or out of it.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` holds `bytes` initialised bytes (zeroed in `new`) for the life of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, and `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl Drop for PinnedChunk {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_host` and is freed only here.
        let _ = unsafe { result::free_host(self.ptr as _) };
    }
}
