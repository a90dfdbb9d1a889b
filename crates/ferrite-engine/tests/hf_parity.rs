//! HF parity on the tiny random-weight fixtures (`scripts/goldens/make_tiny_models.py`):
//! prompt logits within 1e-4 relative of transformers' f32 logits (over an f32 KV cache: the
//! default f16 one rounds K and V by up to 2^-11 relative), and 32 greedy tokens identical,
//! through the engine (chunked prefill over the default paged KV cache); and a Q8_0 GGUF of
//! the Mixtral fixture within Q8_0's rounding. The FP8 checkpoints (`make_fp8_models.py`:
//! compressed-tensors' tensor and channel scales, transformers' 128×128 block scales; and
//! `make_fp8_moe_models.py`: a Qwen3-MoE whose experts and attention are FP8 in 64×64 blocks)
//! load dequantized to f32 on the CPU, so they are held to the same bar against transformers
//! on the dequantized weights.

mod common;

use common::*;
use ferrite_engine::EngineConfig;
use ferrite_models::model::{CausalLm, Pending, Want};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::{ForwardBatch, KvCache, KvDtype, KvScheme};

/// Logits of every prompt position from one forward pass, over an f32 KV cache.
fn prompt_logits(model: &dyn CausalLm, prompt: &[u32]) -> Vec<f32> {
    let block = 4;
    let blocks = prompt.len().div_ceil(block);
    let layout = model.kv_layout();
    let mut kv = KvCache::with_scheme(
        &layout,
        &vec![blocks; layout.groups.len()],
        block,
        &KvScheme { dtype: KvDtype::F32, ..Default::default() },
    )
    .expect("kv");
    let mut batch = ForwardBatch::default();
    let tables = vec![(0..blocks as u32).collect::<Vec<_>>(); layout.groups.len()];
    batch.push_row(prompt, prompt.len(), tables, RowLogits::All);
    model.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("forward")
}

fn check(name: &str) {
    let (model, reference) = load_fixture(name);
    check_model(name, model, &reference);
}

/// The fixture's GGUF (written as llama.cpp's converter writes that architecture) against the
/// same transformers references.
fn check_gguf(name: &str) {
    let (_, reference) = load_fixture(name);
    let model = ferrite_models::load(&fixture_dir(name).join("model.gguf")).expect("GGUF").model;
    check_model(&format!("{name} (GGUF)"), model, &reference);
}

fn check_model(name: &str, model: std::sync::Arc<dyn CausalLm>, reference: &serde_json::Value) {
    let vocab = model.config().vocab_size;
    let prompts = reference["prompts"].as_array().expect("prompts");
    for (p, prompt) in prompts.iter().enumerate() {
        let prompt = ids(prompt);
        let got = prompt_logits(model.as_ref(), &prompt);
        let want = reference_logits(reference, p);
        assert_eq!(got.len(), prompt.len() * vocab, "{name} prompt {p}: logits count");
        let mut worst = 0f32;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = (g - w).abs() / w.abs().max(1.0);
            worst = worst.max(err);
            assert!(err <= 1e-4, "{name} prompt {p} position {} token {}: {g} vs {w}", i / vocab, i % vocab);
        }
        eprintln!("{name} prompt {p}: worst relative logit error {worst:.2e}");

        let mut want_greedy = ids(&reference["greedy"][p]);
        // Generation stops at the model's context (dynamic NTK: max_position_embeddings × factor).
        want_greedy.truncate(model.config().max_context() - prompt.len());
        // Odd chunk size so prefill runs in several chunks — except for dynamic NTK RoPE, whose
        // frequencies (as in transformers) depend on the length of the forward pass a token
        // was in, so only a whole-prompt prefill reproduces transformers' tokens.
        let chunk = if model.config().rope.is_dynamic() { prompt.len() } else { 7 };
        let cfg = EngineConfig { max_num_batched_tokens: chunk, block_size: 4, ..EngineConfig::default() };
        let got = alone(&model, cfg, prompt.clone(), greedy(want_greedy.len()));
        assert_eq!(got[0], want_greedy, "{name} prompt {p}: greedy tokens differ");
    }
}

/// The reference logits of prompt `p`, row-major.
fn reference_logits(reference: &serde_json::Value, p: usize) -> Vec<f32> {
    (reference["logits"][p].as_array().expect("logits").iter())
        .flat_map(|row| row.as_array().expect("row").iter().map(|x| x.as_f64().expect("logit") as f32))
        .collect()
}

/// The Mixtral fixture with every matrix in Q8_0 blocks, its experts as stacked Q8_0 tensors:
/// near transformers' f32 logits, with the same top token almost everywhere.
#[test]
fn mixtral_q8_0_gguf_tracks_transformers() {
    let (_, reference) = load_fixture("mixtral");
    let model = ferrite_models::load(&fixture_dir("mixtral").join("model-q8_0.gguf")).expect("GGUF").model;
    let vocab = model.config().vocab_size;
    let argmax = |row: &[f32]| (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b]));
    for (p, prompt) in reference["prompts"].as_array().expect("prompts").iter().enumerate() {
        let got = prompt_logits(model.as_ref(), &ids(prompt));
        let want = reference_logits(&reference, p);
        assert_eq!(got.len(), want.len());
        let rms = |v: &mut dyn Iterator<Item = f32>| {
            let (sum, n) = v.fold((0f64, 0usize), |(s, n), x| (s + f64::from(x) * f64::from(x), n + 1));
            (sum / n as f64).sqrt()
        };
        let err = rms(&mut got.iter().zip(&want).map(|(g, w)| g - w)) / rms(&mut want.iter().copied());
        let rows = want.len() / vocab;
        let agree = (0..rows)
            .filter(|&r| argmax(&got[r * vocab..(r + 1) * vocab]) == argmax(&want[r * vocab..(r + 1) * vocab]))
            .count();
        eprintln!("mixtral Q8_0 prompt {p}: relative RMS logit error {err:.2e}, top token {agree} of {rows}");
        assert!(err > 1e-5, "prompt {p}: the Q8_0 file gives the f32 logits");
        // Q8_0 noise can flip a close second expert at a few positions, which moves those
        // logits more than rounding alone; a wrong expert slice would give errors near 1.
        assert!(err < 0.15, "prompt {p}: relative RMS logit error {err}");
        assert!(agree * 10 >= rows * 9, "prompt {p}: top token agrees at {agree} of {rows} positions");
    }
}

/// Qwen3.5 as published: a multimodal `qwen3_5` config wrapping the `text_config`, the text
/// model's weights under `model.language_model.` (and a vision tower ferrite leaves alone).
/// The fixture rewritten that way gives the same logits and tokens.
#[test]
fn qwen3_5_multimodal_checkpoint_layout() {
    let src = fixture_dir("qwen3.5");
    let tmp = tempfile::tempdir().expect("tempdir");
    let text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).expect("config")).expect("json");
    let wrapper = serde_json::json!({
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"depth": 1},
    });
    std::fs::write(tmp.path().join("config.json"), wrapper.to_string()).expect("write config");
    // safetensors: an 8-byte header length, the JSON header naming each tensor's byte range, the data.
    let bytes = std::fs::read(src.join("model.safetensors")).expect("weights");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("header length")) as usize;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    let renamed: serde_json::Map<String, serde_json::Value> = header
        .into_iter()
        .map(|(k, v)| match k.strip_prefix("model.") {
            Some(rest) => (format!("model.language_model.{rest}"), v),
            None => (k, v),
        })
        .collect();
    let mut head = serde_json::Value::Object(renamed).to_string().into_bytes();
    head.resize(head.len().next_multiple_of(8), b' ');
    let mut out = (head.len() as u64).to_le_bytes().to_vec();
    out.extend(head);
    out.extend(&bytes[8 + n..]);
    std::fs::write(tmp.path().join("model.safetensors"), out).expect("write weights");
    let (_, reference) = load_fixture("qwen3.5");
    let model = ferrite_models::load(tmp.path()).expect("multimodal layout").model;
    check_model("qwen3.5 (multimodal checkpoint)", model, &reference);
}

macro_rules! gguf_parity {
    ($($test:ident => $name:literal),* $(,)?) => {
        $(#[test] fn $test() { check_gguf($name); })*
    };
}

gguf_parity! {
    phi3_gguf => "phi3",
    olmo2_gguf => "olmo2",
    glm4_gguf => "glm4",
    granite_gguf => "granite",
    starcoder2_gguf => "starcoder2",
    smollm3_gguf => "smollm3",
    qwen3_moe_gguf => "qwen3-moe",
    mixtral_gguf => "mixtral",
    qwen3_5_gguf => "qwen3.5",
    qwen3_next_gguf => "qwen3-next",
}

macro_rules! parity {
    ($($test:ident => $name:literal),* $(,)?) => {
        $(#[test] fn $test() { check($name); })*
    };
}

parity! {
    llama => "llama",
    llama_tied => "llama-tied",
    llama_rope_llama3 => "llama-rope-llama3",
    llama_rope_linear => "llama-rope-linear",
    llama_rope_dynamic => "llama-rope-dynamic",
    llama_rope_yarn => "llama-rope-yarn",
    mistral => "mistral",
    qwen2 => "qwen2",
    qwen3 => "qwen3",
    qwen3_hd32 => "qwen3-hd32",
    phi3 => "phi3",
    olmo2 => "olmo2",
    glm4 => "glm4",
    granite => "granite",
    starcoder2 => "starcoder2",
    smollm3 => "smollm3",
    gemma => "gemma",
    gemma2 => "gemma2",
    gemma3 => "gemma3",
    gemma4_shared_ple => "gemma4-shared-ple",
    gemma4_kv_eq_v => "gemma4-kv-eq-v",
    gemma4_moe => "gemma4-moe",
    qwen3_moe => "qwen3-moe",
    mixtral => "mixtral",
    qwen3_5 => "qwen3.5",
    qwen3_next => "qwen3-next",
    fp8_llama_channel => "fp8-llama-channel",
    fp8_llama_tensor => "fp8-llama-tensor",
    fp8_llama_block => "fp8-llama-block",
    fp8_qwen2_channel => "fp8-qwen2-channel",
    fp8_qwen3_moe_block => "fp8-qwen3-moe-block",
}
