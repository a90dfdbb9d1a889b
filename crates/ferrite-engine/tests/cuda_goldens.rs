//! The CUDA executor against the CPU executor on the tiny transformers goldens of every family
//! with a CUDA path (qwen3's per-head q/k norms at a head_dim the kernels take, glm4's sandwich
//! norms and adjacent-pair partial RoPE, smollm3's NoPE layers, phi3's fused projections and
//! long RoPE (original context 32: short and long factors by each row's length, and rows that
//! cross it while decoding), olmo2's post-norms and whole-projection q/k norms, granite's
//! embedding/residual/attention/logit multipliers, starcoder2's LayerNorm, biases and plain
//! GELU MLP with a sliding window of 8, llama's dynamic NTK RoPE (frequencies by each row's
//! length, as long RoPE's), gemma, gemma2, gemma3_text and the three gemma4_text
//! fixtures: KV-shared layers with per-layer inputs, `attention_k_eq_v` with a double-wide
//! MLP, the MoE block; the mixtures of experts qwen3_moe and mixtral, and qwen3_moe in
//! transformers' fine-grained FP8 (`fp8-qwen3-moe-block`: FP8 expert rows); the hybrids qwen3_5 and
//! qwen3_next: gated DeltaNet layers with their state in the device KV cache, gated attention
//! outputs, Qwen3-Next's experts with a shared expert — measured, not asserted:
//! `RECURRENT_ROUTE_TIES`), the MLX
//! affine-quantized fixtures (4- and 8-bit groups read by the quantized kernels, bf16/f16/f32
//! scales, per-module overrides, a quantized tied embedding as the head), the six roster
//! families, the two MoE families and the two hybrids also from their GGUF (llama.cpp's tensor names and
//! layouts; stacked experts in f32 and Q8_0), gated by `FERRITE_TEST_CUDA=1` (skipped
//! elsewhere). The Gemma fixtures' sliding window is 8 tokens, so every prompt here but the
//! shortest is longer than the window. (`cuda_model` covers the llama fixtures.)
//!
//! - prompt logits from one prefill (the fixtures' prompts and a 150-token one; the hybrids'
//!   prompts of 17, 40 and 150 tokens run the chunked DeltaNet scan, the 5-token one the
//!   sequential kernel, `DELTA_CHUNK_MIN_TOKENS`): relative L2
//!   error within bf16 tolerance (3 %), top-5 log-probabilities within 0.75, each side's top
//!   token in the other's top 5 (vLLM's `check_logprobs_close`), the argmax equal wherever
//!   the CPU's top-2 margin is clear (for the MoE fixtures only where every token's routing is
//!   clear of a tie, `ROUTE_SENSITIVE`; the rest is measured); the MoE fixtures' GPU logits
//!   also against transformers' own;
//! - greedy continuations (32 tokens, decode by CUDA-graph replay) equal to the CPU's, a
//!   divergence allowed only at a near tie of the CPU logits (as in `cuda_model`);
//! - decode by graph replay == eager decode, bit for bit (gemma3: two KV groups; phi3: rows
//!   on short and long RoPE factors in one step, one crossing over while the graph replays;
//!   the MoE fixtures, routed on the device inside the graph);
//! - step handles: decode steps queued back to back, their ids carried on the device and
//!   their handles resolved newest first, equal resolving each step at once, bit for bit;
//! - engine invariants on the GPU (gemma4 with KV-shared layers and per-layer inputs, the
//!   MoE fixtures and the hybrids): batched == alone, and prefix hit == cold (`cuda_hybrid`
//!   runs the hybrids through the rest of the engine invariants).
//!
//! - the FP8 checkpoints (`make_fp8_models.py`: compressed-tensors' channel and tensor scales,
//!   transformers' 128×128 blocks, qwen2 with biases) and the llama and qwen3-moe fixtures
//!   quantized at load (`--quantization fp8`, the experts too): prompts of more than 8 tokens run cuBLASLt's FP8 GEMM on inputs
//!   quantized per token, measured against transformers with the same input quantization
//!   under a sanity bar (`FP8_W8A8_SANITY`); shorter ones against the CPU on the dequantized
//!   weights (`FP8_REL_L2`, `FP8_LOGPROB_TOL`, each side's top token in the other's top 5;
//!   greedy divergence from the CPU printed);
//! - a model drafting for itself accepts (nearly) all its proposals, with graphs on and off.
//!
//! Every comparison prints a `TABLE|…` row for `scripts/gpu_tests.sh`.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::model::{
    cache, compare_logits, cuda_enabled, divergence, equal_or_tie, measure_logits, prefill_logits, LogitsAgreement,
    BLOCK,
};
use common::{add, collect, greedy, ids, run_to_end};
use ferrite_engine::{EngineConfig, EngineCore};
use ferrite_models::gpu::GpuDecoder;
use ferrite_models::model::{CausalLm, Pending, Want};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::cuda::ops::DELTA_CHUNK_MIN_TOKENS;
use ferrite_runtime::cuda::DeviceChoice;
use ferrite_runtime::ForwardBatch;
use serde_json::Value;

// The hybrids' 17-token prompt and longer take the chunked DeltaNet scan.
const _: () = assert!(DELTA_CHUNK_MIN_TOKENS <= 17, "cuda_goldens' hybrid prompts no longer reach the chunked scan");

const FIXTURES: [&str; 24] = [
    "qwen3-hd32",
    "glm4",
    "smollm3",
    "phi3",
    "olmo2",
    "granite",
    "starcoder2",
    "llama-rope-dynamic",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma4-shared-ple",
    "gemma4-kv-eq-v",
    "gemma4-moe",
    "qwen3-moe",
    "mixtral",
    "fp8-qwen3-moe-block",
    "mlx-llama-q4-g64",
    "mlx-llama-q4-g128",
    "mlx-llama-q8-g32",
    "mlx-llama-mixed",
    "mlx-qwen3-q4-g64",
    "qwen3.5",
    "qwen3-next",
];
/// The fixtures whose directory also holds GGUF files llama.cpp's converter writes, and the
/// file: f32 tensors (the experts stacked per projection, `ffn_*_exps`) or Q8_0 blocks.
const GGUF_FIXTURES: [(&str, &str); 11] = [
    ("phi3", "model.gguf"),
    ("olmo2", "model.gguf"),
    ("glm4", "model.gguf"),
    ("granite", "model.gguf"),
    ("starcoder2", "model.gguf"),
    ("smollm3", "model.gguf"),
    ("qwen3-moe", "model.gguf"),
    ("mixtral", "model.gguf"),
    ("mixtral", "model-q8_0.gguf"),
    ("qwen3.5", "model.gguf"),
    ("qwen3-next", "model.gguf"),
];
/// Fixtures whose every prompt routes some token near a tie (qwen3-next: router margins 1.9e-3,
/// 1.2e-4, 4.7e-4, 7.5e-5 at 5 / 17 / 40 / 150 tokens, `moe_route_margins.py`) and whose
/// recurrent state keeps the flip of such a route for good: every comparison of theirs is
/// measured and printed, not asserted. On an H100 its GPU prefill sat 5.8 % from transformers'
/// f32 at 5 tokens (transformers' own bf16: 3.2 %, 11.4 % at 40, `hybrid_bf16_spread.py`), and
/// its greedy runs parted from the f32 ones where transformers' bf16 runs part (tokens 7 and
/// 18, top-2 margins 0.268 / 0.226 against bf16's 0.266 / 0.224): bf16, not a defect. At 150
/// tokens even the top-5 check parts: on an H100 one of 150 GPU rows had a top token outside
/// the CPU's top 5 (log-probability error 6.6), where transformers' own bf16 against its f32
/// has two such rows and moves a log-probability by 8.26 (`hybrid_bf16_spread.py`). A
/// self-draft accepts only 38 of 104 of its proposals there: a route flipped between the
/// draft's decode steps and the target's verify steps stays in the draft's state.
const RECURRENT_ROUTE_TIES: [&str; 1] = ["qwen3-next"];
/// The hybrid linear-attention fixtures: the recurrent state carries the bf16 rounding of every
/// earlier token's projections, so their prefill logits move further from the CPU's with the
/// prompt's length (qwen3.5 on an H100: rel L2 2.2 / 2.5 / 3.2 % at 5 / 17 / 40 tokens, every
/// clear argmax equal; transformers' own bf16 against its f32: 3.0 / 2.5 / 3.9 %,
/// `hybrid_bf16_spread.py`): a bar of 5 % where the others take 3 %. The same carried rounding
/// moves single log-probabilities far — transformers' own bf16 at 40 tokens by up to 1.81
/// (0.57 at 5) — so a differing argmax is measured, not asserted: on an H100 one of 36 clear
/// positions at 40 tokens took the runner-up (reference margin 0.512) with the top-5
/// log-probability error at 0.484, under the bar every fixture meets.
const HYBRIDS: [&str; 2] = ["qwen3.5", "qwen3-next"];
/// The mixtures of experts (Qwen3-Next's with a shared expert beside them; fp8-qwen3-moe-block's
/// experts and attention FP8 with 64 × 64 block scales, `make_fp8_moe_models.py`: the experts'
/// kernels over FP8 rows, every input bf16 as for the other fixtures, so held to their bar).
const MOE_FIXTURES: [&str; 5] = ["gemma4-moe", "qwen3-moe", "mixtral", "qwen3-next", "fp8-qwen3-moe-block"];
/// (MoE fixture, prompt length) where some token's k-th and (k+1)-th router probabilities lie
/// within 3e-3 of each other (`scripts/goldens/moe_route_margins.py`: 2.9e-4, 2.4e-3 and
/// 1.9e-4; fp8-qwen3-moe-block 1.5e-4 and 3.1e-5, its 5-token prompt 7.2e-3), as at 150 tokens for every MoE fixture (7.5e-5 .. 4e-6): there bf16 activations may
/// route a token to another expert than the CPU's f32 ones — a legitimate outcome that moves
/// the logits past the bf16 tolerance — so these prompts are measured and printed, and only
/// each side's top token within the other's top 5 is asserted. (qwen3-moe's 17-token prompt,
/// 2.4e-3, parted so on an H100: rel L2 3.8e-2 against both the CPU and transformers, where
/// its 5-token prompt, 1.2e-2, agrees within 1.0e-2. Gemma 4's 40-token prompt, 2.1e-4, has been
/// checked since its experts first ran on the GPU and stays checked.)
const ROUTE_SENSITIVE: [(&str, usize); 5] =
    [("qwen3-moe", 17), ("qwen3-moe", 40), ("mixtral", 17), ("fp8-qwen3-moe-block", 17), ("fp8-qwen3-moe-block", 40)];
/// The largest top-5 log-probability difference allowed. Wider than `cuda_model`'s 0.5: with
/// q/k norms and attention scale 1 (Gemma 4) the 16-wide heads' scores reach ±16, so the bf16
/// rounding of the normed q and k moves low-ranked log-probabilities further (0.52 measured at
/// 40 tokens of gemma4-shared-ple, with every clear argmax equal and rel L2 1.7e-2).
const LOGPROB_TOL: f32 = 0.75;
/// The same for the 150-token prompt, whose ids are arbitrary ((37 i + 11) mod vocab): its
/// attention spreads over many unrelated keys, and bf16 moves the low-ranked log-probabilities
/// further (0.86 measured for mlx-llama-q4-g128 on an H100, rel L2 2.2e-2, every clear argmax
/// equal).
const LONG_LOGPROB_TOL: f32 = 1.0;

/// The FP8 fixtures (`make_fp8_models.py`).
const FP8_FIXTURES: [&str; 4] = ["fp8-llama-channel", "fp8-llama-tensor", "fp8-llama-block", "fp8-qwen2-channel"];
/// The FP8 bar against a reference with the same input quantization: bf16 activations move
/// which e4m3 code an input rounds to now and then, so wider than bf16's 3 %. (Against the
/// unquantized CPU the per-token e4m3 inputs alone move these random 2-layer models' logits by
/// 11–15 % rel L2, top-5 log-probabilities by up to 4.9 — measured on an H100, and 12–15 % /
/// 3.7 by transformers with the same quantization on the CPU.)
const FP8_REL_L2: f64 = 0.06;
const FP8_LOGPROB_TOL: f32 = 1.0;
/// The bar of many-token prefill (cuBLASLt's FP8 GEMM over per-token e4m3 inputs) against
/// transformers with the same input quantization: a sanity bar, not a tolerance. The GPU rounds
/// its bf16 activations to e4m3 where the reference rounds f32 ones, and an input that lands
/// on the other side of a rounding boundary moves a full e4m3 step (6–12 %), so two correct
/// W8A8 runs of these random 2-layer models part far: transformers itself, running this
/// checkpoint's W8A8 (compressed-tensors' dynamic per-token inputs) in bf16 against f32 on the
/// CPU, parts by 10.2 / 12.4 / 15.0 % rel L2 at 5 / 17 / 40 tokens (`scripts/goldens/
/// fp8_w8a8_spread.py`), and the GPU measured 12.1 % at 17 tokens on an H100. The bar catches a
/// wrong scale, layout or code (≥ 100 %); the op itself is held to 2e-3 of the host's
/// emulation with the same codes (`cuda_fp8`).
const FP8_W8A8_SANITY: f64 = 0.5;

/// The fixture directory: under the working directory (the GPU machine runs the tests from a
/// copy of the repository), else under this crate's source tree.
fn fixture_dir(name: &str) -> PathBuf {
    let here = PathBuf::from("tests/fixtures/models").join(name);
    if here.is_dir() {
        return here;
    }
    common::fixture_dir(name)
}

/// The CPU and CUDA models of fixture `name` (from its GGUF file `gguf` when given), and its
/// reference.json.
fn load_pair(name: &str, gguf: Option<&str>) -> (Arc<dyn CausalLm>, Arc<dyn CausalLm>, Value) {
    let dir = fixture_dir(name);
    let path = gguf.map_or(dir.clone(), |file| dir.join(file));
    let cpu = ferrite_models::load_on(&path, DeviceChoice::Cpu).unwrap_or_else(|e| panic!("cpu {name}: {e}")).model;
    let gpu =
        ferrite_models::load_on(&path, DeviceChoice::Cuda(0)).unwrap_or_else(|e| panic!("cuda {name}: {e}")).model;
    (cpu, gpu, reference(name))
}

/// Fixture `name`'s reference.json.
fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture_dir(name).join("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("json")
}

/// The CUDA model of fixture `name` (the concrete type, to switch graphs off).
fn gpu_decoder(name: &str) -> GpuDecoder {
    ferrite_models::load::gpu_decoder(&fixture_dir(name), 0).expect("CUDA model")
}

/// `n` greedy tokens after `prompt`: a prefill, then one decode step per token.
fn greedy_tokens(model: &dyn CausalLm, prompt: &[u32], n: usize) -> Vec<u32> {
    let (mut kv, tables) = cache(model, (prompt.len() + n).div_ceil(BLOCK));
    let mut batch = ForwardBatch::default();
    batch.push_row(prompt, prompt.len(), tables.clone(), RowLogits::Last);
    let mut out = model.step(&batch, &mut kv, Want::Argmax).and_then(Pending::ids).expect("prefill");
    while out.len() < n {
        let mut batch = ForwardBatch::default();
        batch.push_row(&out[out.len() - 1..], prompt.len() + out.len(), tables.clone(), RowLogits::Last);
        out.extend(model.step(&batch, &mut kv, Want::Argmax).and_then(Pending::ids).expect("decode"));
    }
    out
}

#[test]
fn cuda_goldens_goldens_match_cpu() {
    if !cuda_enabled("cuda_goldens_goldens_match_cpu") {
        return;
    }
    let cases = FIXTURES.iter().map(|&n| (n, None)).chain(GGUF_FIXTURES.iter().map(|&(n, f)| (n, Some(f))));
    // Every fixture runs (its panic printed where it happens), so one GPU run reports them all.
    let mut failed = Vec::new();
    for (fixture, gguf) in cases {
        let name = gguf.map_or(fixture.to_string(), |file| format!("{fixture} ({file})"));
        if std::panic::catch_unwind(|| goldens_match_cpu(fixture, gguf, &name)).is_err() {
            failed.push(name);
        }
    }
    assert!(failed.is_empty(), "fixtures that differ from the CPU: {failed:?}");
}

/// `cuda_goldens_goldens_match_cpu` for one fixture (`gguf`: its GGUF file instead of the
/// safetensors), printed as `name`.
fn goldens_match_cpu(fixture: &str, gguf: Option<&str>, name: &str) {
    let (cpu, gpu, reference) = load_pair(fixture, gguf);
    let vocab = cpu.config().vocab_size;
    let mut prompts: Vec<Vec<u32>> = reference["prompts"].as_array().expect("prompts").iter().map(ids).collect();
    prompts.push((0..150u32).map(|i| 2 + (i * 37 + 11) % (vocab as u32 - 2)).collect());
    let mut same_greedy = 0;
    for prompt in &prompts {
        let len = prompt.len();
        let sensitive = route_sensitive(fixture, len);
        let (want, got) = (prefill_logits(cpu.as_ref(), prompt), prefill_logits(gpu.as_ref(), prompt));
        // A recurrent route tie may carry the logits anywhere: even the top-5 check is measured.
        let compare = if RECURRENT_ROUTE_TIES.contains(&fixture) { measure_logits } else { compare_logits };
        let LogitsAgreement { rel_l2: rel, top5_err: lp_err, clear, clear_equal, worst_flip, outside_top5, .. } =
            compare(&want, &got, vocab, &format!("{name} len {len}"));
        let note = if sensitive { " (router near tie: measured)" } else { "" };
        println!(
            "TABLE|goldens prefill logits {name} len {len}{note}|rel L2 {rel:.2e}|top5 logprob err {lp_err:.3}|argmax {clear_equal}/{clear}|widest flipped margin {worst_flip:.3}, top-1 outside top-5 at {outside_top5}/{len}"
        );
        let (on_cpu, on_gpu) = (greedy_tokens(cpu.as_ref(), prompt, 32), greedy_tokens(gpu.as_ref(), prompt, 32));
        let what = format!("greedy {name} len {len}");
        if sensitive {
            let parted = divergence(&on_cpu, &on_gpu).map_or("none".into(), |j| format!("token {j}"));
            println!("TABLE|{what}{note}: parted at {parted}||||");
            continue;
        }
        let hybrid = HYBRIDS.contains(&fixture);
        let bar = if hybrid { 5e-2 } else { 3e-2 };
        assert!(rel < bar, "{name} len {len}: relative L2 error {rel}");
        let tol = if len == 150 { LONG_LOGPROB_TOL } else { LOGPROB_TOL };
        assert!(lp_err < tol, "{name} len {len}: top-5 logprob error {lp_err}");
        assert!(
            hybrid || clear == clear_equal,
            "{name} len {len}: argmax differs at a clear position (reference margin {worst_flip})"
        );
        same_greedy += usize::from(equal_or_tie(cpu.as_ref(), prompt, &on_cpu, &on_gpu, &what));
    }
    println!("TABLE|goldens greedy 32 tokens {name}|{same_greedy}/{} identical to CPU|||", prompts.len());
}

/// The FP8 checkpoints, and the llama and qwen3-moe fixtures quantized to FP8 at load, on the
/// GPU. A prompt of more than 8 tokens runs the FP8 GEMM, whose inputs are quantized per token: its logits
/// are measured against transformers with the same input quantization (`w8a8_logits`) under
/// the sanity bar `FP8_W8A8_SANITY`; a shorter one runs the skinny FP8 GEMM on bf16 inputs,
/// held to the CPU on the dequantized weights at `FP8_REL_L2` / `FP8_LOGPROB_TOL`. Every value
/// printed; `--quantization fp8` (no such reference: the llama fixture, and qwen3-moe, whose
/// experts it quantizes to FP8 rows) is measured against the CPU's bf16 model, top-5 check
/// included: on an H100 the quantized qwen3-moe sat 9.7–12.8 % from it, with a top token outside
/// the other's top 5 at 1 of 5 and 2 of 40 rows (the llama fixture: 7.1–14.9 %, none), the
/// weights' e4m3 rounding on a tiny model's near-flat logits; the experts' FP8 kernels are held
/// to their reference in `cuda_moe` and to the checkpoint fixture above.
#[test]
fn cuda_goldens_fp8_match_cpu() {
    if !cuda_enabled("cuda_goldens_fp8_match_cpu") {
        return;
    }
    let quantized = ferrite_models::LoadOptions {
        quantization: ferrite_models::gpu::UploadQuantization::Fp8,
        ..Default::default()
    };
    let cases = FP8_FIXTURES
        .iter()
        .map(|&n| (n, ferrite_models::LoadOptions::default()))
        .chain([("llama", quantized), ("qwen3-moe", quantized)]);
    let mut failures = Vec::new();
    for (fixture, opts) in cases {
        let dir = fixture_dir(fixture);
        let cpu = ferrite_models::load_on(&dir, DeviceChoice::Cpu).expect("cpu").model;
        let gpu = ferrite_models::load_with(&dir, DeviceChoice::Cuda(0), &opts).expect("cuda").model;
        let checkpoint = FP8_FIXTURES.contains(&fixture).then_some(fixture);
        let name = checkpoint.map_or(format!("{fixture} --quantization fp8"), str::to_string);
        let reference = reference(fixture);
        let vocab = cpu.config().vocab_size;
        let prompts: Vec<Vec<u32>> = reference["prompts"].as_array().expect("prompts").iter().map(ids).collect();
        for (p, prompt) in prompts.iter().enumerate() {
            let len = prompt.len();
            let got = prefill_logits(gpu.as_ref(), prompt);
            let (on_cpu, on_gpu) = (greedy_tokens(cpu.as_ref(), prompt, 32), greedy_tokens(gpu.as_ref(), prompt, 32));
            let parted = divergence(&on_cpu, &on_gpu).map_or("none".into(), |j| format!("token {j}"));
            if let Some(rows) = reference["w8a8_logits"].get(p).filter(|_| len > 8) {
                let rows = rows.as_array().expect("rows");
                let flat = rows.iter().flat_map(|r| r.as_array().expect("row").iter());
                let want: Vec<f32> = flat.map(|v| v.as_f64().expect("logit") as f32).collect();
                let rel = rel_l2(&want, &got);
                println!(
                    "TABLE|fp8 prefill logits {name} len {len} vs transformers W8A8 (measured)|rel L2 {rel:.2e}|||greedy vs CPU parted at {parted}"
                );
                if checkpoint.is_some() {
                    failures.extend((rel >= FP8_W8A8_SANITY).then(|| format!("{name} len {len}: W8A8 rel L2 {rel}")));
                }
                continue;
            }
            let want = prefill_logits(cpu.as_ref(), prompt);
            // Quantized at load, the CPU's bf16 model is no reference: measured, top-5 check too.
            let compare = if checkpoint.is_some() { compare_logits } else { measure_logits };
            let LogitsAgreement { rel_l2: rel, top5_err: lp_err, clear, clear_equal, outside_top5, .. } =
                compare(&want, &got, vocab, &format!("{name} len {len}"));
            println!(
                "TABLE|fp8 prefill logits {name} len {len} vs CPU|rel L2 {rel:.2e}|top5 logprob err {lp_err:.3}|argmax {clear_equal}/{clear}, top-1 outside top-5 at {outside_top5}/{len}|greedy vs CPU parted at {parted}"
            );
            if checkpoint.is_some() {
                failures.extend((rel >= FP8_REL_L2).then(|| format!("{name} len {len}: relative L2 error {rel}")));
                failures.extend(
                    (lp_err >= FP8_LOGPROB_TOL).then(|| format!("{name} len {len}: top-5 logprob error {lp_err}")),
                );
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Relative L2 distance of `got` from `want`.
fn rel_l2(want: &[f32], got: &[f32]) -> f64 {
    let num: f64 = want.iter().zip(got).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|&a| (a as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// Whether prompt length `len` of `fixture` is routed near a tie (`ROUTE_SENSITIVE`; every
/// MoE fixture's 150-token prompt; every prompt of `RECURRENT_ROUTE_TIES`).
fn route_sensitive(fixture: &str, len: usize) -> bool {
    MOE_FIXTURES.contains(&fixture)
        && (len == 150 || ROUTE_SENSITIVE.contains(&(fixture, len)) || RECURRENT_ROUTE_TIES.contains(&fixture))
}

/// The MoE fixtures on the GPU against transformers' own f32 logits (reference.json) on the
/// prompts they route clearly: the same bf16 tolerance as against the CPU.
#[test]
fn cuda_goldens_moe_match_transformers() {
    if !cuda_enabled("cuda_goldens_moe_match_transformers") {
        return;
    }
    for fixture in MOE_FIXTURES {
        let gpu = ferrite_models::load_on(&fixture_dir(fixture), DeviceChoice::Cuda(0)).expect("cuda").model;
        let reference = reference(fixture);
        let vocab = gpu.config().vocab_size;
        for (p, prompt) in reference["prompts"].as_array().expect("prompts").iter().map(ids).enumerate() {
            let len = prompt.len();
            if route_sensitive(fixture, len) {
                continue;
            }
            let want: Vec<f32> = reference["logits"][p]
                .as_array()
                .expect("logits")
                .iter()
                .flat_map(|row| row.as_array().expect("row").iter().map(|v| v.as_f64().expect("logit") as f32))
                .collect();
            let got = prefill_logits(gpu.as_ref(), &prompt);
            let LogitsAgreement { rel_l2: rel, top5_err: lp_err, clear, clear_equal, .. } =
                compare_logits(&want, &got, vocab, &format!("{fixture} len {len} vs transformers"));
            println!(
                "TABLE|MoE GPU vs transformers {fixture} len {len}|rel L2 {rel:.2e}|top5 logprob err {lp_err:.3}|argmax {clear_equal}/{clear}"
            );
            assert!(rel < 3e-2, "{fixture} len {len}: relative L2 error {rel} against transformers");
            assert!(lp_err < LOGPROB_TOL, "{fixture} len {len}: top-5 logprob error {lp_err} against transformers");
            assert_eq!(clear, clear_equal, "{fixture} len {len}: argmax differs from transformers at a clear position");
        }
    }
}

#[test]
fn cuda_goldens_graph_replay_equals_eager() {
    if !cuda_enabled("cuda_goldens_graph_replay_equals_eager") {
        return;
    }
    // (fixture, the first row's prompt length): phi3's first row crosses its original context
    // (32) at the 6th of the 12 decode steps, the others start past it.
    let cases = [
        ("gemma3", 20),
        ("gemma4-shared-ple", 20),
        ("phi3", 26),
        ("olmo2", 20),
        ("granite", 20),
        ("starcoder2", 20),
        ("gemma4-moe", 20),
        ("qwen3-moe", 20),
        ("mixtral", 20),
        ("fp8-qwen3-moe-block", 20),
        ("qwen3.5", 20),
        ("qwen3-next", 20),
    ];
    for (name, first) in cases {
        let model = gpu_decoder(name);
        let vocab = model.config().vocab_size as u32;
        for rows in [1usize, 2, 4] {
            let prompts: Vec<Vec<u32>> = (0..rows)
                .map(|r| (0..(first + 37 * r as u32)).map(|i| 2 + (i * 13 + r as u32) % (vocab - 2)).collect())
                .collect();
            let run = |graphs: bool| {
                model.set_cuda_graphs(graphs);
                let per_row = (prompts.iter().map(Vec::len).max().unwrap_or(0) + 12).div_ceil(BLOCK);
                let (mut kv, _) = cache(&model, per_row * rows);
                let table = |r: usize| {
                    let t: Vec<u32> = ((r * per_row) as u32..((r + 1) * per_row) as u32).collect();
                    vec![t; model.kv_layout().groups.len()]
                };
                let mut batch = ForwardBatch::default();
                for (r, p) in prompts.iter().enumerate() {
                    batch.push_row(p, p.len(), table(r), RowLogits::Last);
                }
                model.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("prefill");
                let mut out = Vec::new();
                for s in 0..12 {
                    let mut batch = ForwardBatch::default();
                    for (r, p) in prompts.iter().enumerate() {
                        batch.push_row(
                            &[(p[s % p.len()] + s as u32) % vocab],
                            p.len() + s + 1,
                            table(r),
                            RowLogits::Last,
                        );
                    }
                    out.extend(model.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("decode"));
                }
                out
            };
            let (graphed, eager) = (run(true), run(false));
            let same = graphed.iter().zip(&eager).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
            println!("TABLE|decode graph vs eager {name} {rows} rows|{same}/{} bit-equal|||", graphed.len());
            assert_eq!(same, graphed.len(), "{name} {rows} rows: graph replay differs from eager");
        }
    }
}

/// `n` greedy tokens for each of `prompts` in one batch. `chained`: every decode step is
/// queued before the step it follows was resolved, its ids carried on the device from that
/// step's picks, and the handles are resolved only at the end, newest first; otherwise each
/// step is resolved and its ids fed back. Either way one more step is queued and its handle
/// dropped unresolved.
fn batch_greedy(model: &dyn CausalLm, prompts: &[Vec<u32>], n: usize, chained: bool) -> Vec<Vec<u32>> {
    let per_row = (prompts.iter().map(Vec::len).max().unwrap_or(0) + n + 1).div_ceil(BLOCK);
    let (mut kv, _) = cache(model, per_row * prompts.len());
    let groups = model.kv_layout().groups.len();
    let table = |r: usize| vec![((r * per_row) as u32..((r + 1) * per_row) as u32).collect::<Vec<_>>(); groups];
    let mut batch = ForwardBatch::default();
    for (r, p) in prompts.iter().enumerate() {
        batch.push_row(p, p.len(), table(r), RowLogits::Last);
    }
    let mut pending = vec![model.step(&batch, &mut kv, Want::Argmax).expect("prefill")];
    // The ids of each step, per row.
    let mut steps: Vec<Vec<u32>> = Vec::new();
    for s in 1..=n {
        if !chained {
            steps.push(pending.pop().expect("the last step").ids().expect("picks"));
        }
        let mut batch = ForwardBatch::default();
        for (r, p) in prompts.iter().enumerate() {
            let token = if chained { 0 } else { steps[s - 1][r] };
            batch.push_row(&[token], p.len() + s, table(r), RowLogits::Last);
            if chained {
                batch.carried.push((r, r));
            }
        }
        let step = model.step(&batch, &mut kv, Want::Argmax).expect("decode");
        if s < n {
            pending.push(step);
        }
    }
    if chained {
        assert!(pending.iter().all(Pending::is_queued), "a GPU argmax step came back resolved");
        steps = pending.into_iter().rev().map(|p| p.ids().expect("picks")).collect();
        steps.reverse();
    }
    (0..prompts.len()).map(|r| steps.iter().map(|ids| ids[r]).collect()).collect()
}

/// Step handles on the GPU: decode steps queued back to back with their ids carried on the
/// device, resolved newest first, give the ids of resolving each step before the next, bit
/// for bit (gemma3: two KV groups); so does a second stepwise run after the dropped handle.
#[test]
fn cuda_goldens_chained_handles_equal_stepwise() {
    if !cuda_enabled("cuda_goldens_chained_handles_equal_stepwise") {
        return;
    }
    let (_, gpu, reference) = load_pair("gemma3", None);
    let prompts: Vec<Vec<u32>> = reference["prompts"].as_array().expect("prompts").iter().map(ids).collect();
    let stepwise = batch_greedy(gpu.as_ref(), &prompts, 16, false);
    let chained = batch_greedy(gpu.as_ref(), &prompts, 16, true);
    let again = batch_greedy(gpu.as_ref(), &prompts, 16, false);
    let same = (0..prompts.len()).filter(|&r| chained[r] == stepwise[r]).count();
    println!("TABLE|GPU chained step handles == stepwise|{same}/{} rows identical|||", prompts.len());
    assert_eq!(chained, stepwise, "chained handles differ from stepwise steps");
    assert_eq!(again, stepwise, "stepwise steps after a dropped handle differ");
    assert!(stepwise.iter().all(|t| t.len() == 16), "{stepwise:?}");
}

/// Fixture `name` through the engine on the GPU: six prompts batched (prefill chunks shared
/// with other rows, decode steps of several rows, the experts' grouped GEMM for a MoE) give
/// each prompt's greedy tokens alone, a divergence allowed only at a near tie of the CPU
/// logits; against the CPU engine too (asserted for dense models; for mixtures of experts
/// printed, since bf16 activations may route a near-tie token to another expert, see
/// `ROUTE_SENSITIVE`).
fn engine_batched_equals_alone(name: &str, cfg: &EngineConfig) {
    let (cpu, gpu, _) = load_pair(name, None);
    let vocab = cpu.config().vocab_size as u32;
    let prompts: Vec<Vec<u32>> =
        (0..6u32).map(|r| (0..(9 + 23 * r)).map(|i| 2 + (i * 31 + 7 * r) % (vocab - 2)).collect()).collect();
    let alone: Vec<Vec<u32>> =
        prompts.iter().map(|p| run_engine(&gpu, cfg, std::slice::from_ref(p), 24).0.remove(0)).collect();
    let (batched, _) = run_engine(&gpu, cfg, &prompts, 24);
    let (on_cpu, _) = run_engine(&cpu, cfg, &prompts, 24);
    let mut same = (0, 0);
    for (i, p) in prompts.iter().enumerate() {
        let what = format!("{name} GPU batched vs alone");
        same.0 += usize::from(equal_or_tie(cpu.as_ref(), p, &alone[i], &batched[i], &what));
        let what = format!("{name} GPU vs CPU engine");
        if MOE_FIXTURES.contains(&name) {
            let parted = divergence(&on_cpu[i], &alone[i]).map_or("none".into(), |j| format!("token {j}"));
            println!("TABLE|{what} prompt {i} (measured): parted at {parted}||||");
            same.1 += usize::from(on_cpu[i] == alone[i]);
        } else {
            same.1 += usize::from(equal_or_tie(cpu.as_ref(), p, &on_cpu[i], &alone[i], &what));
        }
    }
    println!("TABLE|{name} engine GPU batched == alone|{}/{} identical|||", same.0, prompts.len());
    println!("TABLE|{name} engine GPU vs CPU greedy|{}/{} identical|||", same.1, prompts.len());
}

/// Each request's greedy tokens through one engine core, and its prefix-cache hit tokens.
fn run_engine(model: &Arc<dyn CausalLm>, cfg: &EngineConfig, prompts: &[Vec<u32>], n: usize) -> (Vec<Vec<u32>>, u64) {
    let mut core = EngineCore::new(model.clone(), None, vec![], cfg).expect("engine core");
    let mut rxs: Vec<_> =
        prompts.iter().enumerate().map(|(i, p)| add(&mut core, i as u64 + 1, p.clone(), greedy(n))).collect();
    run_to_end(&mut core);
    let tokens = rxs.iter_mut().map(|rx| collect(rx, 1).remove(0)).collect();
    (tokens, core.kv_manager().prefix_cache().map_or(0, |c| c.hit_tokens))
}

#[test]
fn cuda_goldens_engine_batched_and_prefix() {
    if !cuda_enabled("cuda_goldens_engine_batched_and_prefix") {
        return;
    }
    let cfg = EngineConfig {
        max_num_batched_tokens: 40,
        max_num_seqs: 8,
        block_size: BLOCK,
        kv_cache_memory: Some(16 << 20),
        prefix_cache: false,
        ..EngineConfig::default()
    };
    for name in
        ["gemma4-shared-ple", "gemma4-moe", "qwen3-moe", "mixtral", "fp8-qwen3-moe-block", "qwen3.5", "qwen3-next"]
    {
        engine_batched_equals_alone(name, &cfg);
    }
    let (cpu, gpu, _) = load_pair("gemma4-shared-ple", None);
    let vocab = cpu.config().vocab_size as u32;

    // Prefix hit == cold: a second request sharing 64 tokens (8 windows) with a finished one.
    let shared: Vec<u32> = (0..64u32).map(|i| 2 + (i * 17 + 5) % (vocab - 2)).collect();
    let first = [shared.clone(), vec![3, 4, 5, 6, 7]].concat();
    let second = [shared, vec![9, 10, 11, 12, 13, 14, 15]].concat();
    let warm = EngineConfig { prefix_cache: true, ..cfg.clone() };
    let mut core = EngineCore::new(gpu.clone(), None, vec![], &warm).expect("core");
    let mut got = Vec::new();
    for (i, p) in [&first, &second].into_iter().enumerate() {
        let mut rx = add(&mut core, i as u64 + 1, p.clone(), greedy(16));
        run_to_end(&mut core);
        got.push(collect(&mut rx, 1).remove(0));
    }
    let hits = core.kv_manager().prefix_cache().map_or(0, |c| c.hit_tokens);
    let cold = run_engine(&gpu, &cfg, std::slice::from_ref(&second), 16).0.remove(0);
    let same = equal_or_tie(cpu.as_ref(), &second, &cold, &got[1], "gemma4 GPU prefix hit vs cold");
    println!("TABLE|gemma4 engine GPU prefix hit == cold|{hits} hit tokens|{}/1 identical||", usize::from(same));
    assert!(hits >= 48, "the second request reused only {hits} cached tokens");
}

/// Gemma-3-270M's real Q4_K_M GGUF (`FERRITE_GEMMA3_GGUF`, or the named model's cache path;
/// skipped, saying so, where neither is there — the GPU host has no package index) with its
/// quantized blocks on the device: the reference prompts' 32 greedy tokens against the CPU
/// executor's, a divergence allowed only at a near tie of the CPU logits.
#[test]
fn cuda_gemma3_270m_gguf_matches_cpu() {
    if !cuda_enabled("cuda_gemma3_270m_gguf_matches_cpu") {
        return;
    }
    let named = ferrite_models::registry::find("gemma3-270m").expect("named model");
    let path = match std::env::var_os("FERRITE_GEMMA3_GGUF") {
        Some(p) => PathBuf::from(p),
        None => ferrite_models::paths::models_dir().join(named.name).join(named.file_name),
    };
    if !path.is_file() {
        println!("SKIP cuda_gemma3_270m_gguf_matches_cpu: {} is not here", path.display());
        return;
    }
    let cpu = ferrite_models::load_on(&path, DeviceChoice::Cpu).expect("cpu").model;
    let gpu = ferrite_models::load_on(&path, DeviceChoice::Cuda(0)).expect("cuda").model;
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gemma3_270m_reference.json");
    let text = std::fs::read_to_string(fixture).expect("reference");
    let reference: Value = serde_json::from_str(&text).expect("json");
    let mut same = 0;
    let prompts = reference["prompts"].as_array().expect("prompts");
    for case in prompts {
        let prompt = ids(&case["ids"]);
        let (on_cpu, on_gpu) = (greedy_tokens(cpu.as_ref(), &prompt, 32), greedy_tokens(gpu.as_ref(), &prompt, 32));
        let what = format!("gemma3-270m GGUF greedy len {}", prompt.len());
        same += usize::from(equal_or_tie(cpu.as_ref(), &prompt, &on_cpu, &on_gpu, &what));
    }
    println!("TABLE|gemma3-270m Q4_K_M GGUF greedy 32 tokens|{same}/{} identical to CPU|||", prompts.len());
}

/// A model drafting for itself proposes what it then accepts at temperature 0, so on the GPU
/// (decode steps drafting, verify steps of 1 + k tokens judging) nearly every proposed token
/// stands — the rest are bf16 near ties between the two step shapes — and the tokens are
/// plain decoding's up to near ties: the mixtures of experts, the hybrids and a dense family,
/// with CUDA graphs on and off.
#[test]
fn cuda_goldens_self_draft_accepts_its_own_proposals() {
    if !cuda_enabled("cuda_goldens_self_draft_accepts_its_own_proposals") {
        return;
    }
    use std::sync::atomic::Ordering::Relaxed;
    for name in ["gemma3", "qwen3-moe", "mixtral", "gemma4-moe", "qwen3.5", "qwen3-next"] {
        let cpu = ferrite_models::load_on(&fixture_dir(name), DeviceChoice::Cpu).expect("cpu").model;
        let prompts: Vec<Vec<u32>> = reference(name)["prompts"].as_array().expect("prompts").iter().map(ids).collect();
        let decoder = Arc::new(gpu_decoder(name));
        for graphs in [true, false] {
            decoder.set_cuda_graphs(graphs);
            let gpu: Arc<dyn CausalLm> = decoder.clone();
            let cfg = EngineConfig { block_size: BLOCK, ..EngineConfig::default() };
            let (plain, _) = run_engine(&gpu, &cfg, &prompts, 24);
            let spec = EngineConfig {
                speculation: ferrite_engine::Speculation::Draft(gpu.clone()),
                num_draft_tokens: 4,
                ..cfg.clone()
            };
            let mut core = EngineCore::new(gpu.clone(), None, vec![], &spec).expect("engine core");
            let mut rxs: Vec<_> =
                prompts.iter().enumerate().map(|(i, p)| add(&mut core, i as u64 + 1, p.clone(), greedy(24))).collect();
            run_to_end(&mut core);
            let drafted: Vec<Vec<u32>> = rxs.iter_mut().map(|rx| collect(rx, 1).remove(0)).collect();
            let m = core.metrics();
            let (proposed, accepted) = (m.verify_proposed_tokens.load(Relaxed), m.verify_accepted_tokens.load(Relaxed));
            let rate = accepted as f64 / proposed.max(1) as f64;
            let what = format!("{name} self draft, graphs {graphs}");
            let same = (prompts.iter().enumerate())
                .filter(|(i, p)| equal_or_tie(cpu.as_ref(), p, &plain[*i], &drafted[*i], &what))
                .count();
            let note =
                if RECURRENT_ROUTE_TIES.contains(&name) { " (route ties kept in its state: measured)" } else { "" };
            println!(
                "TABLE|{what}{note}|{accepted} of {proposed} proposed accepted ({rate:.3})|{same}/{} as plain||",
                prompts.len()
            );
            assert!(rate >= 0.9 || !note.is_empty(), "{what}: {accepted} of {proposed} proposed tokens accepted");
        }
    }
}
