//! The delayed quantized KV start on the GPU (bf16 twin pools, the device conversion), gated by
//! `FERRITE_TEST_CUDA=1` (skipped elsewhere): the CPU's `kv_quant_start.rs` held on the tiny
//! fixtures (head dim 16, int8 / int4 groups of 16, fp8; blocks of 4) at temperature 0.
//!
//! - A row that turns during decode gives the tokens of the same computation by hand over a
//!   device cache (its prompt in one step and each token after it alone, rows in the twins up
//!   to the start, then `KvCache::convert_blocks` and the quantized pools): the same step
//!   shapes, so the same bits, for every quantized type. A prompt ending at the start or
//!   running past it (turning in its prefill) gives the decoded tokens up to a near tie of the
//!   CPU's logits (int8; other types report where they part: a step of a different shape
//!   rounds bf16 activations differently, and a 4-bit or e4m3 code is 16x coarser than the
//!   noise `equal_or_tie` allows).
//! - Requests of different starts and precisions batched, twice over a warm prefix cache,
//!   give what they give alone (int8, up to a near tie).
//! - n-gram speculation and echo fill, with verify spans cut at the start and rejected tails
//!   rolled back, give plain decoding's tokens (up to a near tie).
//! - A prefix is served only at the precision and start that made it (the engine's counts,
//!   as on the CPU), with a cold run's tokens.
//! - Key offsets (a k-biased fixture, qwen2): the device stores keys less the same offsets as
//!   the host; a prefill and decode over int8 KV gives the host engine's logits within the
//!   tolerance of bf16 activations against f32.
//!
//! Fixtures: llama, gemma3 (a sliding group beside a full one) and gemma4-shared-ple
//! (KV-shared layers reading their donor's pools, sliding windows).

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use common::model::{compare_logits, cuda_enabled, divergence, equal_or_tie, top2_margin};
use common::{add, alone, collect, core, finish, greedy, load_fixture, run_to_end};
use ferrite_engine::{EngineConfig, EngineCore, FillMode, KvPrecision, RequestParams, Speculation};
use ferrite_models::model::{CausalLm, Pending, Want};
use ferrite_runtime::batch::{RowLogits, RowOptions};
use ferrite_runtime::cuda::DeviceChoice;
use ferrite_runtime::{ForwardBatch, KvDtype, KvScheme};
use rand::{Rng, SeedableRng};

const FIXTURES: [&str; 3] = ["llama", "gemma3", "gemma4-shared-ple"];
const INT8: KvDtype = KvDtype::Int8 { group: 16 };
const DTYPES: [KvDtype; 3] = [INT8, KvDtype::Int4 { group: 16 }, KvDtype::Fp8];

/// The fixture `name` on the GPU and on the CPU (the judge of near ties).
fn models(name: &str) -> (Arc<dyn CausalLm>, Arc<dyn CausalLm>) {
    let dir = common::fixture_dir(name);
    let gpu = ferrite_models::load_on(&dir, DeviceChoice::Cuda(0)).unwrap_or_else(|e| panic!("cuda {name}: {e}"));
    (gpu.model, load_fixture(name).0)
}

/// Blocks of 4, `dtype` KV turning at `start`, 16 MiB of KV.
fn cfg(dtype: KvDtype, start: usize) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        max_num_batched_tokens: 96,
        kv_cache_memory: Some(16 << 20),
        kv_scheme: KvScheme { dtype, ..KvScheme::default() },
        quantized_kv_start: start,
        ..EngineConfig::default()
    }
}

fn prompt(rng: &mut rand::rngs::StdRng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(1..vocab as u32)).collect()
}

fn no_leak(core: &EngineCore) {
    core.check_kv_invariants().expect("invariants");
    let (free, total) = core.kv_manager().free_blocks();
    assert_eq!(free, total, "KV blocks leaked");
}

fn transitions(core: &EngineCore) -> u64 {
    core.metrics().kv_transitions.load(Relaxed)
}

/// `a` and `b`, greedy continuations of `prompt`: equal up to a near tie of `cpu`'s logits
/// when `strict`, else where they part is reported.
fn agree(cpu: &dyn CausalLm, prompt: &[u32], a: &[u32], b: &[u32], strict: bool, what: &str) {
    if strict {
        assert!(equal_or_tie(cpu, prompt, a, b, what), "{what}");
    } else if let Some(j) = divergence(a, b) {
        let margin = top2_margin(cpu, &[prompt, &a[..j]].concat());
        println!("TABLE|{what}: parts at token {j}|top-2 margin {margin:.4}|||");
    }
}

/// The greedy tokens after `p` of a row that turns at `start`, by hand on the device: the
/// prompt in one step and each token after it alone, in the twin pools up to `start`, then
/// its blocks converted (`KvCache::convert_blocks`) and the rest over the quantized pools.
fn by_hand(m: &dyn CausalLm, p: &[u32], dtype: KvDtype, start: usize, gen: usize) -> Vec<u32> {
    let layout = m.kv_layout();
    let groups = layout.groups.len();
    let blocks = (p.len() + gen).div_ceil(4);
    let table = vec![(0..blocks as u32).collect::<Vec<_>>(); groups];
    let scheme = KvScheme { dtype, ..KvScheme::default() };
    let mut kv = m.new_kv_cache(&vec![blocks; groups], 4, &scheme).expect("device cache");
    kv.add_full_precision(&vec![blocks; groups]).expect("twin pools");
    let mut tokens = p.to_vec();
    let mut computed = 0;
    while tokens.len() < p.len() + gen {
        if computed == start {
            let moves: Vec<(u32, u32)> = (0..start.div_ceil(4) as u32).map(|b| (b, b)).collect();
            (0..groups).for_each(|g| kv.convert_blocks(g, &moves).expect("conversion"));
        }
        let options = RowOptions { adapter: None, full_precision: computed < start };
        let mut batch = ForwardBatch::default();
        batch.push_row_with(&tokens[computed..], tokens.len(), table.clone(), RowLogits::Last, options);
        let logits = m.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("step");
        computed = tokens.len();
        let best = logits.iter().enumerate().fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b });
        tokens.push(best.0 as u32);
    }
    tokens.split_off(p.len())
}

#[test]
fn cuda_rows_turning_during_decode_equal_a_fresh_prefill_turning_at_their_start() {
    if !cuda_enabled("cuda_rows_turning_during_decode_equal_a_fresh_prefill_turning_at_their_start") {
        return;
    }
    let gen = 20;
    for name in FIXTURES {
        let (m, cpu) = models(name);
        let vocab = m.config().vocab_size;
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for dtype in DTYPES {
            for start in [1usize, 6, 13] {
                let len = start.saturating_sub(3).max(1);
                let p = prompt(&mut rng, len, vocab);
                let what = format!("{name} {dtype}, start {start}, prompt {len}");
                let mut c = core(&m, cfg(dtype, start));
                let mut rx = add(&mut c, 1, p.clone(), greedy(gen));
                run_to_end(&mut c);
                let decoded = collect(&mut rx, 1).remove(0);
                assert_eq!(decoded, by_hand(m.as_ref(), &p, dtype, start, gen), "{what}: the reference by hand");
                assert_eq!(transitions(&c), 1, "{what}: one transition");
                no_leak(&c);
                for at in [start, start + 3] {
                    let k = at - len;
                    let again = [p.clone(), decoded[..k].to_vec()].concat();
                    let mut c = core(&m, cfg(dtype, start));
                    let mut rx = add(&mut c, 2, again.clone(), greedy(gen - k));
                    run_to_end(&mut c);
                    let got = collect(&mut rx, 1).remove(0);
                    agree(
                        cpu.as_ref(),
                        &again,
                        &decoded[k..],
                        &got,
                        dtype == INT8,
                        &format!("{what}, prefilled to {at}"),
                    );
                    assert_eq!(transitions(&c), 1, "{what}, prefilled to {at}: one transition");
                    no_leak(&c);
                }
            }
        }
    }
}

/// Requests of different starts and precisions against an engine turning at 9.
fn mixed_requests(vocab: usize) -> Vec<(Vec<u32>, RequestParams)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let full = Some(KvPrecision::Full);
    let choices = [(None, None), (Some(KvPrecision::Int8), Some(0)), (None, Some(3)), (None, Some(40)), (full, None)];
    (0..10)
        .map(|i| {
            let (dtype, start) = choices[i % choices.len()];
            let len = if dtype == full { rng.random_range(1..20) } else { rng.random_range(1..50) };
            let params = RequestParams { kv_cache_dtype: dtype, quantized_kv_start: start, ..greedy(16) };
            (prompt(&mut rng, len, vocab), params)
        })
        .collect()
}

#[test]
fn cuda_rows_before_and_after_their_start_batched_warm_equal_alone() {
    if !cuda_enabled("cuda_rows_before_and_after_their_start_batched_warm_equal_alone") {
        return;
    }
    for name in FIXTURES {
        let (m, cpu) = models(name);
        let reqs = mixed_requests(m.config().vocab_size);
        let solo: Vec<_> = reqs.iter().map(|(p, pr)| alone(&m, cfg(INT8, 9), p.clone(), pr.clone())).collect();
        let mut c = core(&m, cfg(INT8, 9));
        for round in 0..2 {
            let mut rxs: Vec<_> = (reqs.iter().enumerate())
                .map(|(i, (p, pr))| add(&mut c, (round * 100 + i) as u64, p.clone(), pr.clone()))
                .collect();
            run_to_end(&mut c);
            for (i, rx) in rxs.iter_mut().enumerate() {
                let got = collect(rx, 1).remove(0);
                agree(
                    cpu.as_ref(),
                    &reqs[i].0,
                    &solo[i][0],
                    &got,
                    true,
                    &format!("{name}: request {i}, round {round}"),
                );
            }
            no_leak(&c);
        }
        assert!(transitions(&c) > 0, "{name}: no row turned");
        assert!(c.metrics().prefix_hit_rate() > 0.0, "{name}: no prefix hit");
    }
}

#[test]
fn cuda_speculation_and_fill_around_the_start_equal_plain_decoding() {
    if !cuda_enabled("cuda_speculation_and_fill_around_the_start_equal_plain_decoding") {
        return;
    }
    let (m, cpu) = models("llama");
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let vocab = m.config().vocab_size;
    let mut prompts = vec![[10, 11, 12, 13, 14, 15].repeat(4), [7, 8, 9].repeat(3)];
    for len in [8, 20, 29, 33] {
        let head = prompt(&mut rng, len - len / 2, vocab);
        prompts.push([head.clone(), head[..len / 2].to_vec()].concat());
    }
    for start in [11, 26] {
        let plain: Vec<_> = prompts.iter().map(|p| alone(&m, cfg(INT8, start), p.clone(), greedy(20))).collect();
        let ngram = EngineConfig { speculation: Speculation::Ngram, num_draft_tokens: 3, ..cfg(INT8, start) };
        let echo = RequestParams { fill: Some(FillMode::Echo), ..greedy(20) };
        for (method, c, params) in [("ngram", ngram, greedy(20)), ("fill echo", cfg(INT8, start), echo)] {
            let mut core = core(&m, c);
            let mut rxs: Vec<_> =
                prompts.iter().enumerate().map(|(i, p)| add(&mut core, i as u64, p.clone(), params.clone())).collect();
            run_to_end(&mut core);
            for (i, rx) in rxs.iter_mut().enumerate() {
                let got = collect(rx, 1).remove(0);
                let what = format!("{method}, start {start}: request {i}");
                agree(cpu.as_ref(), &prompts[i], &plain[i][0], &got, true, &what);
            }
            no_leak(&core);
            let metrics = core.metrics();
            let (proposed, accepted) =
                (metrics.verify_proposed_tokens.load(Relaxed), metrics.verify_accepted_tokens.load(Relaxed));
            if method == "ngram" {
                assert!(proposed > 0 && accepted < proposed, "{accepted} of {proposed}: no rollback was tested");
            }
            assert!(transitions(&core) > 0, "{method}: no row turned");
        }
    }
}

#[test]
fn cuda_a_prefix_is_served_only_at_the_precision_and_start_that_made_it() {
    if !cuda_enabled("cuda_a_prefix_is_served_only_at_the_precision_and_start_that_made_it") {
        return;
    }
    for name in FIXTURES {
        let (m, cpu) = models(name);
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let p = prompt(&mut rng, 33, m.config().vocab_size);
        let mut c = core(&m, cfg(INT8, 6));
        let mut id = 0;
        // The positions served from the cache; the tokens are a cold run's (up to a near tie).
        let mut cached = |dtype, start| {
            id += 1;
            let params = RequestParams { kv_cache_dtype: dtype, quantized_kv_start: start, ..greedy(8) };
            let rx = add(&mut c, id, p.clone(), params.clone());
            let (tokens, usage) = finish(&mut c, rx);
            let cold = alone(&m, EngineConfig { prefix_cache: false, ..cfg(INT8, 6) }, p.clone(), params);
            agree(cpu.as_ref(), &p, &cold[0], &tokens, true, &format!("{name}: request {id}"));
            no_leak(&c);
            usage.cached_tokens
        };
        let (full, int8) = (Some(KvPrecision::Full), Some(KvPrecision::Int8));
        assert_eq!(cached(None, None), 0, "{name}");
        assert_eq!(cached(None, None), 32, "{name}");
        assert_eq!(cached(None, Some(10)), 4, "{name}");
        assert_eq!(cached(None, Some(10)), 32, "{name}");
        assert_eq!(cached(full, None), 8, "{name}");
        assert_eq!(cached(int8, Some(0)), 0, "{name}");
        assert_eq!(cached(int8, Some(0)), 32, "{name}");
    }
}

/// A k-biased fixture's int8 KV on the device stores keys less the host's offsets: a prefill
/// and decode steps give the host engine's logits (int8 KV with the same offsets) within the
/// tolerance of bf16 activations, and the scheme names the offsets on both.
#[test]
fn cuda_key_offsets_give_the_hosts_logits() {
    if !cuda_enabled("cuda_key_offsets_give_the_hosts_logits") {
        return;
    }
    let name = "qwen2";
    let (m, cpu) = models(name);
    let offsets = cpu.kv_key_offsets();
    assert!(offsets.iter().any(Option::is_some), "{name}: the fixture has no k bias to offset");
    assert_eq!(m.kv_key_offsets(), offsets, "{name}: the device model's offsets are the host's");
    let scheme = KvScheme { dtype: INT8, ..KvScheme::default() };
    let vocab = m.config().vocab_size;
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let run = prompt(&mut rng, 24, vocab);
    let layout = m.kv_layout();
    let groups = layout.groups.len();
    let table = vec![(0..8u32).collect::<Vec<_>>(); groups];
    let mut logits = Vec::new();
    for model in [&cpu, &m] {
        let mut kv = model.new_kv_cache(&vec![8; groups], 4, &scheme).expect("cache");
        assert!(kv.scheme().ends_with("-key-offsets"), "{name}: {}", kv.scheme());
        let mut out = Vec::new();
        for end in std::iter::once(16).chain(17..=run.len()) {
            let tokens = if end == 16 { &run[..16] } else { &run[end - 1..end] };
            let mut batch = ForwardBatch::default();
            batch.push_row(tokens, end, table.clone(), RowLogits::Last);
            out.extend(model.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("step"));
        }
        logits.push(out);
    }
    let a = compare_logits(&logits[0], &logits[1], vocab, &format!("{name} int8 key offsets, GPU vs CPU"));
    println!("TABLE|{name} int8 KV with key offsets, GPU vs CPU|rel L2 {:.4}|max {:.4}|||", a.rel_l2, a.max_abs);
    assert!(a.rel_l2 < 0.05, "{name}: relative L2 {} of the GPU's logits against the host's", a.rel_l2);
    assert_eq!(a.clear_equal, a.clear, "{name}: a clear argmax flipped (widest flipped margin {})", a.worst_flip);
}
