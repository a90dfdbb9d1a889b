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
    /// (The driver's and cuBLASLt's errors are in the message, not also the `source`, so a
    /// chain printed whole says them once.)
    #[error("CUDA driver: {0}")]
    Driver(DriverError),
    #[error("NVRTC could not compile {module} for {arch}:\n{log}")]
    Compile { module: String, arch: String, log: String },
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    #[error("cuBLASLt: {0}")]
    Blas(CublasError),
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("not supported on CUDA: {0}")]
    Unsupported(String),
}

impl From<DriverError> for CudaError {
    fn from(e: DriverError) -> CudaError {
        CudaError::Driver(e)
    }
}

impl From<CublasError> for CudaError {
    fn from(e: CublasError) -> CudaError {
        CudaError::Blas(e)
    }
}

pub type CudaResult<T> = std::result::Result<T, CudaError>;
