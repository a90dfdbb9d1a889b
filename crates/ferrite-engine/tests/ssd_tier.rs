//! The prefix cache's SSD tier and resumable generations, on the tiny llama fixture (blocks
//! of 4 positions): a prefix restored from disk by a new engine gives the cold run's tokens,
//! greedy and seeded; a flipped byte, a truncated file, another model's file under the
//! directory and a full disk budget each cost a miss (or an eviction) and never the right
//! output; the budget holds under a stream of distinct prefixes; a generation cut off by a
//! client disconnect, a shutdown or a crash is continued by an identical retry with the
//! uninterrupted run's tokens, the recorded ones replayed without recomputation.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use common::*;
use ferrite_engine::kv::disk::DiskConfig;
use ferrite_engine::{EngineConfig, Metrics, Output, RequestParams, Usage};
use ferrite_models::model::CausalLm;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc::UnboundedReceiver;

fn model() -> Arc<dyn CausalLm> {
    load_fixture("llama").0
}

fn prompt(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(1..vocab as u32)).collect()
}

fn cold() -> EngineConfig {
    EngineConfig { block_size: 4, prefix_cache: false, ..EngineConfig::default() }
}

fn on_disk(dir: &Path, budget: u64) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        disk_cache: Some(DiskConfig::new(dir.to_path_buf(), budget)),
        ..EngineConfig::default()
    }
}

/// Everything streamed so far: tokens, and the usage once finished.
fn drain(rx: &mut UnboundedReceiver<Output>, tokens: &mut Vec<u32>) -> Option<Usage> {
    let mut usage = None;
    while let Ok(o) = rx.try_recv() {
        tokens.extend(&o.token_ids);
        if let Some(f) = o.finished {
            usage = Some(f.usage);
        }
    }
    usage
}

/// One request on a fresh core over `cfg`, to its end; the core is dropped (its writer
/// finishes) before this returns.
fn run_one(
    m: &Arc<dyn CausalLm>,
    cfg: &EngineConfig,
    p: &[u32],
    params: &RequestParams,
) -> (Vec<u32>, Usage, Arc<Metrics>) {
    let mut c = core(m, cfg.clone());
    let mut rx = add(&mut c, 1, p.to_vec(), params.clone());
    run_to_end(&mut c);
    let metrics = c.metrics();
    drop(c);
    let mut tokens = Vec::new();
    let usage = drain(&mut rx, &mut tokens).expect("finished");
    (tokens, usage, metrics)
}

fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    out.sort_by_key(|p| std::cmp::Reverse(std::fs::metadata(p).map_or(0, |m| m.len())));
    out
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir).expect("dir").map(|e| e.expect("entry").metadata().expect("meta").len()).sum()
}

fn load(a: &std::sync::atomic::AtomicU64) -> u64 {
    a.load(Relaxed)
}

#[test]
fn a_prefix_restored_from_disk_by_a_new_engine_gives_the_cold_tokens() {
    let m = model();
    let vocab = m.config().vocab_size;
    let first = prompt(1, 100, vocab);
    let second = [&first[..96], &prompt(2, 10, vocab)[..]].concat();
    for params in [greedy(12), seeded(12, 7, 0.8)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = on_disk(dir.path(), 64 << 20);
        let cold_tokens = alone(&m, cold(), second.clone(), params.clone()).remove(0);
        let (_, usage, metrics) = run_one(&m, &cfg, &first, &params);
        assert_eq!(usage.tiers.ssd_tokens, 0);
        assert!(load(&metrics.ssd_written_bytes) > 0, "the first engine wrote its blocks");
        // A new engine (a restart) over the same directory: 24 shared blocks from disk.
        let (tokens, usage, metrics) = run_one(&m, &cfg, &second, &params);
        assert_eq!(tokens, cold_tokens, "restored prefix differs from cold ({params:?})");
        assert_eq!((usage.cached_tokens, usage.tiers.ssd_tokens), (96, 96));
        assert_eq!(load(&metrics.ssd_hit_tokens), 96);
        assert_eq!(load(&metrics.ssd_corrupt_files), 0);
    }
}

#[test]
fn corrupt_truncated_and_foreign_files_are_misses_with_the_right_output() {
    let m = model();
    let vocab = m.config().vocab_size;
    let p = prompt(3, 100, vocab);
    let params = greedy(8);
    let cold_tokens = alone(&m, cold(), p.clone(), params.clone()).remove(0);
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = on_disk(dir.path(), 64 << 20);
    run_one(&m, &cfg, &p, &params);

    // A flipped payload byte: found when the block is read; the file is deleted.
    let run = files(dir.path(), "kvrun").remove(0);
    let mut bytes = std::fs::read(&run).expect("read");
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&run, &bytes).expect("write");
    let (tokens, usage, metrics) = run_one(&m, &cfg, &p, &params);
    assert_eq!(tokens, cold_tokens);
    assert_eq!(load(&metrics.ssd_corrupt_files), 1);
    assert!(usage.tiers.ssd_tokens < 96, "the corrupt block and those after it were recomputed");
    assert!(!run.exists() || std::fs::read(&run).expect("read") != bytes, "the corrupt file was deleted");

    // A truncated file: found by the start-up scan (its length disagrees with its header).
    let run = files(dir.path(), "kvrun").remove(0);
    let len = std::fs::metadata(&run).expect("meta").len();
    std::fs::OpenOptions::new().write(true).open(&run).expect("open").set_len(len - 100).expect("truncate");
    let (tokens, _, metrics) = run_one(&m, &cfg, &p, &params);
    assert_eq!(tokens, cold_tokens);
    assert_eq!(load(&metrics.ssd_corrupt_files), 1);

    // Another model's files (another namespace) under the same directory: never hits, kept.
    let theirs: Vec<PathBuf> = files(dir.path(), "kvrun");
    assert!(!theirs.is_empty());
    let other = EngineConfig { namespace: 99, ..cfg.clone() };
    let (tokens, usage, _) = run_one(&m, &other, &p, &params);
    assert_eq!((tokens, usage.tiers.ssd_tokens), (cold_tokens.clone(), 0));
    let ours: Vec<PathBuf> = files(dir.path(), "kvrun").into_iter().filter(|f| !theirs.contains(f)).collect();
    assert!(!ours.is_empty() && theirs.iter().all(|f| f.exists()), "both models' files share the directory");
    let (tokens, usage, _) = run_one(&m, &other, &p, &params);
    assert_eq!((tokens, usage.tiers.ssd_tokens), (cold_tokens.clone(), 96));
    // ... and the first model's file copied over each of the other's names: misses, and the
    // right output.
    for f in &ours {
        std::fs::copy(&theirs[0], f).expect("copy");
    }
    let (tokens, usage, _) = run_one(&m, &other, &p, &params);
    assert_eq!((tokens, usage.tiers.ssd_tokens), (cold_tokens, 0));
}

#[test]
fn the_byte_budget_holds_under_a_stream_of_distinct_prefixes() {
    let m = model();
    let vocab = m.config().vocab_size;
    let dir = tempfile::tempdir().expect("tempdir");
    // One prompt's run is ~27 KB: the budget holds about three.
    let budget = 80_000;
    let cfg = on_disk(dir.path(), budget);
    let mut c = core(&m, cfg.clone());
    let metrics = c.metrics();
    for i in 0..12 {
        let p = prompt(100 + i, 100, vocab);
        let cold_tokens = alone(&m, cold(), p.clone(), greedy(4)).remove(0);
        let mut rx = add(&mut c, i, p, greedy(4));
        run_to_end(&mut c);
        let mut tokens = Vec::new();
        drain(&mut rx, &mut tokens).expect("finished");
        assert_eq!(tokens, cold_tokens);
        assert!(load(&metrics.ssd_bytes) <= budget, "request {i}: {} bytes indexed", load(&metrics.ssd_bytes));
    }
    drop(c);
    assert!(dir_bytes(dir.path()) <= budget, "{} bytes on disk", dir_bytes(dir.path()));
    assert!(load(&metrics.ssd_evicted_files) > 0);
    // A budget too small for any run: nothing is written, every request still answers.
    let tiny = tempfile::tempdir().expect("tempdir");
    let p = prompt(5, 100, vocab);
    let (tokens, _, metrics) = run_one(&m, &on_disk(tiny.path(), 2_000), &p, &greedy(4));
    assert_eq!(tokens, alone(&m, cold(), p, greedy(4)).remove(0));
    assert!(dir_bytes(tiny.path()) <= 2_000);
    assert!(load(&metrics.ssd_writes_dropped) > 0);
}

/// Step `c` until `rx` has streamed at least `k` tokens; returns them.
fn stream_until(c: &mut ferrite_engine::EngineCore, rx: &mut UnboundedReceiver<Output>, k: usize) -> Vec<u32> {
    let mut tokens = Vec::new();
    while tokens.len() < k {
        c.step().expect("step");
        assert!(drain(rx, &mut tokens).is_none(), "finished before {k} tokens");
    }
    tokens
}

#[test]
fn a_retry_after_a_client_disconnect_continues_with_the_uninterrupted_tokens() {
    let m = model();
    let vocab = m.config().vocab_size;
    let p = prompt(4, 60, vocab);
    for params in [greedy(30), seeded(30, 11, 0.9)] {
        let whole = alone(&m, cold(), p.clone(), params.clone()).remove(0);
        let cfg = EngineConfig { block_size: 4, generation_checkpoint: Some(4), ..EngineConfig::default() };
        let mut c = core(&m, cfg);
        let mut rx = add(&mut c, 1, p.clone(), params.clone());
        let seen = stream_until(&mut c, &mut rx, 10);
        assert_eq!(seen, whole[..seen.len()]);
        drop(rx);
        run_to_end(&mut c);
        let metrics = c.metrics();
        let batched = load(&metrics.batched_tokens);
        let mut rx = add(&mut c, 2, p.clone(), params.clone());
        // The recorded tokens arrive at once, before any step.
        let mut tokens = Vec::new();
        drain(&mut rx, &mut tokens);
        let k = tokens.len();
        assert!(k >= seen.len(), "{k} tokens replayed of {} seen", seen.len());
        run_to_end(&mut c);
        let usage = drain(&mut rx, &mut tokens).expect("finished");
        assert_eq!(tokens, whole, "resumed run differs ({params:?})");
        assert_eq!(usage.tiers.resumed_tokens, k);
        assert_eq!(load(&metrics.resumed_tokens), k as u64);
        // Only the last partial block and the new tokens were computed, not the prompt and
        // the replayed tokens.
        let computed = load(&metrics.batched_tokens) - batched;
        assert!(computed <= (30 - k) as u64 + 4, "{computed} tokens computed for {} new", 30 - k);
    }
}

#[test]
fn a_retry_after_a_shutdown_or_a_crash_continues_from_the_disk() {
    let m = model();
    let vocab = m.config().vocab_size;
    let p = prompt(6, 60, vocab);
    let params = seeded(30, 5, 0.7);
    let whole = alone(&m, cold(), p.clone(), params.clone()).remove(0);
    for shutdown in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = EngineConfig { generation_checkpoint: Some(4), ..on_disk(dir.path(), 64 << 20) };
        let mut c = core(&m, cfg.clone());
        let mut rx = add(&mut c, 1, p.clone(), params.clone());
        let seen = stream_until(&mut c, &mut rx, 10);
        if shutdown {
            // A drain timeout aborts what is in flight, then the engine stops.
            c.abort(1);
        }
        // A crash leaves only the last checkpoint (the engine is gone without an abort).
        drop(c);
        let mut c = core(&m, cfg);
        let metrics = c.metrics();
        let mut rx = add(&mut c, 1, p.clone(), params.clone());
        let mut tokens = Vec::new();
        drain(&mut rx, &mut tokens);
        let k = tokens.len();
        if shutdown {
            assert!(k >= seen.len(), "{k} replayed of {}", seen.len());
        } else {
            assert!(k >= 8 && k % 4 == 0, "{k} replayed: the last checkpoint");
        }
        run_to_end(&mut c);
        let usage = drain(&mut rx, &mut tokens).expect("finished");
        assert_eq!(tokens, whole, "resumed after {} differs", if shutdown { "a shutdown" } else { "a crash" });
        assert_eq!(usage.tiers.resumed_tokens, k);
        assert!(usage.tiers.ssd_tokens >= 56, "the prompt came from the disk");
        let computed = load(&metrics.batched_tokens);
        assert!(computed <= (30 - k) as u64 + 4, "{computed} tokens computed for {} new", 30 - k);
        // The finished generation's record is gone: the same request again starts afresh.
        drop(c);
        assert!(files(dir.path(), "kvgen").is_empty());
    }
}
