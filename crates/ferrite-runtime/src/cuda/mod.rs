//! The CUDA backend: one binary for every machine, CUDA loaded at run time.
//!
//! cudarc loads the driver, NVRTC and cuBLASLt dynamically, so this module is always
//! compiled; on a machine without them `Gpu::new` and `resolve_device` return
//! `CudaError::Unavailable` instead of failing to start. `Gpu` owns a device's context, its one
//! stream, our kernels (`kernels/*.cu`, compiled by NVRTC for the device's architecture at
//! start-up and cached on disk) and a cuBLASLt handle. `ops` holds the op set — embedding,
//! RMSNorm with the fused residual add, RoPE, gated activations, the KV write, paged decode
//! and varlen prefill attention, linear layers, argmax and sampling — as plain functions over
//! device buffers, bf16 activations with f32 arithmetic, each tested against its CPU op.

mod blas;
mod compile;
mod context;
mod device;
mod error;
mod functions;
pub(crate) mod kv_copy;
pub mod ops;
mod pinned;

pub use blas::GemmOutput;
pub use compile::{default_kernel_cache_dir, CompileReport};
pub use context::{DeviceInfo, Gpu, Graph};
pub use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut};
pub use device::{cuda_device_count, device_memory, resolve_device, Device, DeviceChoice};
pub use error::{CudaError, CudaResult};
pub use pinned::HostBuf;
