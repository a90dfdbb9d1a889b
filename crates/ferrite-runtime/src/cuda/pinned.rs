//! Page-locked host memory for the small copies of every step, so that queueing them never
//! waits for the device. An upload from pageable memory may synchronize with the stream (the
//! driver stages it); `Staging` copies each upload into the next of a ring of page-locked
//! buffers instead, so the copy is queued behind the step in flight. A `HostBuf` is where a
//! step's results land: the copy is queued, and the host reads the values once its event has
//! fired — while the next step already runs.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream, DeviceRepr};

use super::error::CudaResult;

/// Upload buffers in the ring: more than the copies of two queued steps (inputs, attention
/// metadata per KV group, sampling parameters, carried picks).
const RING: usize = 16;

/// Page-locked host bytes and the event recorded after the last copy that used them.
struct Pinned {
    ptr: *mut u8,
    bytes: usize,
    done: CudaEvent,
}

// SAFETY: the memory is owned by this value alone; the event handle is usable from any thread.
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> CudaResult<Pinned> {
        let bytes = bytes.max(256).next_power_of_two();
        let done = ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        ctx.bind_to_thread()?;
        // SAFETY: a plain (cached, not write-combined) page-locked allocation of `bytes`; it
        // is freed once, in `drop`.
        let ptr = unsafe { result::malloc_host(bytes, 0) }? as *mut u8;
        Ok(Pinned { ptr, bytes, done })
    }

    /// Wait until the last copy that used this memory has finished.
    fn wait(&self) -> CudaResult<()> {
        Ok(self.done.synchronize()?)
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // A copy still queued may read or write this memory: let it finish first.
        let _ = self.done.synchronize();
        // SAFETY: `ptr` came from `malloc_host` and is freed only here.
        let _ = unsafe { result::free_host(self.ptr as _) };
    }
}

/// The ring of upload buffers of one stream.
#[derive(Default)]
pub(crate) struct Staging {
    ring: Vec<Pinned>,
    next: usize,
}

impl Staging {
    /// Queue a copy of `host` to the device address `dst` on `stream` through the next buffer
    /// of the ring (waiting only if that buffer's previous copy has not run yet).
    pub fn upload<T: DeviceRepr>(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        host: &[T],
        dst: u64,
    ) -> CudaResult<()> {
        let bytes = std::mem::size_of_val(host);
        if bytes == 0 {
            return Ok(());
        }
        let slot = self.next;
        self.next = (self.next + 1) % RING;
        if slot == self.ring.len() {
            self.ring.push(Pinned::new(ctx, bytes)?);
        } else if self.ring[slot].bytes < bytes {
            self.ring[slot] = Pinned::new(ctx, bytes)?;
        }
        let buf = &self.ring[slot];
        buf.wait()?;
        // SAFETY: `buf` holds at least `bytes` bytes, page-aligned (so aligned for `T`), and
        // no copy reads it any more (waited above); the copy below reads exactly `host.len()`
        // values of `T` from it, and the event recorded after it guards the next reuse.
        unsafe {
            std::ptr::copy_nonoverlapping(host.as_ptr() as *const u8, buf.ptr, bytes);
            let staged = std::slice::from_raw_parts(buf.ptr as *const T, host.len());
            result::memcpy_htod_async(dst, staged, stream.cu_stream())?;
        }
        Ok(buf.done.record(stream)?)
    }
}

/// Page-locked host memory a device buffer is copied into without waiting
/// (`Gpu::copy_to_host`); `wait` gives the values once the copy has run.
pub struct HostBuf<T> {
    mem: Pinned,
    len: usize,
    _values: PhantomData<T>,
}

impl<T: DeviceRepr + Copy> HostBuf<T> {
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize) -> CudaResult<HostBuf<T>> {
        Ok(HostBuf { mem: Pinned::new(ctx, len * std::mem::size_of::<T>())?, len: 0, _values: PhantomData })
    }

    /// Queue a copy of `len` values from the device address `src` into this buffer (grown
    /// when too small).
    pub(crate) fn land(&mut self, ctx: &Arc<CudaContext>, stream: &CudaStream, src: u64, len: usize) -> CudaResult<()> {
        let bytes = len * std::mem::size_of::<T>();
        if bytes > self.mem.bytes {
            self.mem = Pinned::new(ctx, bytes)?;
        }
        self.mem.wait()?;
        self.len = len;
        // SAFETY: the memory holds at least `len` values of `T`, page-aligned; no earlier copy
        // writes it any more (waited above) and the host reads it only after `wait`.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(self.mem.ptr as *mut T, len);
            result::memcpy_dtoh_async(dst, src, stream.cu_stream())?;
        }
        Ok(self.mem.done.record(stream)?)
    }

    /// The values of the last copy into this buffer, once it has run (waits for it).
    pub fn wait(&self) -> CudaResult<&[T]> {
        self.mem.wait()?;
        // SAFETY: the copy of `len` values has finished (its event fired) and nothing writes
        // the memory until the next `land`, which needs `&mut self`.
        Ok(unsafe { std::slice::from_raw_parts(self.mem.ptr as *const T, self.len) })
    }
}
