//! Models on a CUDA device: the llama family (`GpuLlama`) and the Gemma families
//! (`GpuGemma`) with their weights in device memory (bf16, or a GGUF file's quantized blocks
//! for the llama family), the KV cache in device blocks and our CUDA op set for the step, both
//! run by the shared step machinery (`runner`); synthetic models of real shapes with random
//! weights made on the device.

mod gemma;
mod gemma_weights;
mod llama;
mod runner;
mod synthetic;
mod weights;

pub use gemma::{gemma_unsupported, GpuGemma};
pub use gemma_weights::GemmaWeights;
pub use llama::{unsupported, GpuLlama};
pub use runner::GpuModel;
pub use synthetic::{synthetic_config, synthetic_gemma, SYNTHETIC_GEMMA, SYNTHETIC_MODELS};
pub use weights::{weight_bytes, LlamaWeights};
