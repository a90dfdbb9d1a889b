//! `Proposal`: tokens a row appends after its pending token in one step — asserted (known to
//! be right, appended without sampling) or to be verified against the target's own samples —
//! and where they came from. At most one per row per step, always clamped so that it never
//! runs past an end token, the request's `max_tokens` or the context.

/// How a proposal's tokens are accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Determined tokens: appended as query tokens without sampling; logits only after the last.
    Assert,
    /// Likely tokens: the row contributes `[pending, d1..dk]`, logits at every position, and
    /// the longest prefix the sampler agrees with is kept.
    Verify,
}

/// The source of a proposal (it decides which usage counters it feeds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// A tool-call scaffold of the chat template (`--fill strict`).
    Scaffold,
    /// Tokens the request's output grammar forces next (`--fill strict`, constrained rows).
    Grammar,
    /// An echo span found by n-gram lookup over the conversation (`--fill echo`).
    Echo,
    /// Prompt lookup as a speculative method (`--spec ngram`).
    Ngram,
    /// A draft model (`--draft-model`).
    Draft,
}

impl Origin {
    /// Fill proposals count in `usage.fill`, speculative ones in `usage.speculation`.
    pub fn is_fill(self) -> bool {
        matches!(self, Origin::Scaffold | Origin::Grammar | Origin::Echo)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Proposal {
    pub ids: Vec<u32>,
    pub policy: Policy,
    pub origin: Origin,
    /// For draft-model proposals sampled at temperature > 0: the draft's distribution at each
    /// proposed position (sparse, sums to 1). Empty: the proposal is deterministic (q = 1).
    pub draft_probs: Vec<Vec<(u32, f32)>>,
}

impl Proposal {
    pub fn new(ids: Vec<u32>, policy: Policy, origin: Origin) -> Proposal {
        Proposal { ids, policy, origin, draft_probs: Vec::new() }
    }

    /// Cut the proposal to at most `room` tokens, ending at the first of `ends` it holds.
    pub fn clamp(&mut self, room: usize, ends: &[u32]) {
        let end_at = self.ids.iter().position(|t| ends.contains(t)).map_or(self.ids.len(), |i| i + 1);
        let keep = end_at.min(room);
        self.ids.truncate(keep);
        self.draft_probs.truncate(keep);
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clamp_stops_at_room_and_end_tokens() {
        let mut p = Proposal::new(vec![5, 6, 2, 7, 8], Policy::Verify, Origin::Ngram);
        p.clamp(10, &[2]);
        assert_eq!(p.ids, [5, 6, 2]);
        p.clamp(2, &[2]);
        assert_eq!(p.ids, [5, 6]);
        p.clamp(0, &[]);
        assert!(p.is_empty());
    }
}
