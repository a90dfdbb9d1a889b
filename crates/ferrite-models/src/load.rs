//! `load`: from a path (HF model directory or `.gguf` file) to a ready model with its
//! tokenizer, chat template and generation defaults.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use crate::chat_template::{ChatTemplate, ModelChatTemplates};
use crate::config::{Architecture, ConfigSource, ModelConfig};
use crate::error::{LoadError, Result};
use crate::gemma::Gemma;
use crate::gemma4::Gemma4;
use crate::gguf::GgufFile;
use crate::llama::Llama;
use crate::model::CausalLm;
use crate::safetensors::SafetensorsDir;
use crate::tokenizer::Tokenizer;
use crate::weights::{GgufLayout, WeightSource, Weights};

/// Sampling defaults a model ships in `generation_config.json`.
#[derive(Debug, Clone, Default)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub eos_token_ids: Vec<u32>,
}

pub struct LoadedModel {
    pub model: Arc<dyn CausalLm>,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub chat_template: Option<ChatTemplate>,
    pub generation: GenerationDefaults,
    /// Bytes of the weight files (mapped, not copied).
    pub weight_bytes: usize,
    pub load_secs: f64,
}

impl LoadedModel {
    /// Every token id that ends generation: config, generation_config and tokenizer EOS sets.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let mut ids = self.model.config().eos_token_ids.clone();
        ids.extend(&self.generation.eos_token_ids);
        if let Some(t) = &self.tokenizer {
            ids.extend(t.eos_token_ids());
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

pub fn load(path: &Path) -> Result<LoadedModel> {
    let t0 = Instant::now();
    let mut loaded = if path.is_dir() {
        load_hf_dir(path)?
    } else if path.is_file() {
        load_gguf(path)?
    } else {
        return Err(LoadError::format(path, "no such model directory or .gguf file"));
    };
    loaded.load_secs = t0.elapsed().as_secs_f64();
    Ok(loaded)
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| LoadError::format(path, format!("invalid JSON: {e}")))
}

/// The architecture's module builds the model (`config::ARCHITECTURES` names them).
fn build(cfg: ModelConfig, src: &ConfigSource, weights: &Weights) -> Result<Arc<dyn CausalLm>> {
    let bar = indicatif::ProgressBar::new(cfg.num_layers as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading {bar:30} {pos}/{len} layers")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let progress = |n: usize| bar.set_position(n as u64);
    let model: Arc<dyn CausalLm> = match cfg.arch {
        Architecture::Llama | Architecture::Mistral | Architecture::Qwen2 | Architecture::Qwen3 => {
            Arc::new(Llama::load(cfg, weights, &progress)?)
        }
        Architecture::Gemma | Architecture::Gemma2 | Architecture::Gemma3 => {
            Arc::new(Gemma::load(cfg, src, weights, &progress)?)
        }
        Architecture::Gemma4 => Arc::new(Gemma4::load(cfg, src, weights, &progress)?),
    };
    bar.finish_and_clear();
    Ok(model)
}

fn load_hf_dir(dir: &Path) -> Result<LoadedModel> {
    let cfg_path = dir.join("config.json");
    if !cfg_path.is_file() {
        return Err(LoadError::format(dir, "not a model directory: config.json is missing"));
    }
    let json = read_json(&cfg_path)?;
    let cfg = ModelConfig::from_hf_json(&cfg_path, &json)?;
    let weights = Weights::new(WeightSource::Safetensors(SafetensorsDir::open(dir)?), GgufLayout::default());
    let model = build(cfg, &ConfigSource::Hf { path: &cfg_path, json: &json }, &weights)?;
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = if tok_path.is_file() { Some(Arc::new(Tokenizer::from_file(&tok_path)?)) } else { None };
    let templates = ModelChatTemplates::from_model_dir(dir).map_err(|e| LoadError::format(dir, e.to_string()))?;
    let chat_template = match templates.default {
        Some(_) => Some(templates.compile(None).map_err(|e| LoadError::format(dir, format!("chat template: {e}")))?),
        None => None,
    };
    let gen_path = dir.join("generation_config.json");
    let generation =
        if gen_path.is_file() { generation_defaults(&read_json(&gen_path)?) } else { GenerationDefaults::default() };
    Ok(LoadedModel { model, tokenizer, chat_template, generation, weight_bytes: weights.file_bytes(), load_secs: 0.0 })
}

fn generation_defaults(v: &Value) -> GenerationDefaults {
    let f = |k: &str| v.get(k).and_then(Value::as_f64).map(|x| x as f32);
    let eos = match v.get("eos_token_id") {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => vec![],
    };
    GenerationDefaults {
        temperature: f("temperature"),
        top_p: f("top_p"),
        top_k: v.get("top_k").and_then(Value::as_u64).map(|x| x as usize),
        eos_token_ids: eos,
    }
}

fn load_gguf(path: &Path) -> Result<LoadedModel> {
    let g = GgufFile::open(path)?;
    let cfg = ModelConfig::from_gguf(&g)?;
    let tokenizer = Tokenizer::from_gguf(&g)?;
    let chat_template = match g.get_str("tokenizer.chat_template") {
        Some(src) => Some(
            ChatTemplate::new(src, tokenizer.bos_token().map(String::from), tokenizer.eos_token().map(String::from))
                .map_err(|e| LoadError::format(path, format!("chat template: {e}")))?,
        ),
        None => None,
    };
    let layout = GgufLayout {
        unpermute_qk: (cfg.arch == Architecture::Llama).then_some((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)),
        sandwich_norms: matches!(cfg.arch, Architecture::Gemma2 | Architecture::Gemma3),
    };
    let weights = Weights::new(WeightSource::Gguf(g), layout);
    let WeightSource::Gguf(g) = weights.source() else {
        return Err(LoadError::format(path, "GGUF weights without a GGUF file"));
    };
    let model = build(cfg, &ConfigSource::Gguf(g), &weights)?;
    Ok(LoadedModel {
        model,
        tokenizer: Some(Arc::new(tokenizer)),
        chat_template,
        generation: GenerationDefaults::default(),
        weight_bytes: weights.file_bytes(),
        load_secs: 0.0,
    })
}
