//! Helpers of the tests that run a `CausalLm` directly (the CUDA model tests): the gate on
//! `FERRITE_TEST_CUDA`, a KV cache for one sequence, teacher-forced logits, log-softmax /
//! top-k over a logits row, the comparison of two models' logits, and the checks that two
//! runs part only at a near tie (greedy) or a draw near a boundary (sampled).

use ferrite_engine::sampling::{apply_processors, distribution, uniform, TokenCounts};
use ferrite_engine::RequestParams;
use ferrite_models::model::{CausalLm, Pending, StepLimits, Want};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::{ForwardBatch, KvCache};

/// Positions per KV block.
pub const BLOCK: usize = 16;

/// Whether the CUDA tests run (`FERRITE_TEST_CUDA=1`); says why `test` is skipped when not.
pub fn cuda_enabled(test: &str) -> bool {
    let on = std::env::var("FERRITE_TEST_CUDA").as_deref() == Ok("1");
    if !on {
        eprintln!("SKIP {test}: set FERRITE_TEST_CUDA=1 on a machine with an NVIDIA GPU to run it");
    }
    on
}

/// SmolLM2-135M-Instruct Q4_1, real weights for the CUDA tests: `FERRITE_SMOLLM2_GGUF`, by
/// default the models cache under `$HOME`; `None` (saying why `test` is skipped) when absent.
pub fn smollm2_gguf(test: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("FERRITE_SMOLLM2_GGUF").map(std::path::PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(std::path::PathBuf::from).unwrap_or_default();
        home.join(".cache/ferrite/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    if !path.is_file() {
        eprintln!("SKIP {test}: no {} (set FERRITE_SMOLLM2_GGUF)", path.display());
        return None;
    }
    Some(path)
}

/// The KV cache a model wants, with `blocks` blocks in every group, and the identity block
/// tables.
pub fn cache(model: &dyn CausalLm, blocks: usize) -> (KvCache, Vec<Vec<u32>>) {
    let limits = StepLimits { max_tokens: 1024, max_rows: 8, max_model_len: 1024, block_size: BLOCK };
    model.prepare(&limits).expect("prepare");
    let groups = model.kv_layout().groups.len();
    let kv = model.new_kv_cache(&vec![blocks; groups], BLOCK, &Default::default()).expect("kv cache");
    (kv, vec![(0..blocks as u32).collect(); groups])
}

/// Logits at every position of `prompt`, in one forward.
pub fn prefill_logits(model: &dyn CausalLm, prompt: &[u32]) -> Vec<f32> {
    let (mut kv, tables) = cache(model, prompt.len().div_ceil(BLOCK));
    let mut batch = ForwardBatch::default();
    batch.push_row(prompt, prompt.len(), tables, RowLogits::All);
    model.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("forward")
}

pub fn log_softmax(row: &[f32]) -> Vec<f32> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f32>().ln();
    row.iter().map(|x| x - lse).collect()
}

/// The `k` largest entries' indices, best first (equal values by index).
pub fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// The reference's top-2 log-probability margin under which a differing argmax is a bf16 near
/// tie rather than an error (the fixtures' sharp attention amplifies the bf16 rounding of q
/// and k: top-5 log-probabilities differ by up to ~0.4 at 150 tokens).
pub const TIE_MARGIN: f32 = 0.25;

/// The first index where `a` and `b` differ (a length difference counts).
pub fn divergence(a: &[u32], b: &[u32]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y).or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

/// Where greedy runs `a` and `b` first part, if they do; that must be a near tie: the
/// reference's top-2 log-probability margin there, `margin_at(j)`, under 2 × `TIE_MARGIN`.
pub fn parting_at_tie(a: &[u32], b: &[u32], margin_at: impl FnOnce(usize) -> f32, what: &str) -> Option<usize> {
    let j = divergence(a, b)?;
    let margin = margin_at(j);
    println!("TABLE|{what}: diverged at token {j}|top-2 margin {margin:.4}|||");
    assert!(margin < 2.0 * TIE_MARGIN, "{what}: diverges at token {j}, a clear position (margin {margin})");
    Some(j)
}

/// `model`'s margin between its top two log-probabilities after `context`.
pub fn top2_margin(model: &dyn CausalLm, context: &[u32]) -> f32 {
    let vocab = model.config().vocab_size;
    let logits = prefill_logits(model, context);
    let last = log_softmax(&logits[logits.len() - vocab..]);
    let top = top_k(&last, 2);
    last[top[0]] - last[top[1]]
}

/// How far a sampled pick may sit from a boundary of its distribution for two runs to part
/// there (`pick_margin_limit`).
pub const DRAW_MARGIN: f32 = 0.02;

/// How close to another pick request `params`' pick at its `j`-th generated token was, under
/// `model`'s logits after `prompt` and `tokens[..j]` (one choice's tokens, drawing from
/// `seed`): at temperature 0 the top-2 logit margin, otherwise the distance of its uniform
/// draw from the nearest boundary of the distribution it samples (processors applied).
pub fn draw_margin(
    model: &dyn CausalLm,
    (prompt, params): (&[u32], &RequestParams),
    seed: u64,
    tokens: &[u32],
    j: usize,
) -> f32 {
    let vocab = model.config().vocab_size;
    let context = [prompt, &tokens[..j]].concat();
    let logits = prefill_logits(model, &context);
    let mut last = logits[logits.len() - vocab..].to_vec();
    let mut counts = TokenCounts::new();
    for &t in &tokens[..j] {
        *counts.entry(t).or_insert(0) += 1;
    }
    let sp = &params.sampling;
    let banned = if j < params.min_tokens { params.stop_token_ids.clone() } else { Vec::new() };
    apply_processors(&mut last, sp, prompt, &counts, &banned);
    if sp.temperature == 0.0 {
        let top = top_k(&last, 2);
        return last[top[0]] - last[top[1]];
    }
    let u = uniform(seed, j as u64);
    let mut cdf = 0.0;
    let mut margin = f32::INFINITY;
    for (_, p) in distribution(&last, sp) {
        cdf += p;
        margin = margin.min((cdf - u).abs());
    }
    margin
}

/// The `draw_margin` under which two runs of a request may part: the GPU's GEMM summation
/// order depends on the batch's shape, so its bf16 rounding moves a near tie, never a clear pick.
pub fn pick_margin_limit(params: &RequestParams) -> f32 {
    if params.sampling.temperature == 0.0 {
        2.0 * TIE_MARGIN
    } else {
        DRAW_MARGIN
    }
}

/// Whether greedy continuations `a` and `b` of `prompt` agree (where they part, `cpu`'s
/// margin must show a near tie).
pub fn equal_or_tie(cpu: &dyn CausalLm, prompt: &[u32], a: &[u32], b: &[u32], what: &str) -> bool {
    parting_at_tie(a, b, |j| top2_margin(cpu, &[prompt, &a[..j]].concat()), what).is_none()
}

/// How close `got`'s logits are to the reference's `want` (rows of `vocab`).
pub struct LogitsAgreement {
    /// Relative L2 error over all logits.
    pub rel_l2: f64,
    pub max_abs: f32,
    /// Largest log-probability error over each row's reference top 5.
    pub top5_err: f32,
    /// Rows whose reference top-2 margin exceeds `TIE_MARGIN`, and those of them whose argmax
    /// agrees.
    pub clear: usize,
    pub clear_equal: usize,
    /// The largest reference top-2 margin among rows whose argmax differs (0 when none).
    pub worst_flip: f32,
    /// Rows where either side's top token is outside the other's top 5.
    pub outside_top5: usize,
}

/// Compare `got` with `want` row by row; every logit of `got` must be finite and each side's
/// top token within the other's top 5 (vLLM's `check_logprobs_close`).
pub fn compare_logits(want: &[f32], got: &[f32], vocab: usize, what: &str) -> LogitsAgreement {
    let a = measure_logits(want, got, vocab, what);
    assert_eq!(a.outside_top5, 0, "{what}: top-1 not in the other's top-5");
    a
}

/// `compare_logits` without its top-5 assertion (only finite logits asserted): for runs whose
/// reference may legitimately part further (a router near tie kept in a recurrent state).
pub fn measure_logits(want: &[f32], got: &[f32], vocab: usize, what: &str) -> LogitsAgreement {
    assert_eq!(want.len(), got.len(), "{what}: logits lengths");
    assert!(got.iter().all(|x| x.is_finite()), "{what}: non-finite logits");
    let (mut num, mut den) = (0f64, 0f64);
    let mut a = LogitsAgreement {
        rel_l2: 0.0,
        max_abs: 0.0,
        top5_err: 0.0,
        clear: 0,
        clear_equal: 0,
        worst_flip: 0.0,
        outside_top5: 0,
    };
    for (w, g) in want.chunks_exact(vocab).zip(got.chunks_exact(vocab)) {
        for (x, y) in w.iter().zip(g) {
            num += ((x - y) as f64).powi(2);
            den += (*x as f64).powi(2);
            a.max_abs = a.max_abs.max((x - y).abs());
        }
        let (lw, lg) = (log_softmax(w), log_softmax(g));
        let (tw, tg) = (top_k(&lw, 5), top_k(&lg, 5));
        a.outside_top5 += usize::from(!(tg.contains(&tw[0]) && tw.contains(&tg[0])));
        for &t in &tw {
            a.top5_err = a.top5_err.max((lw[t] - lg[t]).abs());
        }
        let margin = lw[tw[0]] - lw[tw[1]];
        if tw[0] != tg[0] {
            a.worst_flip = a.worst_flip.max(margin);
        }
        if margin > TIE_MARGIN {
            a.clear += 1;
            a.clear_equal += usize::from(tw[0] == tg[0]);
        }
    }
    a.rel_l2 = (num / den.max(1e-30)).sqrt();
    a
}
