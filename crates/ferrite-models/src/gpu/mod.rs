//! Models on a CUDA device: the CUDA executor of a decoder plan (`GpuDecoder`) with its
//! weights in device memory (bf16, or a GGUF file's quantized blocks), the KV cache in device
//! blocks (and recurrent states in its slots: gated DeltaNet layers, `deltanet`) and our CUDA
//! op set for the step, run by the step machinery (`runner`); LoRA
//! adapters co-batched on the device (`lora`); synthetic models of real shapes with random
//! weights made on the device.

mod decoder;
mod decoder_weights;
mod deltanet;
mod lora;
mod moe;
mod rope;
mod runner;
mod synthetic;

pub use decoder::{unsupported, GpuDecoder};
pub use decoder_weights::{DecoderWeights, UploadQuantization};
pub use lora::MAX_GPU_LORAS;
pub use runner::GpuModel;
pub use synthetic::{synthetic_config, SYNTHETIC_MODELS};
