//! The delayed quantized KV start (`--quantized-kv-start`, a request's `quantized_kv_start` and
//! `kv_cache_dtype`) on the tiny fixtures (int8 KV, group 16, blocks of 4): a row that turns
//! quantized during decode gives what a fresh prefill that turns at the same start gives; at
//! temperature 0 speculation and fill (with verify spans cut at the start and rollbacks right
//! after it) give plain decoding's tokens; 16 requests of different starts and precisions,
//! batched, over a warm prefix cache, preempted in a tight pool, and forked (n > 1, with the
//! start inside the shared prompt), each give what they give alone; Gemma's sliding windows
//! and KV-shared layers turn too; host RAM and the SSD tier serve a prefix only to the start
//! that made it; a row whose start lies past its end gives a full-precision cache's tokens; no
//! block leaks.
//!
//! The hybrid fixtures (`qwen3.5`, `qwen3-next`: gated DeltaNet layers, whose recurrent state
//! slots have no twins and keep their values through a row's start, beside full-attention
//! layers that turn) are held to the same: turning during decode against the same reference
//! by hand (its state carried over), speculation and fill (spans of per-token states rolled
//! back on either side of the start), mixed starts batched, warm and preempted, a prefix
//! served only at the start that made it (state snapshots of the full-precision chain before
//! it, of the start's own chain after it) and from host RAM and the SSD tier, chunked prefill
//! against whole prefill, a start past the end against a full-precision cache, and what the
//! pools cannot serve refused with the same messages.

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use common::hybrid::HYBRIDS;
use common::*;
use ferrite_engine::kv::disk::DiskConfig;
use ferrite_engine::sampling::TokenLogprob;
use ferrite_engine::{EngineConfig, EngineCore, FillMode, KvPrecision, RequestParams, Speculation};
use ferrite_models::model::{CausalLm, Pending, Want};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::kv::KvPool;
use ferrite_runtime::{ForwardBatch, KvCache, KvDtype, KvScheme};
use rand::{Rng, SeedableRng};

const INT8: KvDtype = KvDtype::Int8 { group: 16 };

/// The llama fixture and the hybrid ones.
fn llama_and_hybrids() -> impl Iterator<Item = &'static str> {
    std::iter::once("llama").chain(HYBRIDS.iter().map(|&(name, _)| name))
}

/// Blocks of 4, int8 KV turning at `start`; a recurrent state snapshot at every block (the
/// default stride would keep one only every ~20 blocks of the tiny hybrids; no other model
/// has one).
fn cfg(start: usize) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        max_num_batched_tokens: 96,
        kv_scheme: KvScheme { dtype: INT8, ..KvScheme::default() },
        quantized_kv_start: start,
        state_snapshot_interval: Some(4),
        ..EngineConfig::default()
    }
}

/// `cfg(start)` over a full-precision (f16) cache without twins.
fn f16_cfg() -> EngineConfig {
    EngineConfig { kv_scheme: KvScheme::default(), ..cfg(0) }
}

fn prompt(rng: &mut rand::rngs::StdRng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(1..vocab as u32)).collect()
}

/// `params` asking for `dtype` (None: the engine's) turning at `start` (None: the engine's).
fn kv(params: RequestParams, dtype: Option<KvPrecision>, start: Option<usize>) -> RequestParams {
    RequestParams { kv_cache_dtype: dtype, quantized_kv_start: start, ..params }
}

fn no_leak(core: &EngineCore) {
    core.check_kv_invariants().expect("invariants");
    let (free, total) = core.kv_manager().free_blocks();
    assert_eq!(free, total, "KV blocks leaked");
}

fn transitions(core: &EngineCore) -> u64 {
    core.metrics().kv_transitions.load(Relaxed)
}

/// Greedy tokens continuing `p` (shorter than `start`) for `gen` steps by hand, as a row that
/// turns at `start` computes them: the prompt in one step and each token after it alone, over
/// an f16 cache up to `start`, whose values are then written into an int8 cache (as a write of
/// them stores them) that the rest runs over, the recurrent states (if any) copied as they are.
fn by_hand(m: &Arc<dyn CausalLm>, p: &[u32], start: usize, gen: usize) -> Vec<u32> {
    let layout = m.kv_layout();
    let blocks = (p.len() + gen).div_ceil(4);
    let table = vec![(0..blocks as u32).collect::<Vec<_>>(); layout.groups.len()];
    let cache = |dtype| {
        KvCache::with_scheme(&layout, &vec![blocks; layout.groups.len()], 4, &KvScheme { dtype, ..Default::default() })
    };
    let (mut f16, mut int8) = (cache(KvDtype::F16).expect("f16 cache"), cache(INT8).expect("int8 cache"));
    let mut tokens = p.to_vec();
    let mut computed = 0;
    while tokens.len() < p.len() + gen {
        if computed == start {
            for l in 0..layout.layers.len() {
                let from = f16.layer_mut(l).expect("layer");
                let (k, v) = (from.k.to_f32(), from.v.to_f32());
                let to = int8.layer_mut(l).expect("layer");
                for (pool, values) in [(&mut to.k, k), (&mut to.v, v)] {
                    let KvPool::Quant(q) = pool else { panic!("an int8 pool") };
                    assert!(q.write(0, &values));
                }
            }
            for i in 0..layout.states.len() {
                let from = f16.state_mut(i).expect("state");
                let slots: Vec<(Vec<f32>, Vec<f32>)> = (0..blocks as u32)
                    .map(|s| (from.conv(s).expect("slot").to_vec(), from.ssm(s).expect("slot").to_vec()))
                    .collect();
                let to = int8.state_mut(i).expect("state");
                for (s, (conv, ssm)) in slots.iter().enumerate() {
                    to.conv_mut(s as u32).expect("slot").copy_from_slice(conv);
                    to.ssm_mut(s as u32).expect("slot").copy_from_slice(ssm);
                }
            }
        }
        let kv = if computed < start { &mut f16 } else { &mut int8 };
        let mut batch = ForwardBatch::default();
        batch.push_row(&tokens[computed..], tokens.len(), table.clone(), RowLogits::Last);
        let logits = m.step(&batch, kv, Want::Logits).and_then(Pending::logits).expect("step");
        computed = tokens.len();
        let best = logits.iter().enumerate().fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b });
        tokens.push(best.0 as u32);
    }
    tokens.split_off(p.len())
}

#[test]
fn a_row_turning_during_decode_equals_a_fresh_prefill_turning_at_its_start() {
    turning_during_decode("llama");
}

#[test]
fn hybrid_rows_turning_during_decode_equal_a_fresh_prefill_turning_at_their_start() {
    HYBRIDS.iter().for_each(|&(name, _)| turning_during_decode(name));
}

/// A row of fixture `name` that turns during decode gives the tokens by hand, and so do rows
/// whose prompt ends at the start or runs past it; one transition each, nothing leaked.
fn turning_during_decode(name: &str) {
    let m = load_fixture(name).0;
    let vocab = m.config().vocab_size;
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let gen = 24;
    for start in [1usize, 6, 8, 13] {
        for len in [1, start.saturating_sub(1).max(1), start.saturating_sub(3).max(1)] {
            let p = prompt(&mut rng, len, vocab);
            // Generated past the start: the row turns during decode.
            let mut c = core(&m, cfg(start));
            let mut rx = add(&mut c, 1, p.clone(), greedy(gen));
            run_to_end(&mut c);
            let decoded = collect(&mut rx, 1).remove(0);
            assert_eq!(decoded, by_hand(&m, &p, start, gen), "{name}: start {start}, prompt {len}: the reference");
            assert_eq!(transitions(&c), 1, "{name}: start {start}, prompt {len}: one transition");
            no_leak(&c);
            // The same tokens as a prompt ending at the start, and one running past it: the
            // first turns when its first token is computed, the second within its prefill.
            for at in [start, start + 3] {
                let k = at - len;
                let again = [p.clone(), decoded[..k].to_vec()].concat();
                let mut c = core(&m, cfg(start));
                let mut rx = add(&mut c, 2, again, greedy(gen - k));
                run_to_end(&mut c);
                assert_eq!(
                    collect(&mut rx, 1).remove(0),
                    decoded[k..],
                    "{name}: start {start}, prompt {len}, prefilled to {at}"
                );
                assert_eq!(transitions(&c), 1);
                no_leak(&c);
            }
        }
    }
}

#[test]
fn speculation_and_fill_around_the_start_equal_plain_decoding() {
    speculation_around_the_start("llama", 1, None);
}

#[test]
fn hybrid_speculation_and_fill_around_the_start_equal_plain_decoding() {
    for &(name, attractor) in HYBRIDS {
        speculation_around_the_start(name, 3, Some(attractor));
    }
}

/// Speculation (n-gram, a draft of fixture `name`'s first `draft_layers` layers) and fill give
/// plain decoding's tokens at starts before, inside and past the prompts, with rejected tails
/// rolled back; with an `attractor` (a token the model repeats once it sees a run of it), its
/// run is among the prompts and lookups are accepted too.
fn speculation_around_the_start(name: &str, draft_layers: usize, attractor: Option<u32>) {
    let (m, reference) = load_fixture(name);
    let mut prompts: Vec<Vec<u32>> = reference["prompts"].as_array().expect("prompts").iter().map(ids).collect();
    // Prompts that repeat themselves, so prompt lookup and echo propose spans across starts.
    prompts.push([10, 11, 12, 13, 14, 15].repeat(4));
    prompts.push([7, 8, 9].repeat(3));
    prompts.extend(attractor.map(|a| vec![a; 30]));
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let vocab = m.config().vocab_size;
    for len in [3, 8, 12, 20, 27, 29, 31, 33] {
        let head = prompt(&mut rng, len - len / 2, vocab);
        // Half random, half an echo of the first half.
        prompts.push([head.clone(), head[..len / 2].to_vec()].concat());
    }
    let weak = first_layers(name, draft_layers);
    for start in [11, 26, 30] {
        let reqs: Vec<_> = prompts.iter().map(|p| (p.clone(), greedy(24))).collect();
        let plain: Vec<_> = reqs.iter().map(|(p, pr)| alone(&m, cfg(start), p.clone(), pr.clone())).collect();
        let echo: Vec<_> = (reqs.iter())
            .map(|(p, pr)| (p.clone(), RequestParams { fill: Some(FillMode::Echo), ..pr.clone() }))
            .collect();
        let methods = [
            ("ngram", EngineConfig { speculation: Speculation::Ngram, num_draft_tokens: 3, ..cfg(start) }, &reqs),
            ("fill echo", cfg(start), &echo),
            (
                "weak draft",
                EngineConfig { speculation: Speculation::Draft(weak.clone()), num_draft_tokens: 3, ..cfg(start) },
                &reqs,
            ),
        ];
        for (method, c, reqs) in methods {
            let mut core = core(&m, c);
            let mut rxs: Vec<_> =
                reqs.iter().enumerate().map(|(i, (p, pr))| add(&mut core, i as u64, p.clone(), pr.clone())).collect();
            run_to_end(&mut core);
            for (i, rx) in rxs.iter_mut().enumerate() {
                assert_eq!(collect(rx, 1), plain[i], "{name} {method}, start {start}: request {i}");
            }
            no_leak(&core);
            let metrics = core.metrics();
            let (proposed, accepted) =
                (metrics.verify_proposed_tokens.load(Relaxed), metrics.verify_accepted_tokens.load(Relaxed));
            if method != "fill echo" {
                assert!(
                    proposed > 0 && accepted < proposed,
                    "{name} {method}: {accepted} of {proposed}: no rollback was tested"
                );
            }
            if method == "ngram" && attractor.is_some() {
                assert!(accepted > 0, "{name}: no lookup was accepted");
            }
            assert!(transitions(&core) > 0, "{name} {method}: no row turned");
        }
    }
}

/// 16 requests of different starts and precisions (and two forked ones) against an engine
/// turning at 9 by default.
fn mixed_requests(vocab: usize) -> Vec<(Vec<u32>, RequestParams)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let full = Some(KvPrecision::Full);
    let int8 = Some(KvPrecision::Int8);
    let choices = [
        (None, None),
        (int8, Some(0)),
        (None, Some(3)),
        (int8, Some(17)),
        (None, Some(40)),
        (full, None),
        (Some(KvPrecision::Auto), Some(12)),
    ];
    let mut out: Vec<(Vec<u32>, RequestParams)> = (0..16)
        .map(|i| {
            let (dtype, start) = choices[i % choices.len()];
            // A full-precision row must fit the f16 pools.
            let len = if dtype == full { rng.random_range(1..20) } else { rng.random_range(1..50) };
            let params = if i % 3 == 0 { seeded(20, i as u64, 0.8) } else { greedy(rng.random_range(1..24)) };
            (prompt(&mut rng, len, vocab), kv(params, dtype, start))
        })
        .collect();
    // Forks sharing a prompt whose last block holds the start, and one past it.
    let p = prompt(&mut rng, 10, vocab);
    out.push((p.clone(), kv(RequestParams { n: 3, ..greedy(10) }, None, Some(9))));
    out.push((p, kv(RequestParams { n: 3, ..greedy(10) }, None, Some(4))));
    out
}

/// Each of the mixed requests batched on `c` (twice over a warm prefix cache when `rounds` is
/// 2) gives what it gives alone; returns the preemptions.
fn batched_equals_alone(
    m: &Arc<dyn CausalLm>,
    alone_cfg: EngineConfig,
    c: EngineConfig,
    rounds: usize,
    name: &str,
) -> u64 {
    let reqs = mixed_requests(m.config().vocab_size);
    let solo: Vec<_> = reqs.iter().map(|(p, pr)| alone(m, alone_cfg.clone(), p.clone(), pr.clone())).collect();
    let mut core = core(m, c);
    for round in 0..rounds {
        let mut rxs: Vec<_> = (reqs.iter().enumerate())
            .map(|(i, (p, pr))| add(&mut core, (round * 100 + i) as u64, p.clone(), pr.clone()))
            .collect();
        run_to_end(&mut core);
        for (i, rx) in rxs.iter_mut().enumerate() {
            assert_eq!(collect(rx, reqs[i].1.n), solo[i], "{name}: request {i}, round {round}");
        }
        no_leak(&core);
    }
    assert!(transitions(&core) > 0, "{name}: no row turned");
    if rounds > 1 {
        assert!(core.metrics().prefix_hit_rate() > 0.0, "{name}: no prefix hit");
    }
    core.metrics().preemptions.load(Relaxed)
}

#[test]
fn mixed_starts_and_precisions_batched_warm_and_preempted_equal_alone() {
    let m = load_fixture("llama").0;
    batched_equals_alone(&m, cfg(9), cfg(9), 2, "batched");
    // 48 quantized blocks' bytes: 15 f16 blocks (60 positions) and 24 int8 ones.
    let block_bytes: usize = m.kv_block_bytes(4, &cfg(9).kv_scheme).expect("bytes").iter().sum();
    let tight = EngineConfig { kv_cache_memory: Some(48 * block_bytes), ..cfg(9) };
    let limits = core(&m, tight.clone()).limits().clone();
    assert_eq!((limits.kv.full_precision_tokens, limits.kv_capacity_tokens), (60, 96));
    let preemptions = batched_equals_alone(&m, cfg(9), tight, 1, "preempted");
    assert!(preemptions > 0, "the tight pool forced no preemption");
}

#[test]
fn hybrid_mixed_starts_and_precisions_batched_warm_and_preempted_equal_alone() {
    for &(name, _) in HYBRIDS {
        let m = load_fixture(name).0;
        batched_equals_alone(&m, cfg(9), cfg(9), 2, &format!("{name} batched"));
        // The bytes of 48 blocks of every group (a state slot per block, as the engine counts
        // a token's KV): f16 twins for 60 positions beside quantized pools for 96, as above.
        let per_token = core(&m, cfg(9)).limits().kv_bytes_per_token;
        let tight = EngineConfig { kv_cache_memory: Some(48 * 4 * per_token), ..cfg(9) };
        let limits = core(&m, tight.clone()).limits().clone();
        assert_eq!((limits.kv.full_precision_tokens, limits.kv_capacity_tokens), (60, 96), "{name}");
        let preemptions = batched_equals_alone(&m, cfg(9), tight, 1, &format!("{name} preempted"));
        assert!(preemptions > 0, "{name}: the tight pool forced no preemption");
    }
}

#[test]
fn forked_children_give_the_single_choice_tokens() {
    let m = load_fixture("llama").0;
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    for (len, start) in [(10, 9), (10, 4), (9, 8), (12, 12)] {
        let p = prompt(&mut rng, len, m.config().vocab_size);
        let one = alone(&m, cfg(start), p.clone(), greedy(12)).remove(0);
        let forked = alone(&m, cfg(start), p, RequestParams { n: 3, ..greedy(12) });
        assert!(forked.iter().all(|c| *c == one), "prompt {len}, start {start}: {forked:?} vs {one:?}");
    }
}

#[test]
fn sliding_windows_and_kv_shared_layers_turn_too() {
    for fixture in ["gemma3", "gemma4-shared-ple"] {
        let m = load_fixture(fixture).0;
        let vocab = m.config().vocab_size;
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let reqs: Vec<_> = (0..6)
            .map(|i| {
                let start = [None, Some(0), Some(5), Some(14), Some(30), Some(9)][i];
                let len = rng.random_range(3..30);
                (prompt(&mut rng, len, vocab), kv(greedy(20), None, start))
            })
            .collect();
        let solo: Vec<_> = reqs.iter().map(|(p, pr)| alone(&m, cfg(9), p.clone(), pr.clone())).collect();
        let mut c = core(&m, cfg(9));
        for round in 0..2 {
            let mut rxs: Vec<_> = (reqs.iter().enumerate())
                .map(|(i, (p, pr))| add(&mut c, (round * 10 + i) as u64, p.clone(), pr.clone()))
                .collect();
            run_to_end(&mut c);
            for (i, rx) in rxs.iter_mut().enumerate() {
                assert_eq!(collect(rx, 1), solo[i], "{fixture}: request {i}, round {round}");
            }
            no_leak(&c);
        }
        assert!(transitions(&c) > 0, "{fixture}: no row turned");
    }
}

#[test]
fn a_prefix_is_served_only_at_the_precision_and_start_that_made_it() {
    for name in llama_and_hybrids() {
        let m = load_fixture(name).0;
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let p = prompt(&mut rng, 33, m.config().vocab_size);
        let mut c = core(&m, cfg(6));
        let mut id = 0;
        // The positions served from the cache; the tokens are a cold run's.
        let mut cached = |dtype, start| {
            id += 1;
            let params = kv(greedy(8), dtype, start);
            let rx = add(&mut c, id, p.clone(), params.clone());
            let (tokens, usage) = finish(&mut c, rx);
            let cold = alone(&m, EngineConfig { prefix_cache: false, ..cfg(6) }, p.clone(), params);
            assert_eq!(tokens, cold[0], "{name}: request {id}");
            no_leak(&c);
            usage.cached_tokens
        };
        let (full, int8) = (Some(KvPrecision::Full), Some(KvPrecision::Int8));
        // Turned at 6: the quantized chain of start 6, and one f16 block (positions 0..4) —
        // with a hybrid's snapshot after it, and the state after the others in the chain of 6.
        assert_eq!(cached(None, None), 0, "{name}");
        assert_eq!(cached(None, None), 32, "{name}");
        // Another start: only the f16 blocks before 6; then its own chain.
        assert_eq!(cached(None, Some(10)), 4, "{name}");
        assert_eq!(cached(None, Some(10)), 32, "{name}");
        // Full precision: the f16 blocks before 10; then all of them, which a start past the
        // prompt is served from (its own chain has no state snapshot before 36 to end a hit).
        assert_eq!(cached(full, None), 8, "{name}");
        assert_eq!(cached(None, Some(36)), 32, "{name}");
        assert_eq!(cached(None, Some(36)), 32, "{name}");
        // Int8 from the start: its own chain.
        assert_eq!(cached(int8, Some(0)), 0, "{name}");
        assert_eq!(cached(int8, Some(0)), 32, "{name}");
    }
}

#[test]
fn the_ssd_tier_serves_a_prefix_only_to_the_start_that_made_it() {
    for name in llama_and_hybrids() {
        ssd_serves_only_its_start(name);
    }
}

/// A prefix of fixture `name` published to the SSD tier comes back after a restart to its
/// start only.
fn ssd_serves_only_its_start(name: &str) {
    let m = load_fixture(name).0;
    let dir = std::env::temp_dir().join(format!("ferrite-qkvstart-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let on_disk = EngineConfig { disk_cache: Some(DiskConfig::new(dir.clone(), 1 << 30)), ..cfg(6) };
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    let p = prompt(&mut rng, 33, m.config().vocab_size);
    let run = |params: RequestParams| {
        let mut c = core(&m, on_disk.clone());
        let mut rx = add(&mut c, 1, p.clone(), params);
        run_to_end(&mut c);
        let ssd = c.metrics().ssd_hit_tokens.load(Relaxed);
        no_leak(&c);
        drop(c);
        (collect(&mut rx, 1).remove(0), ssd)
    };
    let cold = alone(&m, cfg(6), p.clone(), greedy(8)).remove(0);
    let (first, hit) = run(greedy(8));
    assert_eq!((first, hit), (cold, 0), "{name}");
    // A restarted engine restores the prefix for the same start ...
    let (again, hit) = run(greedy(8));
    assert_eq!(again, alone(&m, cfg(6), p.clone(), greedy(8)).remove(0), "{name}");
    assert!(hit > 0, "{name}: no SSD hit for the same start");
    // ... and not for another start, or for full precision.
    let other = kv(greedy(8), None, Some(10));
    let (tokens, hit) = run(other.clone());
    assert_eq!((tokens, hit), (alone(&m, cfg(6), p.clone(), other).remove(0), 0), "{name}");
    let full = kv(greedy(8), Some(KvPrecision::Full), None);
    let (tokens, hit) = run(full.clone());
    assert_eq!((tokens, hit), (alone(&m, cfg(6), p.clone(), full).remove(0), 0), "{name}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn host_ram_restores_an_evicted_prefix_only_to_the_start_that_made_it() {
    for name in llama_and_hybrids() {
        host_ram_serves_only_its_start(name);
    }
}

/// A prefix of fixture `name` evicted into host RAM comes back to its start only.
fn host_ram_serves_only_its_start(name: &str) {
    let m = load_fixture(name).0;
    let vocab = m.config().vocab_size;
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    let first = prompt(&mut rng, 100, vocab);
    let second = [&first[..96], &prompt(&mut rng, 10, vocab)[..]].concat();
    let block_bytes: usize = m.kv_block_bytes(4, &cfg(6).kv_scheme).expect("bytes").iter().sum();
    // Llama's pools: 18 f16 blocks and 31 int8 ones; host RAM for 64 int8 blocks (a hybrid's
    // bytes of a block count a state slot: the same numbers of them).
    let tiered = EngineConfig {
        max_model_len: Some(128),
        kv_cache_memory: Some(60 * block_bytes),
        host_cache_memory: Some(64 * block_bytes),
        ..cfg(6)
    };
    let mut c = core(&m, tiered);
    let metrics = c.metrics();
    let mut run = |id: u64, p: &[u32], params: RequestParams| {
        let mut rx = add(&mut c, id, p.to_vec(), params);
        run_to_end(&mut c);
        no_leak(&c);
        drain(&mut rx)
    };
    run(1, &first, greedy(12));
    // Another long prompt takes the pool: the first one's int8 blocks go to host RAM.
    run(2, &prompt(&mut rng, 100, vocab), greedy(12));
    let saved = metrics.host_blocks.load(Relaxed);
    assert!(saved >= 16, "{name}: {saved} blocks saved");
    let (tokens, usage) = run(3, &second, greedy(12));
    assert_eq!(tokens, alone(&m, cfg(6), second.clone(), greedy(12)).remove(0), "{name}");
    assert!(usage.tiers.host_tokens >= 64, "{name}: {:?}", usage.tiers);
    let other = kv(greedy(12), None, Some(10));
    let (tokens, usage) = run(4, &second, other.clone());
    assert_eq!(tokens, alone(&m, cfg(6), second.clone(), other).remove(0), "{name}");
    assert_eq!(usage.tiers.host_tokens, 0, "{name}: another start restores nothing");
}

#[test]
fn hybrid_chunked_prefill_equals_whole_prefill() {
    for &(name, _) in HYBRIDS {
        let (m, reference) = load_fixture(name);
        let p = ids(&reference["prompts"][2]);
        assert_eq!(p.len(), 40);
        // Turning inside the prompt, and during decode (between the prompt and its end).
        for start in [6, 50] {
            let whole = EngineConfig { max_num_batched_tokens: 4096, ..cfg(start) };
            let want = alone(&m, whole, p.clone(), greedy(20));
            for chunk in [1, 3, 7, 16, 39] {
                let mut c = core(&m, EngineConfig { max_num_batched_tokens: chunk, ..cfg(start) });
                let rx = add(&mut c, 1, p.clone(), greedy(20));
                let (got, _) = finish(&mut c, rx);
                assert_eq!(got, want[0], "{name}: start {start}, chunks of {chunk}");
                assert_eq!(transitions(&c), 1, "{name}: start {start}, chunks of {chunk}");
                no_leak(&c);
            }
        }
    }
}

/// The tokens and log-probabilities (the chosen token's and two alternatives') of `p`
/// continued for 24 tokens as `params` asks on a fresh core of `engine`, and the transitions
/// it made.
fn scored(m: &Arc<dyn CausalLm>, engine: EngineConfig, p: &[u32], params: RequestParams) -> (Vec<TokenLogprob>, u64) {
    let mut c = core(m, engine);
    let mut rx = add(&mut c, 1, p.to_vec(), RequestParams { logprobs: Some(2), ..params });
    run_to_end(&mut c);
    no_leak(&c);
    let mut out = Vec::new();
    while let Ok(o) = rx.try_recv() {
        out.extend(o.logprobs);
    }
    assert_eq!(out.len(), 24);
    (out, transitions(&c))
}

#[test]
fn a_start_past_the_end_gives_the_tokens_of_a_full_precision_cache() {
    for name in llama_and_hybrids() {
        let (m, reference) = load_fixture(name);
        for p in reference["prompts"].as_array().expect("prompts").iter().map(ids) {
            let (want, _) = scored(&m, f16_cfg(), &p, greedy(24));
            let end = p.len() + 24;
            for (what, engine, params) in [
                ("the engine's start past the end", cfg(end + 1), greedy(24)),
                ("a request's start past the end", cfg(1), kv(greedy(24), None, Some(end + 5))),
                ("a full-precision request", cfg(1), kv(greedy(24), Some(KvPrecision::Full), None)),
            ] {
                let got = scored(&m, engine, &p, params);
                assert_eq!(got, (want.clone(), 0), "{name}, prompt of {}: {what}", p.len());
            }
            // The comparison can fail: int8 KV from the start moves the first log-probability.
            let (int8, _) = scored(&m, cfg(0), &p, greedy(24));
            assert_ne!(int8[0].logprob, want[0].logprob, "{name}, prompt of {}: int8 KV moved nothing", p.len());
        }
    }
}

#[test]
fn what_the_pools_cannot_serve_is_refused() {
    for name in llama_and_hybrids() {
        let m = load_fixture(name).0;
        let f16 = EngineConfig { quantized_kv_start: 8, kv_scheme: KvScheme::default(), ..cfg(0) };
        let err = EngineCore::new(m.clone(), None, vec![], &f16).err().expect("refused").to_string();
        assert!(err.contains("--quantized-kv-start needs a quantized KV cache"), "{name}: {err}");
        // 48 blocks' bytes (a hybrid's counting a state slot per block): 60 f16 positions.
        let per_token = core(&m, cfg(8)).limits().kv_bytes_per_token;
        let mut c = core(&m, EngineConfig { kv_cache_memory: Some(48 * 4 * per_token), ..cfg(8) });
        let refused = |c: &mut EngineCore, params: RequestParams, want: &str| {
            let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
            let req = ferrite_engine::Request { prompt: vec![1, 2, 3], params };
            let err = c.add_request(9, req, tx).expect_err("refused").to_string();
            assert!(err.contains(want), "{name}: {err}");
        };
        refused(&mut c, kv(greedy(4), Some(KvPrecision::Int4), None), "'int4' is not served");
        refused(&mut c, kv(greedy(70), Some(KvPrecision::Full), None), "needs 73 KV positions but the cache holds 60");
        refused(&mut c, kv(greedy(70), None, Some(65)), "needs 65 KV positions but the cache holds 60");
        let mut bare = core(&m, cfg(0));
        refused(&mut bare, kv(greedy(4), None, Some(2)), "needs full-precision pools");
        refused(
            &mut bare,
            kv(greedy(4), Some(KvPrecision::Full), None),
            "full-precision KV needs full-precision pools",
        );
    }
}
