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
//! - A save reads a block whose contents are final: only full blocks registered in the prefix
//!   cache are saved, and they are registered after the step that computed them landed. It
//!   waits for nothing.
//! - `fence` makes the compute stream wait for every copy queued so far (once, before the next
//!   step): a step never reads a block before its load finished, and never overwrites a block
//!   before its save finished.
//!
//! Host memory copies go to or come from is page-locked (`PinnedChunk`), so the copies are
//! truly asynchronous; whoever owns that memory waits on an event recorded after its last copy
//! before touching or freeing it.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{result, CudaEvent, CudaStream};

use super::error::CudaResult;

pub(crate) struct CopyStream {
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    /// Copies were queued since the last fence.
    queued: AtomicBool,
    /// The copy stream already waits for the compute stream's work up to the last fence.
    joined: AtomicBool,
}

impl CopyStream {
    /// A copy stream beside `compute`, in its context.
    pub fn new(compute: &Arc<CudaStream>) -> CudaResult<CopyStream> {
        Ok(CopyStream {
            compute: compute.clone(),
            copy: compute.context().new_stream()?,
            queued: AtomicBool::new(false),
            joined: AtomicBool::new(false),
        })
    }

    /// The compute stream (device addresses of the pools are taken on it).
    pub fn compute(&self) -> &CudaStream {
        &self.compute
    }

    /// An event for memory the copies of this stream use.
    pub fn new_event(&self) -> CudaResult<CudaEvent> {
        Ok(self.copy.context().new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?)
    }

    /// Record on `event` every copy queued so far.
    pub fn record(&self, event: &CudaEvent) -> CudaResult<()> {
        Ok(event.record(&self.copy)?)
    }

    /// Queue a copy of `dst.len()` bytes from the device address `src` into `dst`.
    ///
    /// # Safety
    /// `src` must address that many bytes of a live device allocation of this context, and
    /// `dst` must be page-locked memory that nothing reads or frees until an event recorded
    /// after this copy has fired.
    pub unsafe fn save(&self, src: u64, dst: &mut [u8]) -> CudaResult<()> {
        self.copy.context().bind_to_thread()?;
        // SAFETY: per this function's contract.
        unsafe { result::memcpy_dtoh_async(dst, src, self.copy.cu_stream()) }?;
        self.queued.store(true, Relaxed);
        Ok(())
    }

    /// Queue a copy of `src` to the device address `dst`, after the compute stream's queued
    /// work.
    ///
    /// # Safety
    /// `dst` must address `src.len()` bytes of a live device allocation of this context, and
    /// `src` page-locked memory that nothing writes or frees until an event recorded after this
    /// copy has fired.
    pub unsafe fn load(&self, src: &[u8], dst: u64) -> CudaResult<()> {
        if !self.joined.swap(true, Relaxed) {
            self.copy.join(&self.compute)?;
        }
        self.copy.context().bind_to_thread()?;
        // SAFETY: per this function's contract.
        unsafe { result::memcpy_htod_async(dst, src, self.copy.cu_stream()) }?;
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
