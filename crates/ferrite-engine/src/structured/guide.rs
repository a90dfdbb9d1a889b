//! `Grammars` (built once per model) compiles a `Constraint` into a `Guide`, one per row:
//! the allowed-token mask for the next token, advancing by the sampled token, and the tokens
//! the grammar forces next.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use ferrite_models::tokenizer::Tokenizer;
use llguidance::{Matcher, ParserFactory};
use toktrie::{SimpleVob, TokEnv};

use super::token_env::TokenEnv;
use super::Constraint;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GuideError {
    #[error("structured output needs a tokenizer, and this model has none")]
    NoTokenizer,
    #[error("structured output is unavailable for this model: {0}")]
    Unavailable(String),
    #[error("the output constraint does not compile: {0}")]
    Compile(String),
    #[error("structured output failed: {0}")]
    Matcher(String),
}

/// What constraints compile against: the model's tokenizer, vocabulary and end tokens. The
/// token trie and llguidance's parser factory are built on the first compile.
pub struct Grammars {
    tokenizer: Option<Arc<Tokenizer>>,
    vocab_size: usize,
    eos: Vec<u32>,
    factory: OnceLock<Result<ParserFactory, String>>,
}

impl Grammars {
    pub fn new(tokenizer: Option<Arc<Tokenizer>>, vocab_size: usize, eos: Vec<u32>) -> Grammars {
        Grammars { tokenizer, vocab_size, eos, factory: OnceLock::new() }
    }

    fn factory(&self) -> Result<&ParserFactory, GuideError> {
        let tokenizer = self.tokenizer.as_ref().ok_or(GuideError::NoTokenizer)?;
        let built = self.factory.get_or_init(|| {
            let env: TokEnv = Arc::new(TokenEnv::new(tokenizer.clone(), self.vocab_size, &self.eos));
            let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
            factory.quiet();
            factory.limits_mut().verbose_errors = false;
            Ok(factory)
        });
        built.as_ref().map_err(|e| GuideError::Unavailable(e.clone()))
    }

    /// A fresh guide for `constraint`, with the mask of its first token computed: a
    /// constraint too large, or one whose first step already exceeds llguidance's limits,
    /// fails here (a client error) rather than mid-generation. The error says why, briefly.
    pub fn compile(&self, constraint: &Constraint) -> Result<Guide, GuideError> {
        constraint.check_size().map_err(GuideError::Compile)?;
        let factory = self.factory()?;
        let grammar = constraint.grammar().map_err(GuideError::Compile)?;
        let compile_error = |e: String| GuideError::Compile(brief(&e));
        let parser = catch_unwind(AssertUnwindSafe(|| factory.create_parser(grammar)))
            .map_err(|_| compile_error("the grammar compiler failed".into()))?
            .map_err(|e| compile_error(e.to_string()))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(compile_error(e));
        }
        let mask = catch_unwind(AssertUnwindSafe(|| matcher.compute_mask()))
            .map_err(|_| compile_error("the grammar failed on its first token".into()))?
            .map_err(|e| compile_error(e.to_string()))?;
        Ok(Guide { matcher, mask: Some(mask) })
    }
}

/// One row's position in its grammar. Cloning it (for n > 1 forks) clones the position.
#[derive(Clone)]
pub struct Guide {
    matcher: Matcher,
    /// The mask for the next token, computed ahead of sampling.
    mask: Option<SimpleVob>,
}

/// The first line of an llguidance error, at most `BRIEF_CHARS` characters: its messages can
/// carry the parser state, the grammar or a panic's text and frames, none of which belongs in
/// a response body.
fn brief(message: &str) -> String {
    const BRIEF_CHARS: usize = 240;
    let line = message.lines().find(|l| !l.trim().is_empty()).unwrap_or("unknown error").trim();
    match line.char_indices().nth(BRIEF_CHARS) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line.to_string(),
    }
}

impl Guide {
    fn error(&self) -> GuideError {
        GuideError::Matcher(brief(&self.matcher.get_error().unwrap_or_else(|| "the grammar is complete".into())))
    }

    /// Compute the allowed-token mask for the next token now (say, while the model runs), so
    /// that sampling finds it ready. A failure is reported by `constrain`.
    pub fn prepare_mask(&mut self) {
        if self.mask.is_none() && !self.matcher.is_stopped() {
            self.mask = self.matcher.compute_mask().ok();
        }
    }

    /// Set every logit the grammar forbids to −∞. Should the processed `logits` leave no
    /// allowed token finite (a bias or ban hit them all), the allowed tokens get their `raw`
    /// logits back: the grammar wins over the processors.
    pub fn constrain(&mut self, logits: &mut [f32], raw: &[f32]) -> Result<(), GuideError> {
        self.prepare_mask();
        let mask = self.mask.as_ref().ok_or_else(|| self.error())?;
        let n = logits.len();
        let mut any = false;
        mask.iter_set_entries(|i| any |= i < n && logits[i].is_finite());
        if !any {
            mask.iter_set_entries(|i| {
                if i < n {
                    logits[i] = raw[i];
                }
            });
        }
        mask.iter_unset_entries(|i| {
            if i < n {
                logits[i] = f32::NEG_INFINITY;
            }
        });
        Ok(())
    }

    /// Advance by tokens that were sampled or appended.
    pub fn commit(&mut self, tokens: &[u32]) -> Result<(), GuideError> {
        self.mask = None;
        self.matcher.consume_tokens(tokens).map_err(|e| GuideError::Matcher(brief(&e.to_string())))
    }

    /// Undo the last `n` committed tokens (a rejected speculative tail).
    pub fn rollback(&mut self, n: usize) -> Result<(), GuideError> {
        self.mask = None;
        self.matcher.rollback(n).map_err(|e| GuideError::Matcher(brief(&e.to_string())))
    }

    /// The tokens the grammar determines next, whatever the model would pick (empty when
    /// there is a choice); they are not committed.
    pub fn forced_tokens(&mut self) -> Vec<u32> {
        self.matcher.compute_ff_tokens()
    }

    /// The grammar is complete: nothing may follow (or it ended with an end token).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::brief;

    #[test]
    fn brief_messages() {
        assert_eq!(brief("bad grammar\nstack backtrace:\n  0: frame"), "bad grammar");
        let long = brief(&"é".repeat(1000));
        assert_eq!(long.chars().count(), 241);
        assert_eq!(brief(""), "unknown error");
    }
}
