//! Token sampling: per-request parameters and the sampler that turns logits into a token.
//!
//! A request's randomness comes only from its own `(seed, step)`, so its tokens never depend
//! on what else ran in the same batch.

mod params;
mod sampler;

pub use params::{SamplingError, SamplingParams};
pub use sampler::sample;
