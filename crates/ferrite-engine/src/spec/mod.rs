//! Speculative decoding and the proposal machinery fill shares with it: a row appends
//! `[pending, d1..dk]`, the target verifies the drafted tokens in one forward, keeps the
//! longest prefix its sampler agrees with plus one token of its own, and the KV cache is
//! rolled back past what stood. Drafts come from prompt lookup (`ngram`) or a draft model
//! (`draft`); `verify` holds the acceptance rule.

pub mod draft;
pub mod ngram;
pub mod proposal;
pub mod usage;
pub mod verify;

pub use draft::{DraftJob, DraftKv, Drafter};
pub use proposal::{Origin, Policy, Proposal};
pub use usage::{FillUsage, SpecUsage};

/// A row's speculative state: this step's proposal, the draft tokens it asks room for, its
/// KV in the draft model and its counters.
#[derive(Debug, Default)]
pub struct SpecState {
    pub proposal: Option<Proposal>,
    /// Tokens after the pending one this row asks the scheduler for this step.
    pub reserve: usize,
    pub draft: DraftKv,
    pub usage: SpecUsage,
}
