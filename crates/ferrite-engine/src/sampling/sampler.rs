//! Sampling one token from a row of logits: greedy, or temperature with top-k, top-p and
//! min-p cuts, drawn from an RNG seeded by the request's `(seed, step)`.

use rand::{Rng, SeedableRng};

use super::SamplingParams;
use ferrite_runtime::cpu::argmax;

/// The RNG for a request's `step`: a pure function of `(seed, step)`.
pub(crate) fn rng_for(seed: u64, step: u64) -> rand::rngs::StdRng {
    // splitmix64 of the pair, so neighbouring steps get unrelated streams.
    let mut z = seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    rand::rngs::StdRng::seed_from_u64(z ^ (z >> 31))
}

/// The uniform number in [0, 1) a request draws its token with at `step`.
pub fn uniform(seed: u64, step: u64) -> f32 {
    rng_for(seed, step).random::<f32>()
}

/// The distribution `sample` draws from at temperature > 0: candidate tokens, most likely
/// first, with their probabilities after the temperature, top-k, min-p and top-p cuts
/// (normalized to sum to 1). Empty when no logit is finite.
pub fn distribution(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f32)> {
    let inv_t = 1.0 / p.temperature;
    let mut cand: Vec<(u32, f32)> =
        logits.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (i as u32, v * inv_t)).collect();
    if cand.is_empty() {
        return cand;
    }
    // Highest first; ties by id so the order is deterministic.
    cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 && p.top_k < cand.len() {
        cand.truncate(p.top_k);
    }
    let max = cand[0].1;
    cand.iter_mut().for_each(|c| c.1 = (c.1 - max).exp());
    let sum: f32 = cand.iter().map(|c| c.1).sum();
    cand.iter_mut().for_each(|c| c.1 /= sum);
    if p.min_p > 0.0 {
        let floor = cand[0].1 * p.min_p;
        let keep = cand.iter().take_while(|c| c.1 >= floor).count().max(1);
        cand.truncate(keep);
    }
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = cand.len();
        for (i, c) in cand.iter().enumerate() {
            acc += c.1;
            if acc >= p.top_p {
                keep = i + 1;
                break;
            }
        }
        cand.truncate(keep);
    }
    let total: f32 = cand.iter().map(|c| c.1).sum();
    cand.iter_mut().for_each(|c| c.1 /= total);
    cand
}

/// Draw a token from `dist` (probabilities summing to 1) with the uniform `u` in [0, 1).
pub fn draw(dist: &[(u32, f32)], u: f32) -> u32 {
    let mut r = u;
    for &(t, x) in dist {
        r -= x;
        if r <= 0.0 {
            return t;
        }
    }
    dist.last().map_or(0, |c| c.0)
}

/// Pick the next token for a request at `step` (its count of generated tokens so far).
pub fn sample(logits: &[f32], p: &SamplingParams, step: u64) -> u32 {
    if p.is_greedy() {
        return argmax(logits) as u32;
    }
    let dist = distribution(logits, p);
    if dist.is_empty() {
        return argmax(logits) as u32;
    }
    draw(&dist, uniform(p.seed, step))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_and_seeded_is_reproducible() {
        let logits = vec![0.1, 2.0, 1.9, -1.0];
        assert_eq!(sample(&logits, &SamplingParams::default(), 0), 1);
        let p = SamplingParams { temperature: 1.0, seed: 7, ..Default::default() };
        let a: Vec<u32> = (0..50).map(|s| sample(&logits, &p, s)).collect();
        let b: Vec<u32> = (0..50).map(|s| sample(&logits, &p, s)).collect();
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]), "temperature 1 never varied: {a:?}");
        let k1 = SamplingParams { temperature: 1.0, top_k: 1, seed: 3, ..Default::default() };
        assert!((0..20).all(|s| sample(&logits, &k1, s) == 1));
    }
}
