//! `SamplingParams` and their validation.

use ferrite_runtime::sampling::is_greedy_temperature;

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 (or anything below `MIN_TEMPERATURE`) means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1 means no nucleus cut.
    pub top_p: f32,
    /// 0 means no min-p cut.
    pub min_p: f32,
    pub seed: u64,
    /// > 1 discourages tokens already in the prompt or output (1 = off).
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already in the output.
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of every token in the output.
    pub frequency_penalty: f32,
    /// Added to the logits of the given tokens.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("repetition_penalty must be > 0, got {0}")]
    RepetitionPenalty(f32),
    #[error("{name} must be in [-2, 2], got {value}")]
    Penalty { name: &'static str, value: f32 },
    #[error("logit_bias token {token} is outside the vocabulary of {vocab}")]
    BiasToken { token: u32, vocab: usize },
    #[error("logit_bias values must be finite numbers in [-100, 100]")]
    BiasValue,
}

impl SamplingParams {
    pub fn validate(&self, vocab: usize) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::MinP(self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(SamplingError::RepetitionPenalty(self.repetition_penalty));
        }
        for (name, value) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            if !(-2.0..=2.0).contains(&value) {
                return Err(SamplingError::Penalty { name, value });
            }
        }
        for &(token, bias) in &self.logit_bias {
            if token as usize >= vocab {
                return Err(SamplingError::BiasToken { token, vocab });
            }
            if !(-100.0..=100.0).contains(&bias) {
                return Err(SamplingError::BiasValue);
            }
        }
        Ok(())
    }

    /// Greedy (argmax): temperature 0, or any below `MIN_TEMPERATURE` (1e-5), where the
    /// distribution is all but a point mass on the argmax and `logit / temperature` overflows.
    pub fn is_greedy(&self) -> bool {
        is_greedy_temperature(self.temperature)
    }

    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}
