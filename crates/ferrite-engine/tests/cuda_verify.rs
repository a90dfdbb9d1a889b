//! Speculative verify steps inside CUDA graphs, gated by `FERRITE_TEST_CUDA=1` (skipped
//! elsewhere).
//!
//! - model steps of verify rows (every row 2, 5 or 17 query tokens, logits at each): graph
//!   replay gives eager's bits where the row count is a bucket size (a dense family, gemma3's
//!   two KV groups and sliding window, the qwen3_moe experts routed inside the graph), the
//!   device's argmax at every position is the host's argmax of the same logits, and the
//!   repeated shapes replay (`GpuModel::graph_replays`);
//! - prompt lookup (`--spec ngram`; a self draft for the hybrid qwen3_5, whose random weights
//!   never repeat their context) at temperature 0 through the engine, one request at a time:
//!   with graphs == without (one row: the same bits) == plain greedy decoding (up to a near
//!   tie of the CPU's logits: verify and decode steps round differently), and nearly every
//!   step, verify steps included, replays a graph (also the hybrid's, whose padding rows touch
//!   no state slot);
//! - the same requests batched give each the tokens it gets alone, with graphs on and off (up
//!   to near ties: the batch shape moves the GEMMs' rounding; the mixture of experts measured,
//!   see `MOE`);
//! - SmolLM2-135M Q4_1 (real weights, when present): prompt lookup equals plain greedy decoding
//!   up to near ties, and the acceptance is printed.
//!
//! Every comparison prints a `TABLE|…` row for `scripts/gpu_tests.sh`.

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use common::model::{cuda_enabled, divergence, equal_or_tie, smollm2_gguf, BLOCK};
use common::{add, collect, fixture_dir, greedy, ids, run_to_end};
use ferrite_engine::{EngineConfig, EngineCore, Speculation};
use ferrite_models::gpu::GpuDecoder;
use ferrite_models::model::{CausalLm, Pending, StepLimits, Want};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::cuda::DeviceChoice;
use ferrite_runtime::{cpu, ForwardBatch};
use serde_json::Value;

/// Fixtures run through the engine: a dense family, two KV groups with a sliding window, a
/// mixture of experts and a hybrid with recurrent state.
const FIXTURES: [&str; 4] = ["qwen3-hd32", "gemma3", "qwen3-moe", "qwen3.5"];
/// The hybrid among `FIXTURES`.
const HYBRIDS: [&str; 1] = ["qwen3.5"];
/// The mixture of experts among `FIXTURES`: the batch's shape moves its bf16 activations, which
/// may route a near-tie token to another expert, a flip that moves later logits past any margin
/// of the parting token (`cuda_goldens`' `ROUTE_SENSITIVE`): its batched runs are measured.
const MOE: [&str; 1] = ["qwen3-moe"];
/// Fixtures stepped directly (a hybrid's rows need the state slots the engine hands out).
const DIRECT: [&str; 3] = ["qwen3-hd32", "gemma3", "qwen3-moe"];
/// Draft tokens a prompt-lookup proposal has at most.
const K: usize = 4;
/// Tokens generated per request.
const GEN: usize = 40;

fn gpu_decoder(name: &str) -> GpuDecoder {
    ferrite_models::load::gpu_decoder(&fixture_dir(name), 0).expect("CUDA model")
}

fn cpu_model(name: &str) -> Arc<dyn CausalLm> {
    ferrite_models::load_on(&fixture_dir(name), DeviceChoice::Cpu).expect("cpu load").model
}

/// The fixture's prompts, plus two that repeat themselves (so lookups find spans).
fn prompts(name: &str) -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(fixture_dir(name).join("reference.json")).expect("reference.json");
    let reference: Value = serde_json::from_str(&text).expect("json");
    let mut prompts: Vec<Vec<u32>> = reference["prompts"].as_array().expect("prompts").iter().map(ids).collect();
    prompts.push([10, 11, 12, 13, 14, 15].repeat(4));
    prompts.push((0..30).map(|i| 40 + (i * 7) % 23).collect());
    prompts
}

/// Logits of `steps` verify steps (every row `q` query tokens, logits at each) of rows
/// continuing the prefilled `prompts`, and the argmax ids of each step run once more (it
/// stores the same keys again).
fn verify_steps(model: &dyn CausalLm, prompts: &[Vec<u32>], steps: usize, q: usize) -> (Vec<f32>, Vec<u32>) {
    let vocab = model.config().vocab_size as u32;
    let groups = model.kv_layout().groups.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let per_row = (longest + steps * q).div_ceil(BLOCK);
    // Room for the logits rows of 4 padded rows of 17 tokens.
    let limits = StepLimits { max_tokens: 1024, max_rows: 128, max_model_len: 1024, block_size: BLOCK };
    model.prepare(&limits).expect("prepare");
    let blocks = vec![per_row * prompts.len(); groups];
    let mut kv = model.new_kv_cache(&blocks, BLOCK, &Default::default()).expect("kv cache");
    let table = |r: usize| vec![((r * per_row) as u32..((r + 1) * per_row) as u32).collect::<Vec<_>>(); groups];
    let mut batch = ForwardBatch::default();
    for (r, p) in prompts.iter().enumerate() {
        batch.push_row(p, p.len(), table(r), RowLogits::Last);
    }
    model.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("prefill");
    let (mut logits, mut picks) = (Vec::new(), Vec::new());
    for s in 0..steps {
        let mut batch = ForwardBatch::default();
        for (r, p) in prompts.iter().enumerate() {
            let query: Vec<u32> = (0..q).map(|j| (p[(s * q + j) % p.len()] + s as u32) % vocab).collect();
            batch.push_row(&query, p.len() + (s + 1) * q, table(r), RowLogits::All);
        }
        logits.extend(model.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("verify"));
        picks.extend(model.step(&batch, &mut kv, Want::Argmax).and_then(Pending::ids).expect("verify ids"));
    }
    (logits, picks)
}

#[test]
fn cuda_verify_steps_replay_graphs_with_eager_bits() {
    if !cuda_enabled("cuda_verify_steps_replay_graphs_with_eager_bits") {
        return;
    }
    for name in DIRECT {
        let decoder = gpu_decoder(name);
        let vocab = decoder.config().vocab_size;
        let base = prompts(name);
        for rows in [1usize, 2, 4, 3] {
            let rows_prompts: Vec<Vec<u32>> = base.iter().cycle().take(rows).cloned().collect();
            for q in [2usize, 5, 17] {
                decoder.set_cuda_graphs(true);
                let before = decoder.graph_replays();
                let (graphed, graphed_ids) = verify_steps(&decoder, &rows_prompts, 4, q);
                let replays = decoder.graph_replays() - before;
                decoder.set_cuda_graphs(false);
                let (eager, eager_ids) = verify_steps(&decoder, &rows_prompts, 4, q);
                let same = graphed.iter().zip(&eager).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
                let what = format!("{name} {rows} rows of {q}");
                println!("TABLE|verify graph vs eager {what}|{same}/{} bit-equal|{replays} replays||", graphed.len());
                // Each step's shape is captured by its first run and replayed by the next ones.
                assert!(replays >= 4, "{what}: {replays} graph replays in 8 verify steps of one shape");
                // Padding rows change the GEMMs' row count only when 3 rows run as 4.
                if rows != 3 {
                    assert_eq!(same, graphed.len(), "{what}: graph replay differs from eager");
                    assert_eq!(graphed_ids, eager_ids, "{what}: argmax ids differ");
                }
                for (logits, picks, how) in [(&graphed, &graphed_ids, "graphed"), (&eager, &eager_ids, "eager")] {
                    let host: Vec<u32> = logits.chunks_exact(vocab).map(|r| cpu::argmax(r) as u32).collect();
                    assert_eq!(picks, &host, "{what} {how}: the device's argmax is not the host's");
                }
            }
        }
    }
}

/// What a run of requests gave: each one's tokens, the engine's steps, the proposed and
/// accepted tokens.
struct Run {
    tokens: Vec<Vec<u32>>,
    steps: u64,
    proposed: u64,
    accepted: u64,
}

/// `prompts` run together on one fresh core over `model`, `GEN` greedy tokens each.
fn generate(model: &Arc<dyn CausalLm>, cfg: &EngineConfig, prompts: &[Vec<u32>]) -> Run {
    let mut core = EngineCore::new(model.clone(), None, vec![], cfg).expect("engine core");
    let mut rxs: Vec<_> =
        prompts.iter().enumerate().map(|(i, p)| add(&mut core, i as u64 + 1, p.clone(), greedy(GEN))).collect();
    run_to_end(&mut core);
    let tokens = rxs.iter_mut().map(|rx| collect(rx, 1).remove(0)).collect();
    let m = core.metrics();
    let (steps, proposed, accepted) =
        (m.steps.load(Relaxed), m.verify_proposed_tokens.load(Relaxed), m.verify_accepted_tokens.load(Relaxed));
    let (free, total) = core.kv_manager().free_blocks();
    assert_eq!(free, total, "KV blocks leaked");
    Run { tokens, steps, proposed, accepted }
}

fn plain_cfg() -> EngineConfig {
    EngineConfig { block_size: BLOCK, ..EngineConfig::default() }
}

fn lookup_cfg() -> EngineConfig {
    EngineConfig { speculation: Speculation::Ngram, num_draft_tokens: K, ..plain_cfg() }
}

/// Prompt lookup, except for the hybrid: qwen3.5's random weights never continue a span of
/// their context (prompt lookup proposes nothing there, on the CPU too), so it drafts with
/// itself, which gives its verify steps the same shapes.
fn spec_cfg(name: &str, model: &Arc<dyn CausalLm>) -> EngineConfig {
    if HYBRIDS.contains(&name) {
        EngineConfig { speculation: Speculation::Draft(model.clone()), ..lookup_cfg() }
    } else {
        lookup_cfg()
    }
}

#[test]
fn cuda_prompt_lookup_in_graphs_equals_plain_greedy() {
    if !cuda_enabled("cuda_prompt_lookup_in_graphs_equals_plain_greedy") {
        return;
    }
    for name in FIXTURES {
        let cpu = cpu_model(name);
        let decoder = Arc::new(gpu_decoder(name));
        let gpu: Arc<dyn CausalLm> = decoder.clone();
        let (mut proposed, mut accepted, mut same) = (0, 0, 0);
        let all = prompts(name);
        let spec = spec_cfg(name, &gpu);
        for (i, prompt) in all.iter().enumerate() {
            let one = std::slice::from_ref(prompt);
            decoder.set_cuda_graphs(true);
            let plain = generate(&gpu, &plain_cfg(), one);
            let before = decoder.graph_replays();
            let graphed = generate(&gpu, &spec, one);
            let replays = decoder.graph_replays() - before;
            decoder.set_cuda_graphs(false);
            let eager = generate(&gpu, &spec, one);
            let what = format!("{name} prompt {i} prompt lookup");
            assert_eq!(graphed.tokens, eager.tokens, "{what}: graphs on and off differ (one row: the same bits)");
            // Every step after the prefill is uniform (one row); each shape (1 + 0..=K query
            // tokens, one context bucket) is captured once by a step that runs eagerly.
            let uniform = graphed.steps - 1;
            println!(
                "TABLE|{what}|{replays} replays of {uniform} steps|{}/{} accepted||",
                graphed.accepted, graphed.proposed
            );
            assert!(
                replays + (K as u64 + 1) >= uniform,
                "{what}: {replays} graph replays in {uniform} decode and verify steps"
            );
            proposed += graphed.proposed;
            accepted += graphed.accepted;
            same += usize::from(equal_or_tie(cpu.as_ref(), prompt, &plain.tokens[0], &graphed.tokens[0], &what));
        }
        println!(
            "TABLE|{name} prompt lookup == plain greedy|{same}/{} equal|{accepted}/{proposed} accepted||",
            all.len()
        );
        assert!(proposed > 0, "{name}: nothing proposed");
    }
}

#[test]
fn cuda_prompt_lookup_batched_equals_alone() {
    if !cuda_enabled("cuda_prompt_lookup_batched_equals_alone") {
        return;
    }
    for name in FIXTURES {
        let cpu = cpu_model(name);
        let decoder = Arc::new(gpu_decoder(name));
        let gpu: Arc<dyn CausalLm> = decoder.clone();
        let all = prompts(name);
        decoder.set_cuda_graphs(true);
        let cfg = spec_cfg(name, &gpu);
        let alone: Vec<Vec<u32>> =
            all.iter().map(|p| generate(&gpu, &cfg, std::slice::from_ref(p)).tokens.remove(0)).collect();
        let before = decoder.graph_replays();
        let batched = generate(&gpu, &cfg, &all);
        let replays = decoder.graph_replays() - before;
        decoder.set_cuda_graphs(false);
        let eager = generate(&gpu, &cfg, &all);
        println!(
            "TABLE|{name} prompt lookup, {} requests batched|{replays} replays of {} steps|{}/{} accepted||",
            all.len(),
            batched.steps,
            batched.accepted,
            batched.proposed
        );
        assert!(replays > 0, "{name}: no step of the batched run replayed a graph");
        // Where two runs part, `equal_or_tie` asserts a near tie of the CPU's logits.
        let (mut like_alone, mut like_eager) = (0, 0);
        for (i, p) in all.iter().enumerate() {
            let pairs = [
                ("batched (graphs) vs alone", &alone[i], &mut like_alone),
                ("batched, graphs vs eager", &eager.tokens[i], &mut like_eager),
            ];
            for (how, other, count) in pairs {
                let what = format!("{name} prompt {i} {how}");
                if MOE.contains(&name) {
                    let parted = divergence(other, &batched.tokens[i]).map_or("none".into(), |j| format!("token {j}"));
                    println!("TABLE|{what} (measured): parted at {parted}||||");
                    *count += usize::from(other == &batched.tokens[i]);
                } else {
                    *count += usize::from(equal_or_tie(cpu.as_ref(), p, other, &batched.tokens[i], &what));
                }
            }
        }
        println!("TABLE|{name} batched prompt lookup|{like_alone}/{} as alone|{like_eager} as eager||", all.len());
    }
}

#[test]
fn cuda_prompt_lookup_smollm2() {
    if !cuda_enabled("cuda_prompt_lookup_smollm2") {
        return;
    }
    let Some(path) = smollm2_gguf("cuda_prompt_lookup_smollm2") else { return };
    let loaded = ferrite_models::load_on(&path, DeviceChoice::Cpu).expect("cpu load");
    let tokenizer = loaded.tokenizer.clone().expect("tokenizer");
    let cpu = loaded.model;
    let gpu = ferrite_models::load_on(&path, DeviceChoice::Cuda(0)).expect("cuda load").model;
    let texts = [
        "<|im_start|>user\nRename the variable `count` to `total` in this code:\n\ndef add(items):\n    count = 0\n    \
         for item in items:\n        count += item\n    return count\n<|im_end|>\n<|im_start|>assistant\n",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "The capital of France is",
    ];
    let cfg = |spec: bool| EngineConfig {
        max_model_len: Some(1024),
        kv_cache_memory: Some(64 << 20),
        ..if spec { lookup_cfg() } else { plain_cfg() }
    };
    for (i, text) in texts.iter().enumerate() {
        let prompt = tokenizer.encode(text, false).expect("encode");
        let one = std::slice::from_ref(&prompt);
        let t0 = Instant::now();
        let plain = generate(&gpu, &cfg(false), one);
        let t1 = Instant::now();
        let spec = generate(&gpu, &cfg(true), one);
        let t2 = Instant::now();
        let what = format!("SmolLM2 prompt {i} prompt lookup");
        println!(
            "TABLE|{what}|{}/{} accepted|{} vs {} steps|{:.1} vs {:.1} ms",
            spec.accepted,
            spec.proposed,
            spec.steps,
            plain.steps,
            (t2 - t1).as_secs_f64() * 1e3,
            (t1 - t0).as_secs_f64() * 1e3
        );
        // Where they part, `equal_or_tie` asserts a near tie of the CPU's logits.
        equal_or_tie(cpu.as_ref(), &prompt, &plain.tokens[0], &spec.tokens[0], &what);
    }
}
