//! Engine invariants on the hybrid linear-attention fixtures (`scripts/goldens/
//! make_hybrid_models.py`), whose DeltaNet layers keep a recurrent state per sequence, on
//! either executor (`hybrid_invariants` runs them on the CPU, `cuda_hybrid` on the GPU):
//! chunked prefill equals whole prefill, a prefix hit (served from a state snapshot) equals a
//! cold run, speculative decoding and fill (verify rows rolled back to the accepted length
//! from their per-token states) equal plain decoding at temperature 0, batched equals alone,
//! preempted equals uninterrupted, no state slot or block leaks, and a prefix served from the
//! host-RAM tier or, after a restart, the SSD tier (its state snapshot restored with it)
//! equals a cold run, ending at the last snapshot there. "Equals" is exact on the CPU; on a
//! GPU, whose GEMMs sum in an order that depends on the batch's shape, two runs may part only
//! where the pick was a near tie (`assert_agree`), as every GPU engine test holds.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use ferrite_engine::kv::disk::DiskConfig;
use ferrite_engine::{EngineConfig, EngineCore, FillMode, Request, RequestParams, Speculation};
use ferrite_models::model::CausalLm;
use ferrite_runtime::cuda::DeviceChoice;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc::unbounded_channel;

use super::model::{divergence, draw_margin, pick_margin_limit};
use super::*;

/// Each fixture, and a token whose repetition makes it repeat that token forever (so prompt
/// lookups propose tokens it accepts; found by probing its greedy outputs).
pub const HYBRIDS: &[(&str, u32)] = &[("qwen3.5", 7), ("qwen3-next", 160)];

/// Fixture `name` on `device`, and its prompts.
fn fixture(name: &str, device: DeviceChoice) -> (Arc<dyn CausalLm>, Vec<Vec<u32>>) {
    let dir = fixture_dir(name);
    let m = ferrite_models::load_on(&dir, device).unwrap_or_else(|e| panic!("load {name}: {e}")).model;
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    let reference: serde_json::Value = serde_json::from_str(&text).expect("json");
    let prompts = reference["prompts"].as_array().expect("prompts").iter().map(ids).collect();
    (m, prompts)
}

/// Blocks of 4 and a state snapshot at every block (the default stride would keep one only
/// every ~20 blocks of these tiny models, whose state is large beside their one attention layer).
fn cfg() -> EngineConfig {
    EngineConfig { block_size: 4, state_snapshot_interval: Some(4), ..EngineConfig::default() }
}

/// The fixtures `device` checks: on a GPU not qwen3-next, whose every prompt routes some token
/// near a tie and whose recurrent state keeps a flipped route for good, so two GPU schedules of
/// it part at clear picks too (`cuda_goldens`' `RECURRENT_ROUTE_TIES` measures it).
fn hybrids(device: DeviceChoice) -> impl Iterator<Item = &'static (&'static str, u32)> {
    HYBRIDS.iter().filter(move |(name, _)| !(matches!(device, DeviceChoice::Cuda(_)) && *name == "qwen3-next"))
}

/// A request sampled at `temperature` from `seed` — greedy on a GPU: a sampled pick also
/// flips there when two near-equal candidates swap places or the nucleus gains or loses one
/// under bf16 noise, far from any boundary of its draw (the device sampler's batch invariance
/// is `cuda_model`'s).
fn sampled(device: DeviceChoice, max_tokens: usize, seed: u64, temperature: f32) -> RequestParams {
    match device {
        DeviceChoice::Cuda(_) => greedy(max_tokens),
        _ => seeded(max_tokens, seed, temperature),
    }
}

/// Check that `got` (per choice) agrees with `want` for the request of `prompt` and `params`
/// run on another schedule: exactly on the CPU; on a GPU, whose GEMMs sum in an order that
/// depends on the batch's shape, a choice may part from the other only where its pick was a
/// near tie under `m`'s logits (`draw_margin` under `pick_margin_limit`).
fn assert_agree(
    device: DeviceChoice,
    m: &dyn CausalLm,
    prompt: &[u32],
    params: &RequestParams,
    got: &[Vec<u32>],
    want: &[Vec<u32>],
    what: &str,
) {
    if !matches!(device, DeviceChoice::Cuda(_)) {
        assert_eq!(got, want, "{what}");
        return;
    }
    assert_eq!(got.len(), want.len(), "{what}: choices");
    for (c, (g, w)) in got.iter().zip(want).enumerate() {
        let Some(j) = divergence(g, w) else { continue };
        let seed = ferrite_engine::core::choice_seed(params.sampling.seed, c);
        let margin = draw_margin(m, (prompt, params), seed, w, j);
        println!("TABLE|hybrid {what}, choice {c}: parted at token {j}|pick margin {margin:.4}|||");
        let limit = pick_margin_limit(params);
        assert!(
            margin < limit,
            "{what}, choice {c}: parts at token {j}, a clear pick (margin {margin}, limit {limit})"
        );
    }
}

fn random_prompt(rng: &mut impl Rng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(1..vocab as u32)).collect()
}

fn assert_no_leak(core: &EngineCore, what: &str) {
    let (free, total) = core.kv_manager().free_blocks();
    assert_eq!(free, total, "{what}: blocks or state slots leaked");
    core.kv_manager().check_invariants().expect("invariants");
}

pub fn chunked_prefill_equals_whole_prefill(device: DeviceChoice) {
    for &(name, _) in hybrids(device) {
        let (m, prompts) = fixture(name, device);
        let prompt = prompts[2].clone();
        let whole = alone(&m, EngineConfig { max_num_batched_tokens: 4096, ..cfg() }, prompt.clone(), greedy(20));
        for chunk in [1, 3, 7, 16, 39] {
            for block in [1, 4, 16] {
                for interval in [None, Some(block)] {
                    let c = EngineConfig {
                        max_num_batched_tokens: chunk,
                        block_size: block,
                        state_snapshot_interval: interval,
                        ..EngineConfig::default()
                    };
                    let got = alone(&m, c, prompt.clone(), greedy(20));
                    let what = format!("{name}: chunk {chunk} block {block} snapshots {interval:?}");
                    assert_agree(device, &*m, &prompt, &greedy(20), &got, &whole, &what);
                }
            }
        }
    }
}

/// A prompt sharing 33 of the 40 tokens of one run before: served from the snapshot at the
/// longest cached boundary, every 4 positions (32 cached) or every 12 (24), equal to cold.
pub fn prefix_hit_equals_cold_run(device: DeviceChoice) {
    for &(name, _) in hybrids(device) {
        let (m, prompts) = fixture(name, device);
        let base = prompts[2].clone();
        let mut other = base[..33].to_vec();
        other.extend([5, 6, 7]);
        let cold = alone(&m, EngineConfig { prefix_cache: false, ..cfg() }, other.clone(), greedy(12));
        for (interval, want_cached) in [(4, 32), (12, 24)] {
            let mut c = core(&m, EngineConfig { state_snapshot_interval: Some(interval), ..cfg() });
            let mut rx = add(&mut c, 1, base.clone(), greedy(5));
            run_to_end(&mut c);
            collect(&mut rx, 1);
            let rx = add(&mut c, 2, other.clone(), greedy(12));
            let (toks, usage) = finish(&mut c, rx);
            assert_eq!(usage.cached_tokens, want_cached, "{name}: snapshots every {interval}");
            let what = format!("{name}: snapshots every {interval}");
            assert_agree(device, &*m, &other, &greedy(12), &[toks], &cold, &what);
            assert_no_leak(&c, name);
        }
    }
}

pub fn batched_equals_alone(device: DeviceChoice) {
    for &(name, _) in hybrids(device) {
        let (m, _) = fixture(name, device);
        let vocab = m.config().vocab_size;
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let reqs: Vec<(Vec<u32>, RequestParams)> = (0..12)
            .map(|i| {
                let len = rng.random_range(1..60);
                let prompt = random_prompt(&mut rng, len, vocab);
                let n = rng.random_range(1..24);
                (prompt, if i % 2 == 0 { greedy(n) } else { sampled(device, n, i, 0.8) })
            })
            .collect();
        let c = EngineConfig { max_num_batched_tokens: 37, ..cfg() };
        let mut core = core(&m, c.clone());
        let mut rxs: Vec<_> =
            reqs.iter().enumerate().map(|(i, (p, pr))| add(&mut core, i as u64, p.clone(), pr.clone())).collect();
        run_to_end(&mut core);
        for (i, (p, pr)) in reqs.iter().enumerate() {
            let got = collect(&mut rxs[i], 1);
            let want = alone(&m, c.clone(), p.clone(), pr.clone());
            assert_agree(device, &*m, p, pr, &got, &want, &format!("{name}: request {i}"));
        }
        assert_no_leak(&core, name);
    }
}

/// The fixture's prompts, prompts that repeat themselves (so lookups propose), a run of the
/// token the model then repeats (lookups right: whole spans accepted) and that run broken by
/// another token (lookups partly right), and a choice of n = 2.
fn spec_requests(prompts: &[Vec<u32>], attractor: u32) -> Vec<(Vec<u32>, RequestParams)> {
    let mut reqs: Vec<_> = prompts.iter().map(|p| (p.clone(), greedy(24))).collect();
    reqs.push(([10, 11, 12, 13, 14, 15].repeat(4), greedy(24)));
    reqs.push(((0..30).map(|i| 40 + (i * 7) % 23).collect(), greedy(24)));
    let run = vec![attractor; 30];
    reqs.push((run.clone(), greedy(24)));
    let (a, b) = (attractor, attractor + 2);
    reqs.push(([run, vec![b, a, a, a, b, a, a]].concat(), greedy(24)));
    reqs.push((prompts[2].clone(), RequestParams { n: 2, ..greedy(12) }));
    reqs
}

pub fn speculation_and_fill_equal_plain_decoding_at_temperature_0(device: DeviceChoice) {
    for &(name, attractor) in hybrids(device) {
        let (m, prompts) = fixture(name, device);
        let reqs = spec_requests(&prompts, attractor);
        let plain: Vec<_> = reqs.iter().map(|(p, pr)| alone(&m, cfg(), p.clone(), pr.clone())).collect();
        let echo: Vec<_> = reqs
            .iter()
            .map(|(p, pr)| (p.clone(), RequestParams { fill: Some(FillMode::Echo), ..pr.clone() }))
            .collect();
        let spec = |speculation, k| EngineConfig { speculation, num_draft_tokens: k, ..cfg() };
        // The model cut to its first three layers (linear, linear, full): a draft with its own
        // recurrent state that often disagrees, on the CPU as the CLI runs drafts.
        let weak = first_layers(name, 3);
        let methods = [
            ("ngram k=3", spec(Speculation::Ngram, 3), &reqs),
            ("ngram k=1", spec(Speculation::Ngram, 1), &reqs),
            ("echo", cfg(), &echo),
            ("self draft", spec(Speculation::Draft(m.clone()), 4), &reqs),
            ("weak draft", spec(Speculation::Draft(weak.clone()), 3), &reqs),
            ("weak draft + echo", spec(Speculation::Draft(weak), 2), &echo),
        ];
        for (method, c, reqs) in methods {
            for (i, (p, pr)) in reqs.iter().enumerate() {
                let got = alone(&m, c.clone(), p.clone(), pr.clone());
                assert_agree(device, &*m, p, pr, &got, &plain[i], &format!("{name} {method}: request {i} alone"));
            }
            let mut core = core(&m, c.clone());
            for round in 0..2 {
                let mut rxs: Vec<_> = (reqs.iter().enumerate())
                    .map(|(i, (p, pr))| add(&mut core, (round * 100 + i) as u64, p.clone(), pr.clone()))
                    .collect();
                run_to_end(&mut core);
                for (i, rx) in rxs.iter_mut().enumerate() {
                    let (got, what) =
                        (collect(rx, reqs[i].1.n), format!("{name} {method}: request {i}, round {round}"));
                    assert_agree(device, &*m, &reqs[i].0, &reqs[i].1, &got, &plain[i], &what);
                }
            }
            assert_no_leak(&core, name);
            assert!(core.metrics().prefix_hit_rate() > 0.0, "{name} {method}: no prefix hit");
            let metrics = core.metrics();
            let (proposed, accepted) =
                (metrics.verify_proposed_tokens.load(Relaxed), metrics.verify_accepted_tokens.load(Relaxed));
            if method != "echo" {
                assert!(accepted > 0, "{name} {method}: {accepted} of {proposed} proposed tokens accepted");
            }
            // Lookups here are right or absent (the random model copies only its attractor run);
            // the weak draft is often wrong, so its rejected tails are rolled back.
            match method {
                "self draft" => {
                    assert_eq!(accepted, proposed, "{name}: its own draft is always right at temperature 0")
                }
                m if m.starts_with("weak") => {
                    assert!(accepted < proposed, "{name} {method}: no rejection, so no rollback was tested")
                }
                _ => {}
            }
        }
    }
}

pub fn preemption_equals_uninterrupted(device: DeviceChoice) {
    for &(name, _) in hybrids(device) {
        let (m, _) = fixture(name, device);
        let vocab = m.config().vocab_size;
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let reqs: Vec<_> =
            (0..6).map(|i| (random_prompt(&mut rng, 20 + i, vocab), sampled(device, 30, i as u64, 1.0))).collect();
        // 24 blocks of 4 positions for six requests of up to 60.
        let layout = m.kv_layout();
        let bytes = layout.block_bytes(4);
        let stride = cfg().snapshot_stride(&layout, &bytes);
        let g = layout.recurrent_group().expect("recurrent");
        let per_block: usize = bytes.iter().enumerate().map(|(i, &b)| if i == g { b / stride } else { b }).sum();
        let c = EngineConfig { kv_cache_memory: Some(24 * per_block), ..cfg() };
        let mut core = core(&m, c);
        let mut rxs: Vec<_> =
            reqs.iter().enumerate().map(|(i, (p, pr))| add(&mut core, i as u64, p.clone(), pr.clone())).collect();
        while core.has_work() {
            core.step().expect("step");
            core.check_kv_invariants().expect("invariants");
        }
        assert!(core.metrics().preemptions.load(Relaxed) > 0, "{name}: the tiny pool forced no preemption");
        for (i, (p, pr)) in reqs.iter().enumerate() {
            let (got, want) = (collect(&mut rxs[i], 1), alone(&m, cfg(), p.clone(), pr.clone()));
            assert_agree(device, &*m, p, pr, &got, &want, &format!("{name}: request {i}"));
        }
        assert_no_leak(&core, name);
    }
}

pub fn n_choices_are_reproducible(device: DeviceChoice) {
    for &(name, _) in hybrids(device) {
        let (m, prompts) = fixture(name, device);
        let params = RequestParams { n: 3, ..seeded(12, 1234, 1.0) };
        let a = alone(&m, cfg(), prompts[2].clone(), params.clone());
        assert_eq!(a, alone(&m, cfg(), prompts[2].clone(), params.clone()));
        assert!(a.iter().any(|c| c != &a[0]), "{name}: three seeded choices were all identical");
        let one = RequestParams { n: 1, ..params };
        let got = alone(&m, cfg(), prompts[2].clone(), one.clone());
        assert_agree(device, &*m, &prompts[2], &one, &got, &a[..1], &format!("{name}: n = 1 against choice 0"));
    }
}

pub fn random_arrivals_and_aborts_leak_nothing(device: DeviceChoice) {
    for &(name, _) in hybrids(device) {
        let (m, _) = fixture(name, device);
        let vocab = m.config().vocab_size;
        let c = EngineConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 48,
            max_model_len: Some(128),
            speculation: Speculation::Ngram,
            num_draft_tokens: 3,
            ..cfg()
        };
        let mut core = core(&m, c);
        let mut rng = rand::rngs::StdRng::seed_from_u64(99);
        let (mut live, mut added) = (Vec::new(), 0u64);
        while added < 300 || core.has_work() {
            for _ in 0..rng.random_range(0..3) {
                if added >= 300 {
                    break;
                }
                let len = rng.random_range(1..40);
                let prompt = random_prompt(&mut rng, len, vocab);
                let params = RequestParams { n: rng.random_range(1..3), ..seeded(rng.random_range(1..20), added, 0.0) };
                let (tx, rx) = unbounded_channel();
                core.add_request(added, Request { prompt, params }, tx).expect("valid");
                live.push((added, rx, rng.random_bool(0.2)));
                added += 1;
            }
            core.step().expect("step");
            core.check_kv_invariants().expect("invariants");
            live.retain_mut(|(id, rx, abort)| {
                let mut open = true;
                while let Ok(o) = rx.try_recv() {
                    open &= o.finished.is_none();
                }
                if open && *abort && rng.random_bool(0.3) {
                    core.abort(*id);
                    return false;
                }
                open
            });
        }
        assert_no_leak(&core, name);
    }
}

/// A 100-token prompt, and a second one sharing its first 96 tokens; the second's cold tokens.
fn shared_prompts(m: &Arc<dyn CausalLm>, seed: u64) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let vocab = m.config().vocab_size;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let first = random_prompt(&mut rng, 100, vocab);
    let second = [&first[..96], &random_prompt(&mut rng, 10, vocab)[..]].concat();
    let cold = alone(m, EngineConfig { prefix_cache: false, ..cfg() }, second.clone(), greedy(8)).remove(0);
    (first, second, cold)
}

/// Snapshots every 4 positions (every block: the 24 shared blocks are all served) or every
/// 20 (blocks 4, 9, …: the hit ends after block 19, 80 positions).
const SNAPSHOTS: [(usize, usize); 2] = [(4, 96), (20, 80)];

/// The host tier's configuration: a pool of 40 blocks (one row at a time, so the state pool
/// is small too), `interval` positions between snapshots. Prefill chunks of 36 positions end
/// in blocks 8 and 17, whose snapshots (a chunk's last entry holds one) leave the expected hits.
fn tiered(m: &Arc<dyn CausalLm>, interval: usize) -> EngineConfig {
    let c =
        EngineConfig { state_snapshot_interval: Some(interval), max_num_seqs: 1, max_num_batched_tokens: 36, ..cfg() };
    let per_block = core(m, c.clone()).limits().kv_bytes_per_token * 4;
    EngineConfig { max_model_len: Some(160), kv_cache_memory: Some(40 * per_block), ..c }
}

/// A prefix the pool evicted, blocks and snapshots, comes back from host RAM with the snapshot
/// of the hit's end: the cold run's tokens, the expected positions cached (the last
/// snapshot's), all of them from host RAM, and nothing leaked.
pub fn host_ram_restores_the_state_snapshot(device: DeviceChoice) {
    for &(name, _) in hybrids(device) {
        let (m, _) = fixture(name, device);
        let (first, second, cold) = shared_prompts(&m, 11);
        for (interval, want) in SNAPSHOTS {
            let base = tiered(&m, interval);
            let host = base.kv_cache_memory.map(|b| 4 * b);
            let mut c = core(&m, EngineConfig { host_cache_memory: host, ..base });
            let rx = add(&mut c, 1, first.clone(), greedy(8));
            finish(&mut c, rx);
            // Two more long prompts take the pool and the state slots: the first one's blocks
            // and snapshots all go to host RAM.
            let mut rng = rand::rngs::StdRng::seed_from_u64(12);
            for id in [2, 3] {
                let rx = add(&mut c, id, random_prompt(&mut rng, 100, m.config().vocab_size), greedy(8));
                finish(&mut c, rx);
            }
            let rx = add(&mut c, 4, second.clone(), greedy(8));
            let (tokens, usage) = finish(&mut c, rx);
            let what = format!("{name}: snapshots every {interval}");
            assert_agree(device, &*m, &second, &greedy(8), &[tokens], std::slice::from_ref(&cold), &what);
            assert_eq!(
                (usage.cached_tokens, usage.tiers.host_tokens),
                (want, want),
                "{name}: snapshots every {interval}"
            );
            c.check_kv_invariants().expect("invariants");
            assert_no_leak(&c, name);
        }
    }
}

/// An engine over `dir` with snapshots every `interval` positions.
fn on_disk(m: &Arc<dyn CausalLm>, dir: &std::path::Path, interval: usize) -> EngineCore {
    let disk = Some(DiskConfig::new(dir.to_path_buf(), 64 << 20));
    core(m, EngineConfig { state_snapshot_interval: Some(interval), disk_cache: disk, ..cfg() })
}

/// Run `prompt` on an engine over `dir` and drop it: its blocks and snapshots published there.
fn publish(m: &Arc<dyn CausalLm>, dir: &std::path::Path, interval: usize, prompt: &[u32]) {
    let mut c = on_disk(m, dir, interval);
    let rx = add(&mut c, 1, prompt.to_vec(), greedy(8));
    finish(&mut c, rx);
}

/// A prefix published by one engine comes back from the SSD to a new one (a restart) with
/// its state snapshot: the cold run's tokens, the expected positions cached, nothing leaked.
pub fn the_ssd_restores_the_state_snapshot_after_a_restart(device: DeviceChoice) {
    for &(name, _) in hybrids(device) {
        let (m, _) = fixture(name, device);
        let (first, second, cold) = shared_prompts(&m, 13);
        for (interval, want) in SNAPSHOTS {
            let dir = tempfile::tempdir().expect("tempdir");
            publish(&m, dir.path(), interval, &first);
            let mut c = on_disk(&m, dir.path(), interval);
            let rx = add(&mut c, 1, second.clone(), greedy(8));
            let (tokens, usage) = finish(&mut c, rx);
            let what = format!("{name}: snapshots every {interval}");
            assert_agree(device, &*m, &second, &greedy(8), &[tokens], std::slice::from_ref(&cold), &what);
            assert_eq!(
                (usage.cached_tokens, usage.tiers.ssd_tokens),
                (want, want),
                "{name}: snapshots every {interval}"
            );
            assert_no_leak(&c, name);
        }
    }
}

/// A snapshot that fails its checksum on the SSD: the run ends before its block, the hit at
/// the snapshot before (one block less), with the cold run's tokens and nothing leaked.
pub fn a_corrupt_snapshot_on_the_ssd_falls_back_to_the_one_before(device: DeviceChoice) {
    for &(name, _) in hybrids(device) {
        let (m, _) = fixture(name, device);
        let (first, second, cold) = shared_prompts(&m, 14);
        let dir = tempfile::tempdir().expect("tempdir");
        publish(&m, dir.path(), 4, &first);
        // The prompt's 25 blocks are one run, each carrying its snapshot after its other
        // groups' bytes: flip the last byte of block 23's snapshot.
        let whole: usize = m.kv_layout().block_bytes(4).iter().sum();
        let runs: Vec<_> = std::fs::read_dir(dir.path())
            .expect("dir")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "kvrun"))
            .collect();
        let run = runs.iter().max_by_key(|p| std::fs::metadata(p).map_or(0, |m| m.len())).expect("a run file");
        let mut bytes = std::fs::read(run).expect("read");
        let at = bytes.len() - whole - 1;
        bytes[at] ^= 0x40;
        std::fs::write(run, &bytes).expect("write");
        let mut c = on_disk(&m, dir.path(), 4);
        let metrics = c.metrics();
        let rx = add(&mut c, 1, second.clone(), greedy(8));
        let (tokens, usage) = finish(&mut c, rx);
        assert_agree(device, &*m, &second, &greedy(8), &[tokens], &[cold], name);
        assert_eq!((usage.cached_tokens, usage.tiers.ssd_tokens), (92, 92), "{name}");
        assert_eq!(metrics.ssd_corrupt_files.load(Relaxed), 1, "{name}");
        assert_no_leak(&c, name);
    }
}
