//! Sampling one token from a row of logits: greedy, or temperature with top-k, top-p and
//! min-p cuts, drawn from an RNG seeded by the request's `(seed, step)`.
//!
//! Temperatures below `MIN_TEMPERATURE` (1e-5) are greedy. Above it, logits are scaled
//! relative to the row's max, so no temperature overflows into inf or NaN. Non-finite
//! logits, the same on every path (greedy, sampled, speculative verify, the CUDA kernels): a
//! NaN is never picked and a `-inf` has probability 0; a `+inf` is a certainty, so the row
//! takes the first `+inf` (the argmax); a row without any logit above `-inf` has nothing to
//! draw from and takes index 0 (the argmax's rule). A draw only ever sees finite
//! probabilities.

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

/// The distribution `sample` draws from: candidate tokens, most likely first (equal logits
/// by id), with their probabilities after the temperature, top-k, min-p and top-p cuts
/// (normalized to sum to 1). Non-finite logits are handled as the module says: a `+inf` is
/// certain, NaN and `-inf` never candidates; empty when no logit is finite. Below
/// `MIN_TEMPERATURE` it is the argmax alone.
pub fn distribution(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f32)> {
    if let Some(i) = logits.iter().position(|&v| v == f32::INFINITY) {
        return vec![(i as u32, 1.0)];
    }
    if p.is_greedy() {
        let i = argmax(logits);
        return logits.get(i).filter(|v| v.is_finite()).map(|_| (i as u32, 1.0)).into_iter().collect();
    }
    let mut cand: Vec<(u32, f32)> =
        logits.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (i as u32, v)).collect();
    if cand.is_empty() {
        return cand;
    }
    cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 && p.top_k < cand.len() {
        cand.truncate(p.top_k);
    }
    // Relative to the max before scaling: (l - max) <= 0 (or -inf where the difference
    // overflows) times 1 / temperature <= 1e5 is never NaN, and the max gets e = 1.
    let (max, inv_t) = (cand[0].1, 1.0 / p.temperature);
    cand.iter_mut().for_each(|c| c.1 = ((c.1 - max) * inv_t).exp());
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

    /// Rows of `n` logits in [-amp, amp], from a fixed seed.
    fn rows(n: usize, amp: f32) -> Vec<Vec<f32>> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(26);
        (0..20).map(|_| (0..n).map(|_| rng.random_range(-amp..amp)).collect()).collect()
    }

    #[test]
    fn tiny_temperatures_are_greedy() {
        // 1e-38: 1 / T is finite but logit / T overflows (issue 26, defect 7); 1e-45 and
        // MIN_POSITIVE: 1 / T is inf itself.
        for t in [1e-38f32, 1e-45, f32::MIN_POSITIVE, 1e-30, 1e-10, 9.99e-6] {
            for (i, row) in rows(500, 1e4).into_iter().chain(rows(500, 3.0)).enumerate() {
                let p =
                    SamplingParams { temperature: t, top_k: [0, 40][i % 2], top_p: 0.9, seed: 9, ..Default::default() };
                let best = argmax(&row) as u32;
                assert!(p.is_greedy(), "{t}");
                assert_eq!(distribution(&row, &p), vec![(best, 1.0)], "T={t}");
                assert!((0..10).all(|s| sample(&row, &p, s) == best), "T={t}");
            }
        }
        // From MIN_TEMPERATURE on it samples, without overflow even for logits near f32::MAX.
        let p = SamplingParams { temperature: 1e-5, ..Default::default() };
        assert!(!p.is_greedy());
        let row = [3e38f32, -3e38, 1.0, 3e38 - 1e32, f32::MIN];
        let dist = distribution(&row, &p);
        assert!(dist.iter().all(|c| c.1.is_finite()) && dist[0] == (0, 1.0), "{dist:?}");
        for row in rows(500, 1e4) {
            let dist = distribution(&row, &p);
            assert!(dist.iter().all(|c| c.1.is_finite()));
            assert!((dist.iter().map(|c| c.1).sum::<f32>() - 1.0).abs() < 1e-5);
            assert_eq!(sample(&row, &p, 0), argmax(&row) as u32);
        }
    }

    #[test]
    fn non_finite_logits_never_reach_a_draw() {
        let nan = f32::NAN;
        let params = |temperature: f32| SamplingParams { temperature, seed: 5, ..Default::default() };
        // NaN is never picked, -inf has probability 0: only ids 1 and 3 can come out.
        let row = [nan, 1.0, nan, 0.5, f32::NEG_INFINITY, nan];
        for t in [0.0, 1e-38, 0.5, 1.0, 4.0] {
            let p = params(t);
            let dist = distribution(&row, &p);
            assert!(dist.iter().all(|&(id, x)| (id == 1 || id == 3) && x.is_finite()), "T={t}: {dist:?}");
            let drawn: Vec<u32> = (0..200).map(|s| sample(&row, &p, s)).collect();
            assert!(drawn.iter().all(|&id| id == 1 || id == 3), "T={t}: {drawn:?}");
            if t >= 1.0 {
                assert!(drawn.contains(&3), "T={t}: the second candidate is drawn sometimes");
            }
        }
        // +inf is a certainty: the first +inf, greedy or sampled.
        let row = [0.0, nan, f32::INFINITY, 3.0, f32::INFINITY];
        for t in [0.0, 1e-38, 0.7, 2.0] {
            assert_eq!(distribution(&row, &params(t)), vec![(2, 1.0)], "T={t}");
            assert!((0..50).all(|s| sample(&row, &params(t), s) == 2), "T={t}");
        }
        // Nothing to draw from: index 0, as argmax.
        for row in [[nan; 4], [f32::NEG_INFINITY; 4]] {
            for t in [0.0, 1.0] {
                assert!(distribution(&row, &params(t)).is_empty());
                assert_eq!(sample(&row, &params(t), 0), 0);
            }
        }
    }
}
