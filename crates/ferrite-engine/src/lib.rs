//! ferrite-engine: the engine core.
//!
//! Requests, the paged KV cache's block accounting, sampling, and the generation loop that
//! drives a model through `ForwardBatch`es.

pub mod error;
pub mod generator;
pub mod kv;
pub mod sampling;

pub use error::EngineError;
pub use generator::{FinishReason, GenerateRequest, GenerationStats, Generator};
pub use sampling::SamplingParams;
