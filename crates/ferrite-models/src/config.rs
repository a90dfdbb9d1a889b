//! `ModelConfig`: the shape and hyper-parameters of a dense decoder, read from a Hugging Face
//! `config.json` or from GGUF metadata, with every value checked.

use std::path::Path;

use serde_json::Value;

use crate::error::{LoadError, Result};
use crate::families::{self, Family, WindowRule};
use crate::gguf::GgufFile;
use crate::rope_scaling::{RopeKind, RopeScaling};

/// The gate activation of the MLP (`hidden_act` / `hidden_activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// `gelu_pytorch_tanh`: the tanh approximation of GELU.
    GeluTanh,
    /// `gelu`: the exact GELU, `x Φ(x)` through erf (BERT).
    Gelu,
}

impl Activation {
    fn from_hf(name: &str) -> Option<Activation> {
        match name {
            "silu" | "swish" => Some(Activation::Silu),
            "gelu_pytorch_tanh" => Some(Activation::GeluTanh),
            // transformers' `ACT2FN["gelu"]`: the erf form, whatever the family.
            "gelu" => Some(Activation::Gelu),
            _ => None,
        }
    }
}

/// The attention of one layer, for architectures that mix them (`layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    Full,
    Sliding,
}

impl LayerType {
    fn from_hf(name: &str) -> Option<LayerType> {
        match name {
            "full_attention" => Some(LayerType::Full),
            "sliding_attention" => Some(LayerType::Sliding),
            _ => None,
        }
    }

    /// The key of this type in a per-layer-type `rope_parameters`.
    pub fn hf_name(self) -> &'static str {
        match self {
            LayerType::Full => "full_attention",
            LayerType::Sliding => "sliding_attention",
        }
    }

    /// `n` layers where every `pattern`-th is full attention and the rest slide (Gemma's
    /// `sliding_window_pattern`; 2 alternates).
    pub fn pattern(n: usize, pattern: usize) -> Vec<LayerType> {
        (0..n).map(|i| if (i + 1) % pattern.max(1) == 0 { LayerType::Full } else { LayerType::Sliding }).collect()
    }

    /// `layer_types` from an HF config, or `default` when the key is absent.
    pub fn list_from_hf(cfg: &Value, n: usize, default: Vec<LayerType>) -> std::result::Result<Vec<LayerType>, String> {
        let Some(v) = cfg.get("layer_types").filter(|v| !v.is_null()) else { return Ok(default) };
        let list = v.as_array().ok_or("layer_types is not a list")?;
        if list.len() != n {
            return Err(format!("layer_types has {} entries for {n} layers", list.len()));
        }
        list.iter()
            .map(|t| {
                let name = t.as_str().unwrap_or("");
                LayerType::from_hf(name)
                    .ok_or_else(|| format!("layer type {t} is not supported (full_attention, sliding_attention)"))
            })
            .collect()
    }
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// The family's row of the architecture table.
    pub arch: &'static Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    /// The RoPE schedule (of the full-attention layers, where layer types differ).
    pub rope: RopeScaling,
    pub max_position_embeddings: usize,
    pub hidden_act: Activation,
    pub tie_word_embeddings: bool,
    /// Biases on the q/k/v projections (qwen2).
    pub qkv_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (qwen3, Gemma 3/4).
    pub qk_norm: bool,
    /// The window of sliding-window layers: every layer for mistral, the `sliding_attention`
    /// layers for Gemma.
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

pub(crate) fn get_usize(cfg: &Value, key: &str) -> Option<usize> {
    cfg.get(key).and_then(Value::as_u64).map(|v| v as usize)
}

pub(crate) fn get_f64(cfg: &Value, key: &str) -> Option<f64> {
    cfg.get(key).and_then(Value::as_f64)
}

fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => vec![],
    }
}

impl ModelConfig {
    /// Parse an HF `config.json`.
    pub fn from_hf_json(path: &Path, cfg: &Value) -> Result<ModelConfig> {
        let err = |m: String| LoadError::format(path, m);
        let model_type = cfg.get("model_type").and_then(Value::as_str).ok_or_else(|| err("no model_type".into()))?;
        let arch = families::from_hf(model_type).ok_or_else(|| {
            err(format!("unsupported architecture '{model_type}' (supported: {})", families::supported(false)))
        })?;
        let quirks = &arch.quirks;
        let req = |key: &str| get_usize(cfg, key).ok_or_else(|| err(format!("missing or invalid '{key}'")));
        let hidden_size = req("hidden_size")?;
        let num_heads = req("num_attention_heads")?;
        let num_kv_heads = get_usize(cfg, "num_key_value_heads").unwrap_or(num_heads);
        let head_dim = get_usize(cfg, "head_dim").unwrap_or(hidden_size / num_heads.max(1));
        // Gemma 2+ read `hidden_activation` (a `hidden_act` beside it is ignored, as in
        // transformers).
        let act_name = cfg.get(quirks.act_key).and_then(Value::as_str).unwrap_or(quirks.default_act);
        let hidden_act = Activation::from_hf(act_name)
            .ok_or_else(|| err(format!("activation '{act_name}' is not supported (silu, gelu_pytorch_tanh, gelu)")))?;
        if cfg.get("mlp_bias").and_then(Value::as_bool) == Some(true) {
            return Err(err("mlp_bias = true is not supported".into()));
        }
        let max_position_embeddings = get_usize(cfg, "max_position_embeddings").unwrap_or(4096);
        let rope = rope_from_hf(cfg, quirks.default_theta, head_dim, max_position_embeddings).map_err(err)?;
        let sliding_window = match quirks.window {
            WindowRule::Never => None,
            WindowRule::Key => get_usize(cfg, "sliding_window"),
            // The dataclass default applies when the key is absent; an explicit null is no window.
            WindowRule::Default(default) => match cfg.get("sliding_window") {
                None => Some(default),
                Some(v) => v.as_u64().map(|w| w as usize),
            },
            WindowRule::QwenFlag if cfg.get("use_sliding_window").and_then(Value::as_bool) == Some(true) => {
                return Err(err(format!("use_sliding_window = true is not supported for {}", arch.name)));
            }
            WindowRule::QwenFlag => None,
        };
        let config = ModelConfig {
            arch,
            vocab_size: req("vocab_size")?,
            hidden_size,
            intermediate_size: req("intermediate_size")?,
            num_layers: req("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: get_f64(cfg, "rms_norm_eps").unwrap_or(1e-6) as f32,
            rope,
            max_position_embeddings,
            hidden_act,
            tie_word_embeddings: cfg.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(quirks.tie_default),
            qkv_bias: quirks.qkv_bias || cfg.get("attention_bias").and_then(Value::as_bool).unwrap_or(false),
            qk_norm: quirks.qk_norm,
            sliding_window,
            bos_token_id: token_ids(cfg.get("bos_token_id")).first().copied(),
            eos_token_ids: token_ids(cfg.get("eos_token_id")),
        };
        config.validate().map_err(err)?;
        Ok(config)
    }

    /// Read the config from GGUF metadata (`{arch}.*` keys).
    pub fn from_gguf(g: &GgufFile) -> Result<ModelConfig> {
        let path = g.path();
        let arch_name = g.architecture()?;
        let arch = families::from_gguf(arch_name).ok_or_else(|| {
            LoadError::format(
                path,
                format!("unsupported architecture '{arch_name}' (supported in GGUF: {})", families::supported(true)),
            )
        })?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let req = |k: &str| g.require_u64(&key(k)).map(|v| v as usize);
        let hidden_size = req("embedding_length")?;
        let num_heads = req("attention.head_count")?;
        let num_kv_heads = g.get_u64(&key("attention.head_count_kv")).map(|v| v as usize).unwrap_or(num_heads);
        let head_dim =
            g.get_u64(&key("attention.key_length")).map(|v| v as usize).unwrap_or(hidden_size / num_heads.max(1));
        let max_position_embeddings = req("context_length")?;
        let vocab_size = match g.get_u64(&key("vocab_size")) {
            Some(v) => v as usize,
            None => g.tensor_info("token_embd.weight").map(|t| t.shape()[0]).ok_or_else(|| {
                LoadError::tensor(path, "token_embd.weight", "missing (needed for the vocabulary size)")
            })?,
        };
        let theta = g.get_f64(&key("rope.freq_base")).unwrap_or(10000.0);
        let rotary_dim = g.get_u64(&key("rope.dimension_count")).map(|v| v as usize).unwrap_or(head_dim);
        let kind = match g.get_str(&key("rope.scaling.type")) {
            None | Some("none") => RopeKind::Default,
            Some("linear") => RopeKind::Linear { factor: g.get_f64(&key("rope.scaling.factor")).unwrap_or(1.0) },
            Some("yarn") => RopeKind::Yarn {
                factor: g.get_f64(&key("rope.scaling.factor")).unwrap_or(1.0),
                original_max_position_embeddings: g
                    .get_u64(&key("rope.scaling.original_context_length"))
                    .map(|v| v as usize)
                    .unwrap_or(max_position_embeddings),
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: None,
                mscale: None,
                mscale_all_dim: None,
                truncate: true,
            },
            Some(other) => {
                return Err(LoadError::format(path, format!("rope scaling type '{other}' is not supported")))
            }
        };
        // llama.cpp bakes llama3-style scaling into per-frequency divisors.
        let kind = match (kind, g.tensor_info("rope_freqs.weight")) {
            (RopeKind::Default, Some(_)) => {
                let factors = g.tensor("rope_freqs.weight")?.to_f32_vec()?;
                if factors.len() != rotary_dim / 2 {
                    return Err(LoadError::tensor(
                        path,
                        "rope_freqs.weight",
                        format!("{} values, expected {}", factors.len(), rotary_dim / 2),
                    ));
                }
                RopeKind::FreqFactors { factors: factors.into_iter().map(f64::from).collect() }
            }
            (kind, _) => kind,
        };
        let config = ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size: req("feed_forward_length")?,
            num_layers: req("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: g.get_f64(&key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5) as f32,
            rope: RopeScaling { theta, rotary_dim, kind },
            max_position_embeddings,
            hidden_act: Activation::from_hf(arch.quirks.default_act).unwrap_or(Activation::Silu),
            tie_word_embeddings: g.tensor_info("output.weight").is_none(),
            qkv_bias: g.tensor_info("blk.0.attn_q.bias").is_some(),
            qk_norm: g.tensor_info("blk.0.attn_q_norm.weight").is_some(),
            // llama.cpp: Gemma 2 defaults to 4096; Gemma 3 without a window has none.
            sliding_window: match (arch.quirks.gguf_window, g.get_u64(&key("attention.sliding_window"))) {
                (None, _) => None,
                (Some(default), Some(0) | None) => default,
                (Some(_), Some(w)) => Some(w as usize),
            },
            bos_token_id: g.get_u64("tokenizer.ggml.bos_token_id").map(|v| v as u32),
            eos_token_ids: g.get_u64("tokenizer.ggml.eos_token_id").map(|v| vec![v as u32]).unwrap_or_default(),
        };
        config.validate().map_err(|m| LoadError::format(path, m))?;
        Ok(config)
    }

    /// The longest sequence the model handles: its trained context, stretched by dynamic
    /// NTK scaling (which exists to run past `max_position_embeddings`).
    pub fn max_context(&self) -> usize {
        match self.rope.kind {
            RopeKind::Dynamic { factor, .. } => (self.max_position_embeddings as f64 * factor.max(1.0)) as usize,
            _ => self.max_position_embeddings,
        }
    }

    /// Every value in the range a working model has: a corrupt or hostile config is a clear
    /// error at load rather than NaN logits (or a context nothing fits in) at serve time.
    fn validate(&self) -> std::result::Result<(), String> {
        // (name, value, most): zero is never valid; the upper bounds are far above every
        // published model and keep the products of shapes (weights, KV cache) from overflowing.
        let sizes = [
            ("vocab_size", self.vocab_size, 1 << 24),
            ("hidden_size", self.hidden_size, 1 << 17),
            ("intermediate_size", self.intermediate_size, 1 << 20),
            ("num_hidden_layers", self.num_layers, 1 << 12),
            ("num_attention_heads", self.num_heads, 1 << 12),
            ("num_key_value_heads", self.num_kv_heads, 1 << 12),
            ("head_dim", self.head_dim, 1 << 12),
        ];
        for (key, value, most) in sizes {
            if value == 0 || value > most {
                return Err(format!("{key} is {value} (expected 1 to {most})"));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !(MIN_CONTEXT..=MAX_CONTEXT).contains(&self.max_position_embeddings) {
            return Err(format!(
                "context length (max_position_embeddings) is {} (expected {MIN_CONTEXT} to {MAX_CONTEXT})",
                self.max_position_embeddings
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0) {
            return Err(format!("rms_norm_eps is {} (expected a number in (0, 1))", self.rms_norm_eps));
        }
        if self.sliding_window == Some(0) {
            return Err("sliding_window is 0 (expected a positive window or none)".into());
        }
        if self.rope.rotary_dim > self.head_dim {
            return Err(format!("rotary dim {} does not fit head_dim {}", self.rope.rotary_dim, self.head_dim));
        }
        check_rope(&self.rope)
    }
}

/// The shortest context a model may declare: room for a prompt and a reply.
const MIN_CONTEXT: usize = 16;
/// The longest (2^24 positions, past every published model).
const MAX_CONTEXT: usize = 1 << 24;

/// A RoPE schedule whose every parameter gives finite frequencies: a positive even rotary
/// dim, a base above 1, scaling factors finite and positive.
pub(crate) fn check_rope(rope: &RopeScaling) -> std::result::Result<(), String> {
    if rope.rotary_dim == 0 || !rope.rotary_dim.is_multiple_of(2) {
        return Err(format!(
            "rotary dim (rope dimension count) is {} (expected a positive even number)",
            rope.rotary_dim
        ));
    }
    if !(rope.theta.is_finite() && rope.theta > 1.0) {
        return Err(format!("rope theta (freq_base) is {} (expected a finite number above 1)", rope.theta));
    }
    let positive = |name: &str, v: f64| {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(format!("rope {name} is {v} (expected a finite positive number)"))
        }
    };
    let context = |name: &str, v: usize| {
        if (1..=MAX_CONTEXT).contains(&v) {
            Ok(())
        } else {
            Err(format!("rope {name} is {v} (expected 1 to {MAX_CONTEXT})"))
        }
    };
    match &rope.kind {
        RopeKind::Default => Ok(()),
        RopeKind::Linear { factor } | RopeKind::Proportional { factor, .. } => positive("factor", *factor),
        RopeKind::Dynamic { factor, max_position_embeddings } => {
            positive("factor", *factor)?;
            context("max_position_embeddings", *max_position_embeddings)
        }
        RopeKind::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            positive("factor", *factor)?;
            positive("low_freq_factor", *low_freq_factor)?;
            positive("high_freq_factor", *high_freq_factor)?;
            if high_freq_factor <= low_freq_factor {
                return Err(format!(
                    "rope high_freq_factor {high_freq_factor} is not above low_freq_factor {low_freq_factor}"
                ));
            }
            context("original_max_position_embeddings", *original_max_position_embeddings)
        }
        RopeKind::FreqFactors { factors } => {
            factors.iter().try_for_each(|&f| positive("frequency factor (rope_freqs.weight)", f))
        }
        RopeKind::LongRope { short, long, original_max_position_embeddings, attention_factor } => {
            short.iter().chain(long).try_for_each(|&f| positive("long-rope factor", f))?;
            positive("attention_factor", *attention_factor)?;
            context("original_max_position_embeddings", *original_max_position_embeddings)
        }
        RopeKind::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            mscale,
            mscale_all_dim,
            ..
        } => {
            positive("factor", *factor)?;
            positive("beta_fast", *beta_fast)?;
            positive("beta_slow", *beta_slow)?;
            for (name, v) in
                [("attention_factor", attention_factor), ("mscale", mscale), ("mscale_all_dim", mscale_all_dim)]
            {
                if let Some(v) = v.filter(|v| !v.is_finite()) {
                    return Err(format!("rope {name} is {v} (expected a finite number)"));
                }
            }
            context("original_max_position_embeddings", *original_max_position_embeddings)
        }
    }
}

/// RoPE settings from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`; for
/// a per-layer-type `rope_parameters` (Gemma 3), those of the full-attention layers.
fn rope_from_hf(
    cfg: &Value,
    default_theta: f64,
    head_dim: usize,
    max_pos: usize,
) -> std::result::Result<RopeScaling, String> {
    let empty = Value::Object(Default::default());
    let params = cfg
        .get("rope_parameters")
        .filter(|v| v.is_object())
        .or_else(|| cfg.get("rope_scaling").filter(|v| v.is_object()))
        .unwrap_or(&empty);
    let params = params.get(LayerType::Full.hf_name()).unwrap_or(params);
    rope_from_params(params, cfg, default_theta, head_dim, max_pos)
}

/// One RoPE parameter dict (`rope_type`, `rope_theta`, `factor`, ...), with fallbacks from the
/// top level of the config `top`. As in transformers, `default` ignores `partial_rotary_factor`.
pub(crate) fn rope_from_params(
    params: &Value,
    top: &Value,
    default_theta: f64,
    head_dim: usize,
    max_pos: usize,
) -> std::result::Result<RopeScaling, String> {
    let theta = get_f64(params, "rope_theta").or_else(|| get_f64(top, "rope_theta")).unwrap_or(default_theta);
    let partial =
        get_f64(params, "partial_rotary_factor").or_else(|| get_f64(top, "partial_rotary_factor")).unwrap_or(1.0);
    let rope_type = params.get("rope_type").or_else(|| params.get("type")).and_then(Value::as_str).unwrap_or("default");
    let rotary_dim = match rope_type {
        "default" | "proportional" => head_dim,
        _ => (head_dim as f64 * partial) as usize,
    };
    let factor = || get_f64(params, "factor").ok_or_else(|| format!("rope type '{rope_type}' needs 'factor'"));
    let original = get_usize(params, "original_max_position_embeddings")
        .or_else(|| get_usize(top, "original_max_position_embeddings"))
        .unwrap_or(max_pos);
    let kind = match rope_type {
        "default" => RopeKind::Default,
        "linear" => RopeKind::Linear { factor: factor()? },
        "dynamic" => RopeKind::Dynamic { factor: factor()?, max_position_embeddings: max_pos },
        "llama3" => RopeKind::Llama3 {
            factor: factor()?,
            low_freq_factor: get_f64(params, "low_freq_factor").ok_or("llama3 rope needs low_freq_factor")?,
            high_freq_factor: get_f64(params, "high_freq_factor").ok_or("llama3 rope needs high_freq_factor")?,
            original_max_position_embeddings: original,
        },
        "yarn" => RopeKind::Yarn {
            factor: get_f64(params, "factor").unwrap_or(max_pos as f64 / original as f64),
            original_max_position_embeddings: original,
            beta_fast: get_f64(params, "beta_fast").unwrap_or(32.0),
            beta_slow: get_f64(params, "beta_slow").unwrap_or(1.0),
            attention_factor: get_f64(params, "attention_factor"),
            mscale: get_f64(params, "mscale"),
            mscale_all_dim: get_f64(params, "mscale_all_dim"),
            truncate: params.get("truncate").and_then(Value::as_bool).unwrap_or(true),
        },
        "longrope" => {
            let factors = |key: &str| -> std::result::Result<Vec<f64>, String> {
                let list = params.get(key).and_then(Value::as_array).ok_or(format!("longrope needs '{key}'"))?;
                let values: Option<Vec<f64>> = list.iter().map(Value::as_f64).collect();
                values
                    .filter(|v| v.len() == rotary_dim / 2 && v.iter().all(|f| f.is_finite() && *f > 0.0))
                    .ok_or_else(|| format!("longrope '{key}' must hold {} positive numbers", rotary_dim / 2))
            };
            // A top-level `original_max_position_embeddings` (as Phi-3 writes it) wins.
            let original = get_usize(top, "original_max_position_embeddings")
                .or_else(|| get_usize(params, "original_max_position_embeddings"))
                .unwrap_or(max_pos);
            let factor = get_f64(params, "factor").unwrap_or(max_pos as f64 / original as f64);
            let attention_factor = get_f64(params, "attention_factor").unwrap_or(if factor <= 1.0 {
                1.0
            } else {
                (1.0 + factor.ln() / (original as f64).ln()).sqrt()
            });
            RopeKind::LongRope {
                short: factors("short_factor")?,
                long: factors("long_factor")?,
                original_max_position_embeddings: original,
                attention_factor,
            }
        }
        // `int(partial * head_dim // 2)` rotated pairs, as transformers computes it.
        "proportional" => RopeKind::Proportional {
            factor: get_f64(params, "factor").unwrap_or(1.0),
            rope_angles: (partial * head_dim as f64 / 2.0).floor() as usize,
        },
        other => {
            return Err(format!(
                "rope type '{other}' is not supported (default, linear, dynamic, llama3, yarn, longrope, proportional)"
            ))
        }
    };
    let rope = RopeScaling { theta, rotary_dim, kind };
    check_rope(&rope)?;
    Ok(rope)
}

/// The text model's config of a multimodal checkpoint ferrite runs as a text model alone:
/// Qwen3.5's `qwen3_5` wraps a `text_config` (its weights sit under `model.language_model.`,
/// which `Weights` reads as `model.`); the wrapper's `tie_word_embeddings` and token ids apply
/// where the text config has none. Any other config is returned as it is.
pub fn text_config(json: Value) -> Value {
    const WRAPPERS: [&str; 2] = ["qwen3_5", "qwen3_5_moe"];
    let wrapped = json.get("model_type").and_then(Value::as_str).is_some_and(|t| WRAPPERS.contains(&t));
    match json.get("text_config") {
        Some(Value::Object(text)) if wrapped => {
            let mut text = text.clone();
            for key in ["tie_word_embeddings", "bos_token_id", "eos_token_id"] {
                if let (false, Some(v)) = (text.contains_key(key), json.get(key)) {
                    text.insert(key.into(), v.clone());
                }
            }
            Value::Object(text)
        }
        _ => json,
    }
}

/// The raw description a `ModelConfig` was read from, for the settings only one architecture's
/// module reads (Gemma's layer types, softcaps, per-layer shapes, ...).
pub enum ConfigSource<'a> {
    Hf { path: &'a Path, json: &'a Value },
    Gguf(&'a GgufFile),
}

impl ConfigSource<'_> {
    /// A load error about this config.
    pub fn error(&self, message: impl Into<String>) -> LoadError {
        match self {
            ConfigSource::Hf { path, .. } => LoadError::format(path, message),
            ConfigSource::Gguf(g) => LoadError::format(g.path(), message),
        }
    }
}
