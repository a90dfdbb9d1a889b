//! CUDA sampling against the CPU sampler's rule, gated on `FERRITE_TEST_CUDA=1`.
//!
//! The reference is the engine's sampler (sort by logit, top-k, softmax at the temperature,
//! min-p against the top probability, top-p over the top-k mass, inverse CDF highest first)
//! evaluated in f64 with the row's uniform number. The GPU must pick the reference token,
//! except where the draw or a cut sits within 1e-5 of a boundary (then any token reachable by
//! nudging r, top_p or min_p by that much is accepted and counted). Equal logits are ordered by
//! id on both sides; one case rounds the logits to bf16, so ties are everywhere (top-k cuts
//! and draws inside runs of equal logits). Greedy rows must match `cpu::argmax`;
//! log-probabilities must match `cpu::log_softmax` to f32 accuracy; a second run must give
//! the same tokens.

mod cuda_common;

use cuda_common::{compare, fail, gpu, measure, poisoned_f32, rng};
use ferrite_runtime::cpu;
use ferrite_runtime::cuda::ops::{self, RowSampling, SamplingParamsDev};
use rand::Rng;

const NUDGE: f64 = 1e-5;

/// The CPU sampler's choice for `p` over `sorted` (finite (id, logit) pairs, highest first,
/// ties by id), with `r`, `top_p` and `min_p` given separately so they can be nudged.
fn reference(sorted: &[(u32, f32)], p: &RowSampling, r: f64, top_p: f64, min_p: f64) -> u32 {
    let mut cand = sorted;
    if p.top_k > 0 && (p.top_k as usize) < cand.len() {
        cand = &cand[..p.top_k as usize];
    }
    let t = f64::from(p.temperature);
    let max = f64::from(cand[0].1) / t;
    let mut probs: Vec<f64> = cand.iter().map(|&(_, v)| (f64::from(v) / t - max).exp()).collect();
    let sum: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= sum);
    if min_p > 0.0 {
        let floor = probs[0] * min_p;
        let keep = probs.iter().take_while(|&&x| x >= floor).count().max(1);
        probs.truncate(keep);
    }
    if top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, x) in probs.iter().enumerate() {
            acc += x;
            if acc >= top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
    }
    let total: f64 = probs.iter().sum();
    let mut left = r * total;
    for (i, x) in probs.iter().enumerate() {
        left -= x;
        if left <= 0.0 {
            return cand[i].0;
        }
    }
    cand[probs.len() - 1].0
}

#[test]
fn cuda_sampling_follows_the_cpu_rule() {
    let Some((gpu, _checks)) = gpu("cuda_sampling_follows_the_cpu_rule") else { return };
    let mut rng = rng("sampling");
    let temps = [0.0f32, 0.3, 0.7, 1.0, 1.5];
    let top_ks = [0u32, 1, 7, 50, 2000];
    let top_ps = [1.0f32, 0.95, 0.8, 0.3];
    let min_ps = [0.0f32, 0.01, 0.1];
    for (rows, vocab, ties) in [(64, 1000, false), (32, 32_001, false), (16, 151_936, false), (64, 50_000, true)] {
        let mut logits = Vec::with_capacity(rows * vocab);
        for _ in 0..rows {
            let spread = [1.0f32, 4.0, 12.0][rng.random_range(0..3)];
            let round = |v: f32| if ties { half::bf16::from_f32(v).to_f32() } else { v };
            logits.extend((0..vocab).map(|_| round(rng.random_range(-spread..spread))));
        }
        // A banned (-inf) token is never a candidate.
        logits[3] = f32::NEG_INFINITY;
        let params: Vec<RowSampling> = (0..rows)
            .map(|_| RowSampling {
                temperature: temps[rng.random_range(0..temps.len())],
                top_k: top_ks[rng.random_range(0..top_ks.len())],
                top_p: top_ps[rng.random_range(0..top_ps.len())],
                min_p: min_ps[rng.random_range(0..min_ps.len())],
                uniform: rng.random(),
            })
            .collect();
        let logits_d = gpu.upload(&logits).unwrap();
        let params_d = SamplingParamsDev::upload(gpu, &params).unwrap();
        let mut tokens = gpu.upload(&vec![u32::MAX; rows]).unwrap();
        let mut logprobs = poisoned_f32(gpu, rows);
        ops::sample(gpu, &logits_d, (vocab, vocab), &params_d, &mut tokens, &mut logprobs).unwrap();
        let got = gpu.download(&tokens).unwrap();
        let mut again = gpu.upload(&vec![u32::MAX; rows]).unwrap();
        ops::sample(gpu, &logits_d, (vocab, vocab), &params_d, &mut again, &mut logprobs).unwrap();
        if got != gpu.download(&again).unwrap() {
            fail(format!("sampling {rows}x{vocab}: a second run drew other tokens"));
        }

        let (mut exact, mut boundary) = (0, 0);
        let mut want_lp = Vec::with_capacity(rows);
        for (r, (row, p)) in logits.chunks(vocab).zip(&params).enumerate() {
            let tok = got[r];
            if tok as usize >= vocab {
                fail(format!("sampling row {r}: token {tok} outside the vocabulary"));
                continue;
            }
            want_lp.push(cpu::log_softmax(row)[tok as usize]);
            if p.temperature == 0.0 {
                if tok as usize == cpu::argmax(row) {
                    exact += 1;
                } else {
                    fail(format!("sampling row {r}: greedy drew {tok}, argmax is {}", cpu::argmax(row)));
                }
                continue;
            }
            let mut sorted: Vec<(u32, f32)> =
                row.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (i as u32, v)).collect();
            sorted.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let (u, tp, mp) = (f64::from(p.uniform), f64::from(p.top_p), f64::from(p.min_p));
            let want = reference(&sorted, p, u, tp, mp);
            if want == tok {
                exact += 1;
                continue;
            }
            let nudges = [-NUDGE, 0.0, NUDGE];
            let reachable = nudges.iter().any(|&dr| {
                nudges.iter().any(|&dp| {
                    nudges.iter().any(|&dm| {
                        let top_p = if tp < 1.0 { (tp + dp).min(1.0) } else { 1.0 };
                        reference(&sorted, p, (u + dr).clamp(0.0, 1.0), top_p, (mp * (1.0 + dm)).max(0.0)) == tok
                    })
                })
            });
            if reachable {
                boundary += 1;
            } else {
                fail(format!(
                    "sampling row {r} {p:?}: GPU drew {tok} (logit {}), CPU rule gives {want} (logit {})",
                    row[tok as usize], row[want as usize]
                ));
            }
        }
        let what = if ties { " bf16 logits (ties)" } else { "" };
        measure(
            "sampling",
            &format!("{rows}x{vocab}{what} tokens"),
            format!("exact={exact}|boundary={boundary}|of {rows}"),
        );
        // The log-probability under the raw logits: f32 log-sum-exp in two summation orders.
        compare(
            "sampling",
            &format!("{rows}x{vocab} logprob"),
            &gpu.download(&logprobs).unwrap(),
            &want_lp,
            1e-4,
            1e-5,
        );
    }
}
