//! Models on a CUDA device: the llama family (`GpuLlama`) with its weights in device
//! memory (bf16, or a GGUF file's quantized blocks), the KV cache in device blocks and our CUDA op set for the step; synthetic models
//! of real shapes with random weights made on the device.

mod llama;
mod synthetic;
mod weights;

pub use llama::{unsupported, GpuLlama};
pub use synthetic::{synthetic_config, SYNTHETIC_MODELS};
pub use weights::{weight_bytes, LlamaWeights};
