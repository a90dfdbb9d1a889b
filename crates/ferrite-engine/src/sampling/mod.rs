//! Token sampling: per-request parameters, logit processors, log-probabilities, and the
//! sampler that turns a row of logits into a token.
//!
//! A request's randomness comes only from its own `(seed, step)`, so its tokens never depend
//! on what else ran in the same batch.

mod logprobs;
mod params;
mod processors;
mod sampler;

pub use logprobs::{token_logprobs, TokenLogprob, MAX_TOP_LOGPROBS};
pub use params::{SamplingError, SamplingParams};
pub use processors::{apply as apply_processors, edits as processor_edits, TokenCounts};
pub(crate) use sampler::rng_for;
pub use sampler::{distribution, draw, sample, uniform};
