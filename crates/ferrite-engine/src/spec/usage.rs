//! Per-request counters of fill and speculation, reported in `Usage` (and by the server as
//! `usage.fill` and `usage.speculation`), updated token by token as a proposal is judged.

use super::proposal::{Origin, Policy};

/// What fill did for one choice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FillUsage {
    /// Proposals made (asserted scaffolds and verified echo spans).
    pub events: usize,
    /// Tokens appended without sampling (asserted).
    pub injected_tokens: usize,
    /// Echo tokens the target agreed with.
    pub verify_accepted: usize,
    /// Echo proposals the target cut short (each ends at its first rejected token).
    pub verify_rejected: usize,
    /// Query positions computed for echo tokens that did not stand.
    pub wasted_samples: usize,
}

/// What speculative decoding did for one choice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SpecUsage {
    /// Verification rounds (steps in which the row carried drafted tokens).
    pub rounds: usize,
    pub drafted: usize,
    pub accepted: usize,
}

impl SpecUsage {
    /// Accepted drafted tokens over drafted ones (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// A proposal of `len` tokens from `origin` was made.
pub fn proposed(fill: &mut FillUsage, spec: &mut SpecUsage, origin: Origin, policy: Policy, len: usize) {
    if origin.is_fill() {
        fill.events += 1;
        match policy {
            Policy::Assert => fill.injected_tokens += len,
            Policy::Verify => fill.wasted_samples += len,
        }
    } else {
        spec.rounds += 1;
        spec.drafted += len;
    }
}

/// One proposed token stood.
pub fn accepted(fill: &mut FillUsage, spec: &mut SpecUsage, origin: Origin) {
    if origin.is_fill() {
        fill.verify_accepted += 1;
        fill.wasted_samples -= 1;
    } else {
        spec.accepted += 1;
    }
}

/// A proposed token was rejected (the rest of its proposal goes with it).
pub fn rejected(fill: &mut FillUsage, origin: Origin) {
    if origin.is_fill() {
        fill.verify_rejected += 1;
    }
}

impl std::ops::Add for FillUsage {
    type Output = FillUsage;
    fn add(self, o: FillUsage) -> FillUsage {
        FillUsage {
            events: self.events + o.events,
            injected_tokens: self.injected_tokens + o.injected_tokens,
            verify_accepted: self.verify_accepted + o.verify_accepted,
            verify_rejected: self.verify_rejected + o.verify_rejected,
            wasted_samples: self.wasted_samples + o.wasted_samples,
        }
    }
}

impl std::ops::Add for SpecUsage {
    type Output = SpecUsage;
    fn add(self, o: SpecUsage) -> SpecUsage {
        SpecUsage {
            rounds: self.rounds + o.rounds,
            drafted: self.drafted + o.drafted,
            accepted: self.accepted + o.accepted,
        }
    }
}
