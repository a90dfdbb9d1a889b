//! Structured output: a request's `Constraint` (JSON schema, JSON object, regex, Lark grammar,
//! choice list, sequences of text, special tokens and JSON values) compiled by llguidance into a per-row `Guide`.
//!
//! Each step, before the forward, every constrained row that will sample computes its mask of
//! allowed tokens (on a helper thread while the model runs); sampling sets every other logit to
//! −∞, after the logit processors, so the mask always wins. The sampled token advances the
//! guide; when the grammar is complete the row stops. Constrained and free rows share a batch.
//! `Grammars` holds what is built once per model: the token trie over the tokenizer's bytes
//! and llguidance's parser factory (built on first use).

mod constraint;
mod guide;
mod token_env;

pub use constraint::{Constraint, Piece};
pub use guide::{Grammars, Guide, GuideError};
