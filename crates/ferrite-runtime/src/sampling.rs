//! What a model that samples on its device is asked for at each logits position, and what it
//! hands back: the row's sampling parameters and uniform draw, the logit edits that stand for
//! the request's processors (bias, penalties, bans), how many alternatives it wants with
//! log-probabilities; the chosen token with its log-probability and those alternatives.
//!
//! `LogitEdit::apply` is the one rule for the edits: the engine's CPU processors apply it, and
//! the device kernel (`cuda/kernels/sampling.cu`, `edit_logits`) does the same float
//! operations in the same order, so both give the same bits.

/// Temperatures below this (0 included) sample greedily: the argmax. Scaling by the inverse
/// of a smaller temperature, 1e-38 say, overflows f32 and leaves nothing to draw from, and
/// the distribution is all but a point mass on the argmax long before (vLLM's threshold).
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// Whether `temperature` samples greedily (below `MIN_TEMPERATURE`, or NaN).
pub fn is_greedy_temperature(temperature: f32) -> bool {
    temperature.is_nan() || temperature < MIN_TEMPERATURE
}

/// One row's sampling parameters. `uniform` in [0, 1) is the row's random draw: the caller
/// derives it from the request's (seed, step), so a row's token never depends on its batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    /// Below `MIN_TEMPERATURE` (0 included) means greedy (argmax).
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: u32,
    /// 1 means no nucleus cut.
    pub top_p: f32,
    /// 0 means no min-p cut.
    pub min_p: f32,
    pub uniform: f32,
}

/// A change to one token's logit before sampling: `l + bias`, then the repetition penalty
/// (divide a positive logit by it, multiply a negative one), then `- subtract` (presence and
/// frequency penalties); a banned token's logit becomes -inf.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogitEdit {
    pub token: u32,
    pub bias: f32,
    /// 1 means none.
    pub repetition: f32,
    pub subtract: f32,
    pub ban: bool,
}

impl LogitEdit {
    /// An edit of `token` that changes nothing (yet).
    pub fn none(token: u32) -> LogitEdit {
        LogitEdit { token, bias: 0.0, repetition: 1.0, subtract: 0.0, ban: false }
    }

    pub fn apply(&self, logit: f32) -> f32 {
        if self.ban {
            return f32::NEG_INFINITY;
        }
        let mut l = logit + self.bias;
        if self.repetition != 1.0 {
            l = if l > 0.0 { l / self.repetition } else { l * self.repetition };
        }
        l - self.subtract
    }
}

/// What to pick at one logits position.
#[derive(Debug, Clone, PartialEq)]
pub struct RowSampler {
    pub params: RowSampling,
    /// At most one edit per token.
    pub edits: Vec<LogitEdit>,
    /// The most likely alternatives wanted with their log-probabilities (0: none).
    pub top_logprobs: usize,
}

/// The token picked at one logits position, its log-probability under the edited logits
/// (before temperature), and the `top_logprobs` most likely tokens with theirs, most likely
/// first (equal logits by id).
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}
