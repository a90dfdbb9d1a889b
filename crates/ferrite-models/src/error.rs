//! Load errors: each names the file (and tensor) and says what was expected.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("{path}: tensor {tensor}: {message}")]
    Tensor { path: PathBuf, tensor: String, message: String },
    #[error("{0}")]
    Other(String),
}

impl LoadError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        LoadError::Io { path: path.to_path_buf(), source }
    }
    pub fn format(path: &Path, message: impl Into<String>) -> Self {
        LoadError::Format { path: path.to_path_buf(), message: message.into() }
    }
    pub fn tensor(path: &Path, tensor: &str, message: impl Into<String>) -> Self {
        LoadError::Tensor { path: path.to_path_buf(), tensor: tensor.to_string(), message: message.into() }
    }
}

impl From<ferrite_runtime::RuntimeError> for LoadError {
    fn from(e: ferrite_runtime::RuntimeError) -> Self {
        LoadError::Other(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, LoadError>;

impl From<ferrite_runtime::cuda::CudaError> for LoadError {
    fn from(e: ferrite_runtime::cuda::CudaError) -> Self {
        LoadError::Other(e.to_string())
    }
}
