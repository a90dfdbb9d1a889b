//! Logit processors applied before sampling, in vLLM's order: logit bias, then repetition
//! (over prompt and output), presence and frequency (over the output) penalties, then the
//! `min_tokens` ban on end tokens.

use std::collections::{BTreeMap, HashMap};

use ferrite_runtime::sampling::LogitEdit;

use super::SamplingParams;

/// Occurrence counts of a sequence's generated tokens, kept up to date as it grows.
pub type TokenCounts = HashMap<u32, u32>;

/// The processors as one edit per touched token (ascending), for the host (`apply`) or a
/// device that samples. Repeated `logit_bias` entries of a token add up.
pub fn edits(p: &SamplingParams, prompt: &[u32], counts: &TokenCounts, banned: &[u32]) -> Vec<LogitEdit> {
    let mut by_token: BTreeMap<u32, LogitEdit> = BTreeMap::new();
    fn at(m: &mut BTreeMap<u32, LogitEdit>, t: u32) -> &mut LogitEdit {
        m.entry(t).or_insert_with(|| LogitEdit::none(t))
    }
    for &(t, bias) in &p.logit_bias {
        at(&mut by_token, t).bias += bias;
    }
    if p.repetition_penalty != 1.0 {
        for &t in prompt.iter().chain(counts.keys()) {
            at(&mut by_token, t).repetition = p.repetition_penalty;
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        for (&t, &c) in counts {
            at(&mut by_token, t).subtract = p.presence_penalty + p.frequency_penalty * c as f32;
        }
    }
    for &t in banned {
        at(&mut by_token, t).ban = true;
    }
    by_token.into_values().collect()
}

pub fn apply(logits: &mut [f32], p: &SamplingParams, prompt: &[u32], counts: &TokenCounts, banned: &[u32]) {
    for e in edits(p, prompt, counts, banned) {
        if let Some(l) = logits.get_mut(e.token as usize) {
            *l = e.apply(*l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn penalties_and_bans() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            logit_bias: vec![(3, 1.0)],
            ..Default::default()
        };
        let mut logits = vec![2.0, -2.0, 1.0, 0.0, 5.0];
        let counts: TokenCounts = [(2, 2)].into_iter().collect();
        apply(&mut logits, &p, &[0, 1], &counts, &[4]);
        assert_eq!(logits[0], 1.0); // repetition: positive halved
        assert_eq!(logits[1], -4.0); // repetition: negative doubled
        assert_eq!(logits[2], 1.0 / 2.0 - 0.5 - 0.5); // repetition, presence, 2 × frequency
        assert_eq!(logits[3], 1.0); // bias
        assert_eq!(logits[4], f32::NEG_INFINITY); // banned
    }
}
