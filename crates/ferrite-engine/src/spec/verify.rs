//! The acceptance rule for one verified position: does the target keep the proposed token,
//! and if not, which token does it emit instead.
//!
//! At temperature 0 the proposed token is kept when it is the target's argmax (so the output
//! is exactly plain decoding's). At temperature > 0 this is speculative rejection sampling:
//! keep `d` with probability `min(1, p(d) / q(d))`, else draw from the residual
//! `max(0, p − q)` renormalized — which leaves the emitted tokens distributed exactly as the
//! target's `p`. A proposal without draft probabilities (prompt lookup, echo) is a
//! deterministic draft: `q` is 1 on `d`, so `d` is kept with probability `p(d)` and the
//! residual is `p` without `d`. The randomness of output position `step` comes from the
//! request's `(seed, step)` alone, so results are reproducible whatever else is batched.

use rand::Rng;

use crate::sampling::{distribution, draw, rng_for, sample, SamplingParams};

/// What the target does at one verified position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The proposed token stands.
    Accept,
    /// The proposed token is rejected; this token is emitted in its place.
    Reject(u32),
}

/// Judge proposed token `d` under the target's (processed) `logits` at output position
/// `step`; `q` is the draft's distribution at this position (empty: deterministic draft).
pub fn judge(logits: &[f32], p: &SamplingParams, step: u64, d: u32, q: &[(u32, f32)]) -> Verdict {
    if p.is_greedy() {
        let t = sample(logits, p, step);
        return if t == d { Verdict::Accept } else { Verdict::Reject(t) };
    }
    let target = distribution(logits, p);
    if target.is_empty() {
        let t = sample(logits, p, step);
        return if t == d { Verdict::Accept } else { Verdict::Reject(t) };
    }
    let prob = |dist: &[(u32, f32)], t: u32| dist.iter().find(|c| c.0 == t).map_or(0.0, |c| c.1);
    let q_of = |t: u32| if q.is_empty() { f32::from(t == d) } else { prob(q, t) };
    let (pd, qd) = (prob(&target, d), q_of(d));
    let mut rng = rng_for(p.seed, step);
    let u: f32 = rng.random();
    if qd > 0.0 && u < (pd / qd).min(1.0) {
        return Verdict::Accept;
    }
    let mut residual: Vec<(u32, f32)> =
        target.iter().map(|&(t, pt)| (t, (pt - q_of(t)).max(0.0))).filter(|c| c.1 > 0.0).collect();
    let total: f32 = residual.iter().map(|c| c.1).sum();
    if total <= 0.0 {
        // p ≤ q everywhere means p = q: a rejection cannot happen except through rounding.
        return Verdict::Reject(draw(&target, rng.random()));
    }
    residual.iter_mut().for_each(|c| c.1 /= total);
    Verdict::Reject(draw(&residual, rng.random()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_accepts_only_the_argmax() {
        let logits = [0.0, 3.0, 1.0];
        let p = SamplingParams::default();
        assert_eq!(judge(&logits, &p, 0, 1, &[]), Verdict::Accept);
        assert_eq!(judge(&logits, &p, 0, 2, &[]), Verdict::Reject(1));
    }

    #[test]
    fn deterministic_draft_keeps_the_target_distribution() {
        // Emitted-token frequencies over many seeds must match p, whatever d is.
        let logits = [1.0f32, 0.0, 2.0, -1.0];
        let z: f32 = logits.iter().map(|x| x.exp()).sum();
        let n = 40_000;
        let mut counts = [0usize; 4];
        for seed in 0..n {
            let p = SamplingParams { temperature: 1.0, seed, ..Default::default() };
            let t = match judge(&logits, &p, 3, 0, &[]) {
                Verdict::Accept => 0,
                Verdict::Reject(t) => t,
            };
            counts[t as usize] += 1;
        }
        for (i, &c) in counts.iter().enumerate() {
            let want = logits[i].exp() / z;
            let got = c as f32 / n as f32;
            assert!((got - want).abs() < 0.01, "token {i}: {got} vs {want}");
        }
    }
}
