//! Typed errors of the runtime layer.

use crate::dtype::DType;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("dtype {dtype:?} is not supported by {op}")]
    UnsupportedDType { dtype: DType, op: &'static str },
    #[error("buffer of {got} bytes is too small: {what} needs {need} bytes")]
    ShortBuffer { what: String, need: usize, got: usize },
    #[error("row length {len} is not a multiple of the {dtype:?} block size {block}")]
    BlockAlignment { dtype: DType, len: usize, block: usize },
    #[error("{0}")]
    Unsupported(String),
    #[error("thread pool: {0}")]
    Threads(String),
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
}

pub type Result<T> = std::result::Result<T, RuntimeError>;
