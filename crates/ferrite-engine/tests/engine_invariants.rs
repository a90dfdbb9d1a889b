//! Engine invariants on the tiny fixtures: batching, chunking, prefix caching, preemption and
//! forking never change a request's tokens; a stress run with aborts leaks no block; bad
//! requests get typed errors while the engine carries on.

mod common;

use std::sync::Arc;

use common::*;
use ferrite_engine::{EngineConfig, EngineError, FinishReason, Request, RequestParams, SamplingParams};
use ferrite_models::model::{CausalLm, Pending, Want};
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc::unbounded_channel;

/// The mixture-of-experts fixture the routing-sensitive invariants also run on.
const MOE: &str = "qwen3-moe";

fn model() -> (Arc<dyn CausalLm>, Vec<Vec<u32>>) {
    fixture("llama")
}

fn fixture(name: &str) -> (Arc<dyn CausalLm>, Vec<Vec<u32>>) {
    let (m, reference) = load_fixture(name);
    let prompts = reference["prompts"].as_array().expect("prompts").iter().map(ids).collect();
    (m, prompts)
}

/// A prompt of `len` ids drawn from `rng` (avoiding id 0).
fn random_prompt(rng: &mut impl Rng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(1..vocab as u32)).collect()
}

#[test]
fn batch_invariance_greedy_and_seeded() {
    batch_invariance("llama");
}

#[test]
fn moe_batch_invariance_greedy_and_seeded() {
    batch_invariance(MOE);
}

/// An MLX 4-bit checkpoint: the integer kernels give a row the same result in any batch.
#[test]
fn mlx_batch_invariance_greedy_and_seeded() {
    batch_invariance("mlx-llama-mixed");
}

fn batch_invariance(name: &str) {
    let (m, _) = fixture(name);
    let vocab = m.config().vocab_size;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let reqs: Vec<(Vec<u32>, RequestParams)> = (0..16)
        .map(|i| {
            let len = rng.random_range(1..60);
            let prompt = random_prompt(&mut rng, len, vocab);
            let params =
                if i % 2 == 0 { greedy(rng.random_range(1..24)) } else { seeded(rng.random_range(1..24), i, 0.8) };
            (prompt, params)
        })
        .collect();
    let cfg = EngineConfig { max_num_batched_tokens: 37, block_size: 4, ..EngineConfig::default() };
    let mut c = core(&m, cfg.clone());
    let mut rxs: Vec<_> =
        reqs.iter().enumerate().map(|(i, (p, params))| add(&mut c, i as u64, p.clone(), params.clone())).collect();
    run_to_end(&mut c);
    for (i, (p, params)) in reqs.iter().enumerate() {
        let together = collect(&mut rxs[i], 1);
        let solo = alone(&m, cfg.clone(), p.clone(), params.clone());
        assert_eq!(together, solo, "{name}: request {i} differs when batched");
        assert_eq!(together[0].len(), params.max_tokens.unwrap_or(0));
    }
}

#[test]
fn chunked_prefill_equals_whole_prefill() {
    chunked_prefill("llama");
}

#[test]
fn moe_chunked_prefill_equals_whole_prefill() {
    chunked_prefill(MOE);
}

#[test]
fn mlx_chunked_prefill_equals_whole_prefill() {
    chunked_prefill("mlx-qwen3-q4-g64");
}

fn chunked_prefill(name: &str) {
    let (m, prompts) = fixture(name);
    let prompt = prompts[2].clone();
    let whole =
        alone(&m, EngineConfig { max_num_batched_tokens: 4096, ..EngineConfig::default() }, prompt.clone(), greedy(20));
    for chunk in [1, 3, 7, 16, 39] {
        for block in [1, 4, 16] {
            let cfg = EngineConfig { max_num_batched_tokens: chunk, block_size: block, ..EngineConfig::default() };
            assert_eq!(alone(&m, cfg, prompt.clone(), greedy(20)), whole, "{name}: chunk {chunk} block {block}");
        }
    }
}

#[test]
fn prefix_hit_equals_cold_run() {
    prefix_hit("llama");
}

#[test]
fn moe_prefix_hit_equals_cold_run() {
    prefix_hit(MOE);
}

fn prefix_hit(name: &str) {
    let (m, prompts) = fixture(name);
    let base = prompts[2].clone(); // 40 tokens
    let mut other = base[..33].to_vec();
    other.extend([5, 6, 7]);
    let cfg = EngineConfig { block_size: 4, ..EngineConfig::default() };
    let cold = alone(&m, EngineConfig { prefix_cache: false, ..cfg.clone() }, other.clone(), greedy(12));
    let mut c = core(&m, cfg);
    let mut rx = add(&mut c, 1, base, greedy(5));
    run_to_end(&mut c);
    collect(&mut rx, 1);
    let mut rx = add(&mut c, 2, other.clone(), greedy(12));
    run_to_end(&mut c);
    let mut cached = 0;
    let mut toks = Vec::new();
    while let Ok(o) = rx.try_recv() {
        toks.extend(o.token_ids);
        if let Some(f) = o.finished {
            cached = f.usage.cached_tokens;
        }
    }
    assert_eq!(cached, 32, "33 shared tokens = 8 full blocks of 4");
    assert_eq!(vec![toks], cold, "{name}");
    assert!(c.metrics().prefix_hit_rate() > 0.0);
}

#[test]
fn preemption_equals_uninterrupted() {
    let (m, _) = model();
    let vocab = m.config().vocab_size;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let reqs: Vec<_> = (0..6).map(|i| (random_prompt(&mut rng, 20 + i, vocab), seeded(30, i as u64, 1.0))).collect();
    // 60 positions of KV per request at most, 24 blocks of 4 = 96 positions for all six.
    let layout = m.kv_layout();
    let block_bytes: usize = layout.block_bytes(4).iter().sum();
    let cfg = EngineConfig { block_size: 4, kv_cache_memory: Some(24 * block_bytes), ..EngineConfig::default() };
    let mut c = core(&m, cfg);
    let mut rxs: Vec<_> =
        reqs.iter().enumerate().map(|(i, (p, pr))| add(&mut c, i as u64, p.clone(), pr.clone())).collect();
    while c.has_work() {
        c.step().expect("step");
        c.kv_manager().check_invariants().expect("invariants");
    }
    assert!(
        c.metrics().preemptions.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "the tiny pool forced no preemption"
    );
    for (i, (p, pr)) in reqs.iter().enumerate() {
        let got = collect(&mut rxs[i], 1);
        assert_eq!(
            got,
            alone(&m, EngineConfig { block_size: 4, ..EngineConfig::default() }, p.clone(), pr.clone()),
            "request {i}"
        );
    }
}

#[test]
fn n_choices_are_reproducible_and_share_the_prompt() {
    let (m, prompts) = model();
    let params = RequestParams { n: 4, ..seeded(16, 1234, 1.0) };
    let cfg = EngineConfig { block_size: 4, ..EngineConfig::default() };
    let a = alone(&m, cfg.clone(), prompts[2].clone(), params.clone());
    let b = alone(&m, cfg.clone(), prompts[2].clone(), params.clone());
    assert_eq!(a, b);
    assert_eq!(a.len(), 4);
    assert!(a.iter().all(|c| c.len() == 16));
    assert!(a.iter().any(|c| c != &a[0]), "four seeded choices were all identical");
    // Choice 0 is the same request run with n = 1.
    let single = alone(&m, cfg, prompts[2].clone(), RequestParams { n: 1, ..params });
    assert_eq!(a[0], single[0]);
}

#[test]
fn stress_random_arrivals_and_aborts_leak_nothing() {
    let (m, _) = model();
    let vocab = m.config().vocab_size;
    let layout = m.kv_layout();
    let block_bytes: usize = layout.block_bytes(4).iter().sum();
    let cfg = EngineConfig {
        block_size: 4,
        max_num_seqs: 16,
        max_num_batched_tokens: 64,
        max_model_len: Some(128),
        kv_cache_memory: Some(64 * block_bytes),
        ..EngineConfig::default()
    };
    let mut c = core(&m, cfg);
    let (free0, total) = c.kv_manager().free_blocks();
    assert_eq!(free0, total);
    let mut rng = rand::rngs::StdRng::seed_from_u64(99);
    let mut live = Vec::new();
    let (mut finished, mut aborted) = (0, 0);
    let total_requests = 2000;
    let mut added = 0u64;
    while added < total_requests || c.has_work() {
        // Random arrivals: 0-3 new requests per step.
        for _ in 0..rng.random_range(0..4) {
            if added >= total_requests {
                break;
            }
            let len = rng.random_range(1..48);
            let prompt = random_prompt(&mut rng, len, vocab);
            let params = RequestParams { n: rng.random_range(1..3), ..seeded(rng.random_range(1..24), added, 0.7) };
            let n = params.n;
            let (tx, rx) = unbounded_channel();
            c.add_request(added, Request { prompt, params }, tx).expect("valid");
            live.push((added, rx, n, 0usize, rng.random_bool(0.2)));
            added += 1;
        }
        c.step().expect("step");
        c.kv_manager().check_invariants().expect("invariants");
        // Drain outputs; abort the chosen 20 % at a random point (explicitly or by dropping).
        let mut keep = Vec::new();
        for (id, mut rx, n, mut done, abort) in live.drain(..) {
            while let Ok(o) = rx.try_recv() {
                if o.finished.is_some() {
                    done += 1;
                }
            }
            if done == n {
                finished += 1;
            } else if abort && rng.random_bool(0.3) {
                if rng.random_bool(0.5) {
                    c.abort(id);
                } // else: dropping the receiver aborts at the next send
                aborted += 1;
            } else {
                keep.push((id, rx, n, done, abort));
            }
        }
        live = keep;
    }
    assert!(live.is_empty(), "{} requests never ended", live.len());
    assert_eq!(finished + aborted, total_requests as usize);
    assert!(aborted > 100, "only {aborted} aborts happened");
    let (free, _) = c.kv_manager().free_blocks();
    assert_eq!(free, free0, "blocks leaked");
}

#[test]
fn bad_requests_get_typed_errors_and_the_engine_carries_on() {
    let (m, prompts) = model();
    let ctx = m.config().max_context();
    let mut c = core(&m, EngineConfig::default());
    let bad = |prompt: Vec<u32>, params: RequestParams| Request { prompt, params };
    let p = prompts[0].clone();
    let cases: Vec<(Request, &str)> = vec![
        (bad(vec![], greedy(4)), "empty"),
        (bad(vec![1; ctx], greedy(4)), "context"),
        (bad(p.clone(), greedy(0)), "max_tokens must be at least 1"),
        (bad(p.clone(), greedy(ctx)), "exceed the context"),
        (bad(p.clone(), RequestParams { n: 0, ..greedy(4) }), "n must be between"),
        (bad(p.clone(), RequestParams { n: 1000, ..greedy(4) }), "n must be between"),
        (
            bad(
                p.clone(),
                RequestParams { sampling: SamplingParams { top_p: 0.0, ..Default::default() }, ..greedy(4) },
            ),
            "top_p",
        ),
        (
            bad(
                p.clone(),
                RequestParams { sampling: SamplingParams { top_p: 1.5, ..Default::default() }, ..greedy(4) },
            ),
            "top_p",
        ),
        (
            bad(
                p.clone(),
                RequestParams { sampling: SamplingParams { temperature: -1.0, ..Default::default() }, ..greedy(4) },
            ),
            "temperature",
        ),
        (bad(p.clone(), RequestParams { logprobs: Some(21), ..greedy(4) }), "top_logprobs"),
        (bad(vec![1, 999_999], greedy(4)), "outside the vocabulary"),
        (bad(p.clone(), RequestParams { stop: vec!["x".into()], ..greedy(4) }), "tokenizer"),
    ];
    for (i, (req, want)) in cases.into_iter().enumerate() {
        let (tx, _rx) = unbounded_channel();
        let err: EngineError = c.add_request(100 + i as u64, req, tx).expect_err("must be rejected");
        assert!(err.to_string().contains(want), "case {i}: {err}");
    }
    let got = {
        let mut rx = add(&mut c, 1, p.clone(), greedy(8));
        run_to_end(&mut c);
        collect(&mut rx, 1)
    };
    assert_eq!(got, alone(&m, EngineConfig::default(), p, greedy(8)));
}

#[test]
fn logprobs_and_finish_reasons() {
    let (m, prompts) = model();
    let mut c = core(&m, EngineConfig::default());
    let mut rx = add(&mut c, 1, prompts[1].clone(), RequestParams { logprobs: Some(5), ..greedy(6) });
    run_to_end(&mut c);
    let mut n = 0;
    while let Ok(o) = rx.try_recv() {
        for lp in &o.logprobs {
            assert_eq!(lp.top.len(), 5);
            // Greedy picks the most likely token, whose log-probability leads the list.
            assert_eq!(lp.top[0].0, lp.token);
            assert!((lp.top[0].1 - lp.logprob).abs() < 1e-6 && lp.logprob <= 0.0);
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
            n += 1;
        }
        if let Some(f) = o.finished {
            assert_eq!(f.reason, FinishReason::Length);
            assert_eq!(f.usage.completion_tokens, 6);
        }
    }
    assert_eq!(n, 6);
    // A stop token ends the choice with reason Stop.
    let first = alone(&m, EngineConfig::default(), prompts[1].clone(), greedy(6))[0].clone();
    let mut rx = add(&mut c, 2, prompts[1].clone(), RequestParams { stop_token_ids: vec![first[2]], ..greedy(6) });
    run_to_end(&mut c);
    let mut toks = Vec::new();
    let mut reason = None;
    while let Ok(o) = rx.try_recv() {
        toks.extend(o.token_ids);
        reason = o.finished.map(|f| f.reason).or(reason);
    }
    let cut = first.iter().position(|&t| t == first[2]).expect("present") + 1;
    assert_eq!(toks, first[..cut]);
    assert_eq!(reason, Some(FinishReason::Stop));
}

/// The mistral fixture with a sliding window of `window` positions.
fn sliding_model(window: usize) -> (tempfile::TempDir, Arc<dyn CausalLm>) {
    let src = fixture_dir("mistral");
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::copy(src.join("model.safetensors"), tmp.path().join("model.safetensors")).expect("copy");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).expect("config")).expect("json");
    cfg["sliding_window"] = window.into();
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).expect("write");
    let m = ferrite_models::load(tmp.path()).expect("load").model;
    (tmp, m)
}

/// Greedy tokens by recomputing the whole sequence each step in a fresh cache (no paging,
/// nothing released): the reference for the sliding-window engine path.
fn recompute_greedy(m: &Arc<dyn CausalLm>, prompt: &[u32], n: usize) -> Vec<u32> {
    use ferrite_runtime::batch::RowLogits;
    use ferrite_runtime::{ForwardBatch, KvCache};
    let mut toks = prompt.to_vec();
    for _ in 0..n {
        let layout = m.kv_layout();
        let blocks = toks.len();
        let mut kv = KvCache::new(&layout, &vec![blocks; layout.groups.len()], 1).expect("kv");
        let mut batch = ForwardBatch::default();
        batch.push_row(&toks, toks.len(), vec![(0..blocks as u32).collect(); layout.groups.len()], RowLogits::Last);
        let logits = m.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("forward");
        toks.push(ferrite_runtime::cpu::argmax(&logits) as u32);
    }
    toks[prompt.len()..].to_vec()
}

#[test]
fn sliding_window_releases_blocks_and_matches_recompute() {
    let (_dir, m) = sliding_model(8);
    assert_eq!(m.kv_layout().groups, vec![ferrite_runtime::KvGroupKind::Sliding { window: 8 }]);
    let (_, prompts) = model();
    let prompt = prompts[2].clone(); // 40 tokens: five windows
    let want = recompute_greedy(&m, &prompt, 24);
    for chunk in [3, 64] {
        let cfg = EngineConfig { block_size: 4, max_num_batched_tokens: chunk, ..EngineConfig::default() };
        let mut c = core(&m, cfg);
        let (free0, _) = c.kv_manager().free_blocks();
        let mut rx = add(&mut c, 1, prompt.clone(), greedy(24));
        let mut max_used = 0;
        while c.has_work() {
            c.step().expect("step");
            c.kv_manager().check_invariants().expect("invariants");
            max_used = max_used.max(free0 - c.kv_manager().free_blocks().0);
        }
        assert_eq!(collect(&mut rx, 1)[0], want, "chunk {chunk}");
        // 64 positions would take 16 blocks of 4; the window keeps at most a few live.
        let bound = 8 / 4 + 1 + chunk.min(64).div_ceil(4) + 1;
        assert!(max_used <= bound, "chunk {chunk}: {max_used} blocks live at once (bound {bound})");
        assert_eq!(c.kv_manager().free_blocks().0, free0);
    }
}

/// Prefix caching with a sliding window: a hit needs only the blocks the window still reads
/// (the earlier ones were released), and gives the tokens of a cold run.
#[test]
fn sliding_window_prefix_hit_equals_cold_run() {
    let (_dir, m) = sliding_model(8);
    let (_, prompts) = model();
    let base = prompts[2].clone(); // 40 tokens
    let mut other = base[..33].to_vec();
    other.extend([5, 6, 7]);
    let cfg = EngineConfig { block_size: 4, max_num_batched_tokens: 7, ..EngineConfig::default() };
    let cold = alone(&m, EngineConfig { prefix_cache: false, ..cfg.clone() }, other.clone(), greedy(12));
    assert_eq!(cold[0], recompute_greedy(&m, &other, 12));
    let mut c = core(&m, cfg);
    let mut rx = add(&mut c, 1, base, greedy(5));
    run_to_end(&mut c);
    collect(&mut rx, 1);
    let mut rx = add(&mut c, 2, other, greedy(12));
    let mut cached = None;
    let mut toks = Vec::new();
    while c.has_work() {
        c.step().expect("step");
        c.kv_manager().check_invariants().expect("invariants");
    }
    while let Ok(o) = rx.try_recv() {
        toks.extend(o.token_ids);
        if let Some(f) = o.finished {
            cached = Some(f.usage.cached_tokens);
        }
    }
    assert_eq!(cached, Some(32), "8 full blocks of 4, the window's last two among them");
    assert_eq!(vec![toks], cold);
    let (free, total) = c.kv_manager().free_blocks();
    assert_eq!(free, total, "every block is released");
}
