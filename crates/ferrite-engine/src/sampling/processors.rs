//! Logit processors applied before sampling, in vLLM's order: logit bias, then repetition
//! (over prompt and output), presence and frequency (over the output) penalties, then the
//! `min_tokens` ban on end tokens.

use std::collections::HashMap;

use super::SamplingParams;

/// Occurrence counts of a sequence's generated tokens, kept up to date as it grows.
pub type TokenCounts = HashMap<u32, u32>;

pub fn apply(logits: &mut [f32], p: &SamplingParams, prompt: &[u32], counts: &TokenCounts, banned: &[u32]) {
    for &(t, bias) in &p.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += bias;
        }
    }
    if p.repetition_penalty != 1.0 {
        let mut penalize = |t: u32| {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
            }
        };
        let mut seen: Vec<u32> = prompt.iter().copied().chain(counts.keys().copied()).collect();
        seen.sort_unstable();
        seen.dedup();
        seen.into_iter().for_each(&mut penalize);
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        for (&t, &c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
    }
    for &t in banned {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = f32::NEG_INFINITY;
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
