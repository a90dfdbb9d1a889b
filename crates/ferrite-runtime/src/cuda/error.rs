//! Typed errors of the CUDA backend.

use cudarc::cublaslt::result::CublasError;
use cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The driver or a CUDA library cannot be loaded (no NVIDIA driver on this machine).
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    #[error("unknown device {0:?}: expected auto, cpu, cuda or cuda:N")]
    BadDevice(String),
    #[error("CUDA device {ordinal} does not exist ({count} found)")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    #[error("NVRTC could not compile {module} for {arch}:\n{log}")]
    Compile { module: String, arch: String, log: String },
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    #[error("cuBLASLt: {0}")]
    Blas(#[from] CublasError),
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("not supported on CUDA: {0}")]
    Unsupported(String),
}

pub type CudaResult<T> = std::result::Result<T, CudaError>;
