//! ferrite-models: what a model is made of.
//!
//! Model configs (HF `config.json` or GGUF metadata), weight loading (safetensors by mmap,
//! GGUF), tokenizers (HF `tokenizer.json` or a GGUF vocab), chat templates, and the
//! architectures, written once against the runtime's op set.

pub mod blocks;
pub mod chat_template;
pub mod config;
pub mod decoder;
pub mod deltanet;
pub mod embedding;
pub mod error;
pub mod families;
pub mod fit;
pub mod fp8;
pub mod gguf;
pub mod gpu;
pub mod hf_cache;
mod input;
pub mod inspect;
pub mod load;
pub mod lora;
pub mod mlx;
pub mod model;
pub mod moe;
pub mod paths;
pub mod plan;
pub mod random_weights;
pub mod registry;
pub mod rope_scaling;
pub mod safetensors;
pub mod tokenizer;
pub mod verify;
pub mod weights;

pub use error::{LoadError, Result};
pub use load::{load, load_on, load_text, load_with, synthetic, LoadOptions, LoadedModel, ModelText};
