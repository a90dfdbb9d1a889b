//! `Gpu`: one CUDA device ready for work — its context, one stream that orders everything,
//! our kernels compiled for its architecture, and a cuBLASLt handle with its workspace.
//!
//! All work goes to the one stream, so cudarc's per-buffer event tracking is switched off:
//! stream order is the only synchronization, which is also what CUDA-graph capture needs.
//! Buffers are plain device allocations freed in stream order when dropped. Uploads go
//! through page-locked staging (`pinned`), so queueing one never waits for the device.

use std::path::Path;
use std::sync::{Arc, Mutex};

use std::ffi::c_void;

use cudarc::driver::sys::{
    cuLaunchKernelEx, CUdevice_attribute, CUevent_flags, CUgraphInstantiate_flags, CUlaunchAttribute,
    CUlaunchAttributeID, CUlaunchConfig, CUstreamCaptureMode,
};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    ValidAsZeroBits,
};

use super::blas::Blas;
use super::compile::{build_all, default_kernel_cache_dir, target_for, CompileReport};
use super::device::{check_libraries, cuda_device_count};
use super::error::{CudaError, CudaResult};
use super::functions::Functions;
use super::pinned::{HostBuf, Staging};

/// What the device is.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub multiprocessors: usize,
    pub total_memory: usize,
    /// Largest dynamic shared memory a block may opt into, in bytes.
    pub max_shared_per_block: usize,
}

pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pub(crate) fns: Functions,
    pub(crate) blas: Blas,
    info: DeviceInfo,
    report: CompileReport,
    staging: Mutex<Staging>,
    /// Launch kernels allowing programmatic dependent launch (compute capability 9.0 and up,
    /// unless `FERRITE_PDL=0`): each may start while the one ahead finishes.
    pdl: bool,
}

impl Gpu {
    /// Open CUDA device `ordinal`, with kernels cached under `$FERRITE_HOME/kernels`.
    pub fn new(ordinal: usize) -> CudaResult<Gpu> {
        Gpu::with_kernel_cache(ordinal, Some(&default_kernel_cache_dir()))
    }

    /// Open CUDA device `ordinal`, caching compiled kernels in `cache_dir` (None: no cache).
    pub fn with_kernel_cache(ordinal: usize, cache_dir: Option<&Path>) -> CudaResult<Gpu> {
        check_libraries()?;
        let count = cuda_device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: every buffer of this context is used on `stream` alone (see the module doc).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let attr = |a| -> CudaResult<usize> { Ok(ctx.attribute(a)?.max(0) as usize) };
        let info = DeviceInfo {
            ordinal,
            name: ctx.name()?,
            compute_capability: ctx.compute_capability()?,
            multiprocessors: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            total_memory: ctx.total_mem()?,
            max_shared_per_block: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
        };
        let target = target_for(info.compute_capability)?;
        let (images, report) = build_all(&target, cache_dir)?;
        let fns = Functions::load(&ctx, images, info.max_shared_per_block)?;
        let blas = Blas::new(stream.clone())?;
        let pdl = info.compute_capability.0 >= 9 && std::env::var("FERRITE_PDL").map_or(true, |v| v != "0");
        Ok(Gpu { ctx, stream, fns, blas, info, report, staging: Mutex::default(), pdl })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// How the kernels were obtained at start-up (compiled or cached, and how long it took).
    pub fn compile_report(&self) -> &CompileReport {
        &self.report
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// (free, total) device memory in bytes.
    pub fn memory(&self) -> CudaResult<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// A zero-filled device buffer of `len` elements.
    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> CudaResult<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros(len)?)
    }

    /// A device copy of `host`.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> CudaResult<CudaSlice<T>> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// Queue a copy of `host` into the start of `dst`; it returns without waiting for the
    /// device (the values are staged in page-locked memory first).
    pub fn upload_into<T: DeviceRepr>(&self, host: &[T], dst: &mut impl DevicePtrMut<T>) -> CudaResult<()> {
        if host.len() > dst.len() {
            return Err(CudaError::Shape(format!("upload of {} values into {}", host.len(), dst.len())));
        }
        let dst = self.ptr_mut(dst);
        let mut staging = self.staging.lock().map_err(|_| CudaError::Shape("upload staging poisoned".into()))?;
        staging.upload(&self.ctx, &self.stream, host, dst)
    }

    /// A host copy of `dev` (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(&self, dev: &impl DevicePtr<T>) -> CudaResult<Vec<T>> {
        let host = self.stream.clone_dtoh(dev)?;
        self.stream.synchronize()?;
        Ok(host)
    }

    /// Page-locked host memory for `copy_to_host`, room for `len` values to start with.
    pub fn host_buf<T: DeviceRepr + Copy>(&self, len: usize) -> CudaResult<HostBuf<T>> {
        HostBuf::new(&self.ctx, len)
    }

    /// Queue a copy of `dev` into `dst` and return at once; `dst.wait()` gives the values.
    pub fn copy_to_host<T: DeviceRepr + Copy>(&self, dev: &impl DevicePtr<T>, dst: &mut HostBuf<T>) -> CudaResult<()> {
        dst.land(&self.ctx, &self.stream, self.ptr(dev), dev.len())
    }

    /// Wait until every queued operation has finished; reports errors of earlier launches.
    pub fn synchronize(&self) -> CudaResult<()> {
        self.stream.synchronize()?;
        Ok(self.ctx.check_err()?)
    }

    /// Milliseconds the device spends on the work `f` queues (events around it, then a wait).
    pub fn time_ms(&self, f: impl FnOnce() -> CudaResult<()>) -> CudaResult<f32> {
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let (start, end) = (self.ctx.new_event(flags)?, self.ctx.new_event(flags)?);
        start.record(&self.stream)?;
        f()?;
        end.record(&self.stream)?;
        end.synchronize()?;
        Ok(start.elapsed_ms(&end)?)
    }

    /// Record the work `f` queues into a CUDA graph instead of running it. `f` must queue
    /// only kernel launches and cuBLASLt calls on buffers that outlive the graph (no
    /// allocation, no host copy); the graph replays them on the same addresses.
    pub fn capture<E: From<CudaError>>(&self, f: impl FnOnce() -> Result<(), E>) -> Result<Graph, E> {
        self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(CudaError::from)?;
        let queued = f();
        // End the capture whatever happened, so the stream is usable again.
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0)).map_err(CudaError::from);
        queued?;
        let graph = graph?.ok_or_else(|| CudaError::Unsupported("stream capture produced no graph".into()))?;
        graph.upload().map_err(CudaError::from)?;
        Ok(Graph(graph))
    }

    /// The raw device address of a buffer, for a kernel argument.
    pub(crate) fn ptr<T>(&self, buf: &(impl DevicePtr<T> + ?Sized)) -> u64 {
        buf.device_ptr(&self.stream).0
    }

    pub(crate) fn ptr_mut<T>(&self, buf: &mut (impl DevicePtrMut<T> + ?Sized)) -> u64 {
        buf.device_ptr_mut(&self.stream).0
    }

    /// Grid size for a grid-stride loop over `n` items with `threads` per block.
    pub(crate) fn grid_for(&self, n: usize, threads: u32) -> u32 {
        let want = n.div_ceil(threads as usize).max(1);
        want.min(self.info.multiprocessors.max(1) * 32) as u32
    }

    /// Launch `f` with `cfg` and the argument list `args` (each a `DeviceRepr` value),
    /// allowing programmatic dependent launch where the device has it (see `pdl`).
    pub(crate) fn launch(&self, f: &CudaFunction, cfg: LaunchConfig, args: &[&dyn KernelArg]) -> CudaResult<()> {
        let mut params: Vec<*mut c_void> = args.iter().map(|a| a.param()).collect();
        // SAFETY: a plain-old-data union; the one field the attribute's id names is set.
        let mut attr: CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: if self.pdl { &mut attr } else { std::ptr::null_mut() },
            numAttrs: u32::from(self.pdl),
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: each op checks its buffers' lengths against the shapes it passes, and the
        // argument lists match the kernels' parameter lists (the ops and the .cu files are
        // kept together; the CUDA tests exercise every one); `params` points at `args`, which
        // outlive the call. Every kernel waits for the one ahead before touching memory
        // (`pdl_entry` in common.cuh), as programmatic dependent launch requires.
        unsafe { cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }.result()?;
        Ok(())
    }
}

/// A captured CUDA graph (see `Gpu::capture`).
pub struct Graph(CudaGraph);

// SAFETY: a graph is only launched by its owner, which keeps it behind a lock (cudarc leaves
// graphs !Send because the driver does not synchronize concurrent use of one graph).
unsafe impl Send for Graph {}

impl Graph {
    /// Queue one replay on the stream it was captured on.
    pub fn replay(&self) -> CudaResult<()> {
        Ok(self.0.launch()?)
    }
}

/// A kernel argument: a plain value the launch copies (ints, floats, device addresses).
pub(crate) trait KernelArg {
    /// The value's address, as the launch's parameter array holds it.
    fn param(&self) -> *mut c_void;
}

impl<T: DeviceRepr> KernelArg for T {
    fn param(&self) -> *mut c_void {
        self as *const T as *mut c_void
    }
}

/// A `LaunchConfig` for `grid` blocks of `threads` with `shared` bytes of dynamic shared memory.
pub(crate) fn cfg(grid: (u32, u32, u32), threads: u32, shared: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: shared as u32 }
}
