//! The engine with a quantized KV cache (int8 / int4, group 16) on the tiny llama fixture
//! (head dim 16): the same bytes hold proportionally more tokens, and at temperature 0 with
//! int8 KV batching, prefix hits, preemption, n > 1 forks, speculation (prompt lookup and a
//! draft that disagrees, with rollbacks) and echo fill give exactly what each request gives
//! alone with plain decoding; a group size the head dim does not take is refused at start.

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use common::*;
use ferrite_engine::{EngineConfig, EngineCore, FillMode, RequestParams, Speculation};
use ferrite_models::model::CausalLm;
use ferrite_runtime::{KvDtype, KvScheme};
use rand::{Rng, SeedableRng};

fn model() -> (Arc<dyn CausalLm>, Vec<Vec<u32>>) {
    let (m, reference) = load_fixture("llama");
    let mut prompts: Vec<Vec<u32>> = reference["prompts"].as_array().expect("prompts").iter().map(ids).collect();
    // A prompt that repeats itself, so prompt lookup finds spans.
    prompts.push([10, 11, 12, 13, 14, 15].repeat(4));
    (m, prompts)
}

fn scheme(dtype: KvDtype) -> KvScheme {
    KvScheme { dtype, ..KvScheme::default() }
}

const INT8: KvDtype = KvDtype::Int8 { group: 16 };

/// Block size 4, int8 KV.
fn cfg() -> EngineConfig {
    EngineConfig { block_size: 4, max_num_batched_tokens: 96, kv_scheme: scheme(INT8), ..EngineConfig::default() }
}

fn no_leak(core: &EngineCore) {
    let (free, total) = core.kv_manager().free_blocks();
    assert_eq!(free, total, "KV blocks leaked");
    core.kv_manager().check_invariants().expect("invariants");
}

#[test]
fn smaller_types_hold_proportionally_more_tokens() {
    let (m, _) = model();
    let budget = 1 << 20;
    let capacity = |dtype| {
        let c = core(&m, EngineConfig { kv_cache_memory: Some(budget), kv_scheme: scheme(dtype), ..cfg() });
        (c.limits().kv_bytes_per_token, c.limits().kv_capacity_tokens)
    };
    let (f16, int8, int4) = (capacity(KvDtype::F16), capacity(INT8), capacity(KvDtype::Int4 { group: 16 }));
    // A row of 16 values: 32 bytes in f16, 16 + 4 in int8, 8 + 4 in int4.
    assert_eq!((int8.0 * 32, int4.0 * 32), (f16.0 * 20, f16.0 * 12));
    for (q, ratio) in [(int8, 32.0 / 20.0), (int4, 32.0 / 12.0)] {
        let got = q.1 as f64 / f16.1 as f64;
        assert!((got - ratio).abs() < 0.01, "capacity ratio {got}, want {ratio}");
    }
}

#[test]
fn a_group_size_the_head_dim_does_not_take_is_refused() {
    let (m, _) = model();
    let bad = EngineConfig { kv_scheme: scheme(KvDtype::Int8 { group: 32 }), ..cfg() };
    let err = EngineCore::new(m, None, vec![], &bad).err().expect("refused").to_string();
    assert!(err.contains("KV group size 32 does not divide the head dim 16"), "{err}");
}

#[test]
fn int8_batched_prefix_hit_and_preempted_equal_alone() {
    let (m, prompts) = model();
    let vocab = m.config().vocab_size;
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let reqs: Vec<(Vec<u32>, RequestParams)> = (0..16)
        .map(|i| {
            let len = rng.random_range(1..50);
            let p: Vec<u32> = (0..len).map(|_| rng.random_range(1..vocab as u32)).collect();
            let params = if i % 3 == 0 { seeded(20, i, 0.8) } else { greedy(rng.random_range(1..24)) };
            (p, params)
        })
        .chain([(prompts[2].clone(), RequestParams { n: 3, ..greedy(10) })])
        .collect();
    let solo: Vec<_> = reqs.iter().map(|(p, pr)| alone(&m, cfg(), p.clone(), pr.clone())).collect();
    // Batched, twice over a warm prefix cache; then in a pool small enough to preempt.
    let block_bytes: usize = m.kv_block_bytes(4, &scheme(INT8)).expect("bytes").iter().sum();
    let tight = EngineConfig { kv_cache_memory: Some(24 * block_bytes), ..cfg() };
    for (name, c, rounds) in [("batched", cfg(), 2), ("preempted", tight, 1)] {
        let mut core = core(&m, c);
        for round in 0..rounds {
            let mut rxs: Vec<_> = reqs
                .iter()
                .enumerate()
                .map(|(i, (p, pr))| add(&mut core, (round * 100 + i) as u64, p.clone(), pr.clone()))
                .collect();
            run_to_end(&mut core);
            for (i, rx) in rxs.iter_mut().enumerate() {
                assert_eq!(collect(rx, reqs[i].1.n), solo[i], "{name}: request {i}, round {round}");
            }
        }
        no_leak(&core);
        if name == "batched" {
            assert!(core.metrics().prefix_hit_rate() > 0.0, "no prefix hit");
        } else {
            assert!(core.metrics().preemptions.load(Relaxed) > 0, "the tiny pool forced no preemption");
        }
    }
}

#[test]
fn int8_speculation_and_fill_equal_plain_decoding() {
    let (m, prompts) = model();
    let reqs: Vec<_> = prompts.iter().map(|p| (p.clone(), greedy(24))).collect();
    let plain: Vec<_> = reqs.iter().map(|(p, pr)| alone(&m, cfg(), p.clone(), pr.clone())).collect();
    let echo: Vec<_> =
        reqs.iter().map(|(p, pr)| (p.clone(), RequestParams { fill: Some(FillMode::Echo), ..pr.clone() })).collect();
    let weak = first_layers("llama", 1);
    let methods = [
        ("ngram", EngineConfig { speculation: Speculation::Ngram, num_draft_tokens: 3, ..cfg() }, &reqs),
        ("fill echo", cfg(), &echo),
        ("weak draft", EngineConfig { speculation: Speculation::Draft(weak), num_draft_tokens: 3, ..cfg() }, &reqs),
    ];
    for (name, c, reqs) in methods {
        let mut core = core(&m, c);
        let mut rxs: Vec<_> =
            reqs.iter().enumerate().map(|(i, (p, pr))| add(&mut core, i as u64, p.clone(), pr.clone())).collect();
        run_to_end(&mut core);
        for (i, rx) in rxs.iter_mut().enumerate() {
            assert_eq!(collect(rx, 1), plain[i], "{name}: request {i}");
        }
        no_leak(&core);
        let (proposed, accepted) =
            (core.metrics().verify_proposed_tokens.load(Relaxed), core.metrics().verify_accepted_tokens.load(Relaxed));
        if name != "fill echo" {
            assert!(proposed > 0 && accepted < proposed, "{name}: {accepted} of {proposed}: no rollback was tested");
        }
    }
}
