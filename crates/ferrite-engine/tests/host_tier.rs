//! The prefix cache's host-RAM tier on a CPU pool (the CLI takes `--host-cache-memory` for
//! GPU models only, but the tier and the copy interface are the same over plain host memory),
//! on the tiny llama fixture with blocks of 4 positions and a pool of a few dozen blocks:
//! blocks the pool evicts are kept in host memory, a later request with the same prefix gets
//! them back through the ordinary prefix hit with the cold run's tokens (greedy and seeded),
//! the tier's budget holds, and host RAM is looked up before the SSD tier.

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use common::*;
use ferrite_engine::kv::disk::DiskConfig;
use ferrite_engine::{EngineConfig, EngineCore, RequestParams, Usage};
use ferrite_models::model::CausalLm;
use rand::{Rng, SeedableRng};

fn prompt(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(1..vocab as u32)).collect()
}

fn cold() -> EngineConfig {
    EngineConfig { block_size: 4, prefix_cache: false, ..EngineConfig::default() }
}

/// A pool of `blocks` blocks of 4 positions, and host RAM for `host_blocks` more.
fn tiered(m: &Arc<dyn CausalLm>, blocks: usize, host_blocks: usize) -> EngineConfig {
    let probe = core(m, EngineConfig { block_size: 4, ..EngineConfig::default() });
    let block_bytes = probe.limits().kv_bytes_per_token * 4;
    EngineConfig {
        block_size: 4,
        max_model_len: Some(blocks * 4),
        kv_cache_memory: Some(blocks * block_bytes),
        host_cache_memory: Some(host_blocks * block_bytes),
        ..EngineConfig::default()
    }
}

fn run(c: &mut EngineCore, id: u64, p: &[u32], params: &RequestParams) -> (Vec<u32>, Usage) {
    let rx = add(c, id, p.to_vec(), params.clone());
    finish(c, rx)
}

#[test]
fn a_prefix_the_pool_evicted_comes_back_from_host_ram_with_the_cold_tokens() {
    let (m, _) = load_fixture("llama");
    let vocab = m.config().vocab_size;
    let first = prompt(1, 100, vocab);
    let second = [&first[..96], &prompt(2, 10, vocab)[..]].concat();
    for params in [greedy(12), seeded(12, 7, 0.8)] {
        let cold_tokens = alone(&m, cold(), second.clone(), params.clone()).remove(0);
        let mut c = core(&m, tiered(&m, 40, 64));
        let metrics = c.metrics();
        run(&mut c, 1, &first, &params);
        // Another long prompt takes the pool: the first one's blocks are evicted to host RAM.
        let (_, usage) = run(&mut c, 2, &prompt(3, 100, vocab), &params);
        assert_eq!(usage.tiers.host_tokens, 0);
        assert!(metrics.host_blocks.load(Relaxed) >= 16, "{} blocks saved", metrics.host_blocks.load(Relaxed));
        let (tokens, usage) = run(&mut c, 3, &second, &params);
        assert_eq!(tokens, cold_tokens, "restored prefix differs from cold ({params:?})");
        assert_eq!(usage.cached_tokens, 96, "pool and host RAM together hold the whole prefix");
        assert!(usage.tiers.host_tokens >= 64, "{:?}", usage.tiers);
        assert_eq!(metrics.host_hit_tokens.load(Relaxed), usage.tiers.host_tokens as u64);
        assert_eq!(usage.tiers.ssd_tokens, 0);
        c.check_kv_invariants().expect("invariants");
    }
}

#[test]
fn the_host_budget_holds_and_every_request_still_gets_the_cold_tokens() {
    let (m, _) = load_fixture("llama");
    let vocab = m.config().vocab_size;
    // Room for 20 blocks: under a stream of distinct 100-token prompts the oldest go.
    let cfg = tiered(&m, 40, 20);
    let mut c = core(&m, cfg);
    let metrics = c.metrics();
    let capacity = metrics.host_capacity_bytes.load(Relaxed);
    for i in 0..8 {
        let p = prompt(100 + i, 100, vocab);
        let (tokens, _) = run(&mut c, i, &p, &greedy(4));
        assert_eq!(tokens, alone(&m, cold(), p, greedy(4)).remove(0), "request {i}");
        assert!(metrics.host_bytes.load(Relaxed) <= capacity);
        assert!(metrics.host_blocks.load(Relaxed) <= 20);
    }
    assert!(metrics.host_evicted_blocks.load(Relaxed) > 0);
    // The most recent evictions are still there: the latest prompt but one comes back.
    let p = prompt(106, 100, vocab);
    let (tokens, usage) = run(&mut c, 9, &p, &greedy(4));
    assert_eq!(tokens, alone(&m, cold(), p, greedy(4)).remove(0));
    assert!(usage.tiers.host_tokens > 0, "{:?}", usage.tiers);
}

#[test]
fn host_ram_is_looked_up_before_the_ssd_and_a_restart_falls_back_to_the_ssd() {
    let (m, _) = load_fixture("llama");
    let vocab = m.config().vocab_size;
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg =
        EngineConfig { disk_cache: Some(DiskConfig::new(dir.path().to_path_buf(), 64 << 20)), ..tiered(&m, 40, 64) };
    let first = prompt(4, 100, vocab);
    let second = [&first[..96], &prompt(5, 10, vocab)[..]].concat();
    let cold_tokens = alone(&m, cold(), second.clone(), greedy(8)).remove(0);
    let mut c = core(&m, cfg.clone());
    run(&mut c, 1, &first, &greedy(8));
    run(&mut c, 2, &prompt(6, 100, vocab), &greedy(8));
    let (tokens, usage) = run(&mut c, 3, &second, &greedy(8));
    assert_eq!(tokens, cold_tokens);
    // The SSD holds every block too; host RAM answers first.
    assert_eq!(usage.cached_tokens, 96);
    assert!(usage.tiers.host_tokens >= 48 && usage.tiers.ssd_tokens == 0, "{:?}", usage.tiers);
    drop(c);
    // After a restart host RAM is empty: the SSD serves the prefix.
    let mut c = core(&m, cfg);
    let (tokens, usage) = run(&mut c, 1, &second, &greedy(8));
    assert_eq!(tokens, cold_tokens);
    // (The second request published its own blocks too: all 26 full blocks come back.)
    assert_eq!((usage.tiers.host_tokens, usage.tiers.ssd_tokens), (0, 104));
}
