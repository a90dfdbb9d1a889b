//! ferrite-runtime: tensors and devices.
//!
//! Holds the dtypes (float, GGUF block-quantized and MLX affine), the `Tensor` type that
//! carries weights (owned or memory-mapped), the quantized block formats, and the CPU op set a dense decoder
//! needs (embedding, matmul, RMSNorm, RoPE, gated activations, paged attention, softmax,
//! argmax). Each op is a plain function over slices and tensors.

pub mod batch;
pub mod cpu;
pub mod cuda;
pub mod dtype;
pub mod error;
pub mod hugemem;
pub mod kv;
pub mod kv_host;
pub mod kv_quant;
pub mod kv_state;
pub mod kv_twin;
pub mod quant;
pub mod sampling;
pub mod tensor;
pub mod threads;

pub use batch::{ForwardBatch, Padding, RowOptions, RowSpan};
pub use dtype::{DType, MlxFormat, MlxScale};
pub use error::{Result, RuntimeError};
pub use kv::{KvCache, KvDtype, KvGroupKind, KvLayout, KvScheme, KvSkip};
pub use kv_host::{BlockMove, HostBlocks};
pub use tensor::{Buffer, Tensor};
