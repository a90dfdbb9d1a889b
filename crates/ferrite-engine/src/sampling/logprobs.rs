//! Log-probabilities of the chosen token and the top alternatives at one position.

use ferrite_runtime::cpu::log_softmax;

/// The most alternatives a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Serialized with each log-probability as its IEEE bits, so `-inf` (a masked token) survives
/// formats such as JSON that have no infinities.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(into = "LogprobBits", from = "LogprobBits")]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The `top` most likely tokens with their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct LogprobBits(u32, u32, Vec<(u32, u32)>);

impl From<TokenLogprob> for LogprobBits {
    fn from(t: TokenLogprob) -> LogprobBits {
        LogprobBits(t.token, t.logprob.to_bits(), t.top.into_iter().map(|(id, lp)| (id, lp.to_bits())).collect())
    }
}

impl From<LogprobBits> for TokenLogprob {
    fn from(LogprobBits(token, logprob, top): LogprobBits) -> TokenLogprob {
        TokenLogprob {
            token,
            logprob: f32::from_bits(logprob),
            top: top.into_iter().map(|(id, lp)| (id, f32::from_bits(lp))).collect(),
        }
    }
}

/// Log-probabilities of `token` and the `top` best tokens under `logits`.
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let lp = log_softmax(logits);
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &v) in lp.iter().enumerate() {
            if best.len() < top || v > best[best.len() - 1].1 {
                let at = best.partition_point(|&(_, b)| b >= v);
                best.insert(at, (i as u32, v));
                best.truncate(top);
            }
        }
    }
    TokenLogprob { token, logprob: lp.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY), top: best }
}
