//! HF parity on the tiny random-weight fixtures (`scripts/goldens/make_tiny_models.py`):
//! prompt logits within 1e-4 relative of transformers' f32 logits, and 32 greedy tokens
//! identical, through the engine's generator (chunked prefill over the paged KV cache).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrite_engine::{GenerateRequest, Generator, SamplingParams};
use ferrite_models::config::ModelConfig;
use ferrite_models::llama::Llama;
use ferrite_models::model::CausalLm;
use ferrite_models::safetensors::SafetensorsDir;
use ferrite_models::weights::{WeightSource, Weights};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::{ForwardBatch, KvCache};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models")
}

fn load(name: &str) -> (Arc<dyn CausalLm>, Value) {
    let dir = fixtures().join(name);
    let cfg_path = dir.join("config.json");
    let cfg_json: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("config")).expect("json");
    let cfg = ModelConfig::from_hf_json(&cfg_path, &cfg_json).unwrap_or_else(|e| panic!("{name}: {e}"));
    let weights = Weights::new(WeightSource::Safetensors(SafetensorsDir::open(&dir).expect("safetensors")), None);
    let model: Arc<dyn CausalLm> = Arc::new(Llama::load(cfg, &weights, &|_| {}).unwrap_or_else(|e| panic!("{name}: {e}")));
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).expect("reference.json")).expect("json");
    (model, reference)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// Logits of every prompt position from one forward pass.
fn prompt_logits(model: &dyn CausalLm, prompt: &[u32]) -> Vec<f32> {
    let block = 4;
    let blocks = prompt.len().div_ceil(block);
    let mut kv = KvCache::new(&model.kv_layout(), blocks, block).expect("kv");
    let mut batch = ForwardBatch::default();
    batch.push_row(prompt, prompt.len(), (0..blocks as u32).collect(), RowLogits::All);
    model.forward(&batch, &mut kv).expect("forward")
}

fn check(name: &str) {
    let (model, reference) = load(name);
    let vocab = model.config().vocab_size;
    let prompts = reference["prompts"].as_array().expect("prompts");
    for (p, prompt) in prompts.iter().enumerate() {
        let prompt = ids(prompt);
        let got = prompt_logits(model.as_ref(), &prompt);
        let want: Vec<f32> = reference["logits"][p]
            .as_array()
            .expect("logits")
            .iter()
            .flat_map(|row| row.as_array().expect("row").iter().map(|x| x.as_f64().expect("logit") as f32))
            .collect();
        assert_eq!(got.len(), prompt.len() * vocab, "{name} prompt {p}: logits count");
        let mut worst = 0f32;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = (g - w).abs() / w.abs().max(1.0);
            worst = worst.max(err);
            assert!(err <= 1e-4, "{name} prompt {p} position {} token {}: {g} vs {w}", i / vocab, i % vocab);
        }
        eprintln!("{name} prompt {p}: worst relative logit error {worst:.2e}");

        let want_greedy = ids(&reference["greedy"][p]);
        // Odd chunk size so prefill runs in several chunks — except for dynamic NTK RoPE, whose
        // frequencies (as in transformers) depend on the length of the forward pass a token
        // was in, so only a whole-prompt prefill reproduces transformers' tokens.
        let chunk = if model.config().rope.is_dynamic() { prompt.len() } else { 7 };
        let mut gen = Generator::new(model.clone(), 128, 4, chunk).expect("generator");
        let req = GenerateRequest {
            prompt: prompt.clone(),
            max_tokens: want_greedy.len(),
            sampling: SamplingParams::default(),
            stop_token_ids: vec![],
            ignore_eos: true,
        };
        let mut out = Vec::new();
        gen.generate(&req, &mut |t| {
            out.push(t);
            true
        })
        .expect("generate");
        assert_eq!(out, want_greedy, "{name} prompt {p}: greedy tokens differ");
    }
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
}
