//! ferrite-engine: the engine core.
//!
//! One engine thread per model (`Engine`) owns the model, the paged KV cache and the
//! iteration-level scheduler (`EngineCore`). Every request — one prompt or a thousand
//! concurrent ones — runs through the same step loop: chunked prefill mixed with decode under
//! a token budget, prefix caching (with an SSD tier that survives restarts), resumable
//! generations, preemption by recomputation, per-request sampling, and
//! structured output (grammar-constrained rows sharing the batch with free ones).

pub mod config;
pub mod core;
pub mod engine;
pub mod error;
pub mod fill;
pub mod kv;
pub mod kv_precision;
pub mod metrics;
pub mod request;
pub mod sampling;
mod scheduler;
mod sequence;
pub mod spec;
pub mod stop;
mod stream;
pub mod structured;

pub use config::{EngineConfig, Limits, Speculation};
pub use core::EngineCore;
pub use engine::{Engine, RequestStream};
pub use error::EngineError;
pub use fill::FillMode;
pub use kv_precision::KvChoices;
pub use metrics::Metrics;
pub use request::{FinishReason, Finished, KvPrecision, Output, Request, RequestId, RequestParams, TierUsage, Usage};
pub use sampling::SamplingParams;
pub use spec::{FillUsage, SpecUsage};
pub use structured::{Constraint, GuideError, Piece};
