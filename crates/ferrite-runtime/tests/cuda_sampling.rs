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
//!
//! `pick` (logit edits, then sampling, then the top alternatives): the edited logits must be
//! `LogitEdit::apply`'s bit for bit, the tokens follow the same rule over the edited logits,
//! the alternatives are the CPU's top log-probabilities (ids by rank where the values are
//! apart, values to f32 accuracy), and every row picks exactly what it picks alone (the
//! batch never changes a row's result: the engine's seeded-sampling contract).

mod cuda_common;

use cuda_common::{compare, fail, gpu, measure, poisoned_f32, rng};
use ferrite_runtime::cpu;
use ferrite_runtime::cuda::ops::{self, RowSampling, SampledDev, SamplingParamsDev};
use ferrite_runtime::sampling::{LogitEdit, SampledToken};
use rand::Rng;

const NUDGE: f64 = 1e-5;
/// Absolute bar of a log-probability: an f32 log-sum-exp over up to 152k terms in two summation
/// orders (the CPU's sequential sum drifts by up to ~sqrt(n) ulps of the total). A tighter
/// 1e-4 + 8 ulps of the largest logit failed on an H100 at 1.8e-4 (a 16 × 151,936 draw, rel L2
/// 1.4e-5).
const LOGPROB_ATOL: f32 = 5e-4;

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
            let start = logits.len();
            logits.extend((0..vocab).map(|_| round(rng.random_range(-spread..spread))));
            // Some rows peak as a language model's do: a few dozen tokens far above the rest,
            // so the sampler's gathered top set is small (flat rows run over the whole row).
            if rng.random_bool(0.5) {
                for _ in 0..40 {
                    let i = start + rng.random_range(0..vocab);
                    logits[i] = round(logits[i] + rng.random_range(8.0f32..20.0));
                }
            }
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
            match judge_draw(r, row, p, tok) {
                Some(true) => exact += 1,
                Some(false) => boundary += 1,
                None => {}
            }
        }
        let what = if ties { " bf16 logits (ties)" } else { "" };
        measure(
            "sampling",
            &format!("{rows}x{vocab}{what} tokens"),
            format!("exact={exact}|boundary={boundary}|of {rows}"),
        );
        // The log-probability under the raw logits: f32 log-sum-exp in two summation orders,
        // each off by a few ulps of the largest logit (the peaked rows' reach 30).
        compare(
            "sampling",
            &format!("{rows}x{vocab} logprob"),
            &gpu.download(&logprobs).unwrap(),
            &want_lp,
            LOGPROB_ATOL,
            1e-5,
        );
    }
}

/// The GPU's draw `tok` for row `r` against the CPU rule (exactly, or by a nudge at a
/// boundary): Some(true) exact, Some(false) boundary, None wrong (recorded as a failure).
fn judge_draw(r: usize, row: &[f32], p: &RowSampling, tok: u32) -> Option<bool> {
    if p.temperature == 0.0 {
        if tok as usize == cpu::argmax(row) {
            return Some(true);
        }
        fail(format!("row {r}: greedy drew {tok}, argmax is {}", cpu::argmax(row)));
        return None;
    }
    let mut sorted: Vec<(u32, f32)> =
        row.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (i as u32, v)).collect();
    sorted.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let (u, tp, mp) = (f64::from(p.uniform), f64::from(p.top_p), f64::from(p.min_p));
    let want = reference(&sorted, p, u, tp, mp);
    if want == tok {
        return Some(true);
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
        return Some(false);
    }
    fail(format!("row {r} {p:?}: GPU drew {tok}, CPU rule gives {want}"));
    None
}

/// Run `pick` over `logits` (rows of `vocab`); the edited logits and the picks.
fn run_pick(
    gpu: &ferrite_runtime::cuda::Gpu,
    logits: &[f32],
    vocab: usize,
    params: &[RowSampling],
    edits: &[(usize, LogitEdit)],
    top: &[usize],
) -> (Vec<f32>, Vec<SampledToken>) {
    let mut dev = gpu.upload(logits).unwrap();
    let most = top.iter().copied().max().unwrap_or(0);
    let mut p = SamplingParamsDev::with_capacity(gpu, params.len(), 0).unwrap();
    p.update(gpu, params, edits, most, vocab).unwrap();
    let mut out = SampledDev::new(gpu, 1).unwrap();
    ops::pick(gpu, &mut dev, (vocab, vocab), &p, &mut out).unwrap();
    (gpu.download(&dev).unwrap(), out.download(gpu, top).unwrap())
}

#[test]
fn cuda_pick_edits_samples_and_ranks_like_the_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_pick_edits_samples_and_ranks_like_the_cpu") else { return };
    let mut rng = rng("pick");
    for (rows, vocab, ties) in [(12, 32_001, false), (5, 151_936, false), (8, 5_000, true)] {
        let mut logits = Vec::with_capacity(rows * vocab);
        for _ in 0..rows {
            let spread = [2.0f32, 6.0, 12.0][rng.random_range(0..3)];
            let round = |v: f32| if ties { half::bf16::from_f32(v).to_f32() } else { v };
            logits.extend((0..vocab).map(|_| round(rng.random_range(-spread..spread))));
        }
        let params: Vec<RowSampling> = (0..rows)
            .map(|r| RowSampling {
                temperature: if r % 4 == 0 { 0.0 } else { [0.5f32, 0.8, 1.2][rng.random_range(0..3)] },
                top_k: [0u32, 20, 300][rng.random_range(0..3)],
                top_p: [1.0f32, 0.9, 0.6][rng.random_range(0..3)],
                min_p: [0.0f32, 0.02][rng.random_range(0..2)],
                uniform: rng.random(),
            })
            .collect();
        // Edits on the row's likeliest tokens (so they move the draw) and on random ones;
        // one per (row, token), as the engine makes them.
        let mut edits = Vec::new();
        for r in 0..rows {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let mut tokens: Vec<u32> = top_ids(row, 6);
            tokens.extend((0..40).map(|_| rng.random_range(0..vocab as u32)));
            tokens.sort_unstable();
            tokens.dedup();
            for token in tokens {
                let e = LogitEdit {
                    token,
                    bias: [0.0f32, 3.5, -2.25][rng.random_range(0..3)],
                    repetition: [1.0f32, 1.3, 0.7][rng.random_range(0..3)],
                    subtract: [0.0f32, 0.4, 1.7][rng.random_range(0..3)],
                    ban: rng.random_range(0..10) == 0,
                };
                edits.push((r, e));
            }
        }
        let top: Vec<usize> = (0..rows).map(|r| [0usize, 1, 5, 20][r % 4]).collect();
        let (edited, picks) = run_pick(gpu, &logits, vocab, &params, &edits, &top);

        let mut want = logits.clone();
        for (r, e) in &edits {
            let l = &mut want[r * vocab + e.token as usize];
            *l = e.apply(*l);
        }
        let same = edited.iter().zip(&want).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
        measure("sampling", &format!("pick {rows}x{vocab} edits"), format!("{same}/{} bit-equal", want.len()));
        if same != want.len() {
            fail(format!("pick {rows}x{vocab}: {} edited logits differ from LogitEdit::apply", want.len() - same));
        }

        let (mut exact, mut boundary) = (0, 0);
        let (mut got_lp, mut want_lp) = (Vec::new(), Vec::new());
        for (r, pick) in picks.iter().enumerate() {
            let row = &want[r * vocab..(r + 1) * vocab];
            if pick.token as usize >= vocab || pick.top.iter().any(|&(id, _)| id as usize >= vocab) {
                fail(format!("pick row {r}: {pick:?} outside the vocabulary"));
                continue;
            }
            match judge_draw(r, row, &params[r], pick.token) {
                Some(true) => exact += 1,
                Some(false) => boundary += 1,
                None => continue,
            }
            let lsm = cpu::log_softmax(row);
            got_lp.push(pick.logprob);
            want_lp.push(lsm[pick.token as usize]);
            let ranked = top_ids(&lsm, top[r]);
            if pick.top.len() != ranked.len() {
                fail(format!("row {r}: {} alternatives, want {}", pick.top.len(), ranked.len()));
                continue;
            }
            for (a, (&(id, lp), &want_id)) in pick.top.iter().zip(&ranked).enumerate() {
                got_lp.push(lp);
                want_lp.push(lsm[want_id as usize]);
                // Rank a may hold another id only where the two log-probabilities tie.
                if id != want_id && (lsm[id as usize] - lsm[want_id as usize]).abs() > 1e-6 {
                    fail(format!(
                        "row {r} rank {a}: id {id} ({lp}), the CPU ranks {want_id} ({})",
                        lsm[want_id as usize]
                    ));
                }
            }
        }
        measure(
            "sampling",
            &format!("pick {rows}x{vocab} tokens"),
            format!("exact={exact}|boundary={boundary}|of {rows}"),
        );
        compare("sampling", &format!("pick {rows}x{vocab} logprobs"), &got_lp, &want_lp, LOGPROB_ATOL, 1e-5);

        // Each row alone picks what it picked in the batch, bit for bit.
        let mut alone_equal = 0;
        for r in 0..rows {
            let row_edits: Vec<(usize, LogitEdit)> =
                edits.iter().filter(|(er, _)| *er == r).map(|&(_, e)| (0, e)).collect();
            let (_, one) =
                run_pick(gpu, &logits[r * vocab..(r + 1) * vocab], vocab, &params[r..=r], &row_edits, &top[r..=r]);
            let (a, b) = (&one[0], &picks[r]);
            let bits = |p: &SampledToken| {
                (p.token, p.logprob.to_bits(), p.top.iter().map(|&(i, l)| (i, l.to_bits())).collect::<Vec<_>>())
            };
            if bits(a) == bits(b) {
                alone_equal += 1;
            } else {
                fail(format!("row {r}: alone {a:?}, in the batch {b:?}"));
            }
        }
        measure("sampling", &format!("pick {rows}x{vocab} alone == batched"), format!("{alone_equal}/{rows}"));
    }
}

/// The `n` largest values' indices, largest first, ties by index.
fn top_ids(row: &[f32], n: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..row.len() as u32).filter(|&i| row[i as usize].is_finite()).collect();
    idx.sort_unstable_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    idx.truncate(n);
    idx
}

/// Issue 26 (7): temperatures below `MIN_TEMPERATURE` (1e-38 made `logit / T` overflow into
/// NaN, and the draw took the least likely token) are greedy; NaN logits are never picked,
/// a `+inf` one is certain, and a row with neither a finite logit nor `+inf` takes index 0.
#[test]
fn cuda_tiny_temperatures_and_non_finite_logits() {
    let Some((gpu, _checks)) = gpu("cuda_tiny_temperatures_and_non_finite_logits") else { return };
    let mut rng = rng("non-finite");
    let vocab = 32_001;
    let tiny = [1e-38f32, 1e-30, 1e-20, 9e-6, f32::MIN_POSITIVE, 1e-45];
    let temps = [0.7f32, 1.0, 1e-38, 0.0];
    let mut logits = Vec::new();
    let mut params = Vec::new();
    let row_params = |rng: &mut rand::rngs::StdRng, temperature: f32| RowSampling {
        temperature,
        top_k: [0u32, 40][rng.random_range(0..2)],
        top_p: [1.0f32, 0.9][rng.random_range(0..2)],
        min_p: [0.0f32, 0.05][rng.random_range(0..2)],
        uniform: rng.random(),
    };
    // Rows 0..6: tiny temperatures over logits as large as 1e4.
    for &t in &tiny {
        logits.extend((0..vocab).map(|_| rng.random_range(-1e4f32..1e4)));
        params.push(row_params(&mut rng, t));
    }
    // Rows 6..10: a tenth of the logits NaN, some -inf.
    for &t in &temps {
        logits.extend((0..vocab).map(|_| match rng.random_range(0..20) {
            0 | 1 => f32::NAN,
            2 => f32::NEG_INFINITY,
            _ => rng.random_range(-8.0f32..8.0),
        }));
        params.push(row_params(&mut rng, t));
    }
    // Rows 10..14: two +inf logits among finite ones and NaNs.
    for &t in &temps {
        logits.extend((0..vocab).map(|i| match i {
            777 | 901 => f32::INFINITY,
            _ if i % 7 == 0 => f32::NAN,
            _ => rng.random_range(-8.0f32..8.0),
        }));
        params.push(row_params(&mut rng, t));
    }
    // Row 14: every logit NaN.
    logits.extend(std::iter::repeat_n(f32::NAN, vocab));
    params.push(row_params(&mut rng, 1.0));
    let rows = params.len();
    let logits_d = gpu.upload(&logits).unwrap();
    let params_d = SamplingParamsDev::upload(gpu, &params).unwrap();
    let mut tokens = gpu.upload(&vec![u32::MAX; rows]).unwrap();
    let mut logprobs = poisoned_f32(gpu, rows);
    ops::sample(gpu, &logits_d, (vocab, vocab), &params_d, &mut tokens, &mut logprobs).unwrap();
    let (got, lps) = (gpu.download(&tokens).unwrap(), gpu.download(&logprobs).unwrap());
    let mut right = 0;
    for (r, (row, p)) in logits.chunks(vocab).zip(&params).enumerate() {
        let tok = got[r] as usize;
        let ok = match r {
            0..6 => tok == cpu::argmax(row) && lps[r].is_finite(),
            6..10 if p.temperature >= 1e-5 => {
                tok < vocab && row[tok].is_finite() && judge_draw(r, row, p, got[r]).is_some()
            }
            6..10 => tok == cpu::argmax(row) && !row[tok].is_nan(),
            10..14 => tok == 777,
            _ => tok == 0,
        };
        if ok {
            right += 1;
        } else {
            fail(format!("row {r} {p:?}: drew {tok} (logprob {})", lps[r]));
        }
    }
    measure("sampling", "tiny temperatures, NaN and inf logits", format!("{right}/{rows} as the rule says"));
}
