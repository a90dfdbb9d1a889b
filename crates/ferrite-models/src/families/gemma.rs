//! Gemma 1, 2 and 3 (`gemma`, `gemma2`, `gemma3_text`; GGUF `gemma`, `gemma2`, `gemma3`).
//!
//! Llama-shaped decoders with `sqrt(hidden)`-scaled embeddings, `(1 + w)` RMSNorm and a GeGLU
//! MLP. From Gemma 2 on, each sublayer's output is normed too (four norms per layer), layers
//! alternate between sliding-window and global attention (`layer_types`, every 2nd layer global
//! in Gemma 2, every 6th in Gemma 3) and the attention scale is `query_pre_attn_scalar^-0.5`.
//! Gemma 2 softcaps attention scores and final logits; Gemma 3 adds q/k norms and gives local
//! and global layers their own RoPE (`rope_local_base_freq`, scaling on global layers only).
//! A Gemma 3 with `use_bidirectional_attention` (EmbeddingGemma) attends both ways: global
//! layers see the whole input, sliding layers the positions less than `sliding_window / 2 + 1`
//! away on either side (transformers halves the configured window for it).

use ferrite_runtime::cpu::AttentionParams;
use ferrite_runtime::KvGroupKind;
use serde_json::Value;

use crate::blocks::{self, AttentionConfig, LayerKv};
use crate::config::{get_f64, get_usize, rope_from_params, ConfigSource, LayerType, ModelConfig};
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::plan::{DecoderPlan, FfnPlan, InputKind, LayerNames, LayerPlan, NormKind};
use crate::rope_scaling::{RopeKind, RopeScaling};

/// Which Gemma.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gen {
    Gemma,
    Gemma2,
    Gemma3,
}

pub fn plan_gemma(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    plan(cfg, src, Gen::Gemma)
}

pub fn plan_gemma2(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    plan(cfg, src, Gen::Gemma2)
}

pub fn plan_gemma3(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    plan(cfg, src, Gen::Gemma3)
}

/// The Gemma settings beyond `ModelConfig`.
struct Settings {
    layer_types: Vec<LayerType>,
    query_pre_attn_scalar: f64,
    attn_softcap: Option<f32>,
    final_softcap: Option<f32>,
    /// RoPE of the sliding-window layers (`ModelConfig::rope` is the global layers').
    local_rope: RopeScaling,
    /// Bidirectional (non-causal) attention (`use_bidirectional_attention`, Gemma 3 only).
    bidirectional: bool,
}

/// An optional positive float: absent → `default`, null → none.
fn cap(json: &Value, key: &str, default: Option<f64>) -> Option<f32> {
    match json.get(key) {
        None => default,
        Some(v) => v.as_f64(),
    }
    .map(|c| c as f32)
    .filter(|c| *c > 0.0 && c.is_finite())
}

impl Settings {
    fn from_hf(cfg: &ModelConfig, gen: Gen, json: &Value) -> std::result::Result<Settings, String> {
        let n = cfg.num_layers;
        let bidirectional = json.get("use_bidirectional_attention").is_some_and(|v| v.as_bool() == Some(true));
        if bidirectional && gen != Gen::Gemma3 {
            return Err("use_bidirectional_attention = true is read for gemma3_text only".into());
        }
        let (default_types, default_final) = match gen {
            Gen::Gemma => (vec![LayerType::Full; n], None),
            Gen::Gemma2 => (LayerType::pattern(n, 2), Some(30.0)),
            _ => {
                let pattern =
                    ["sliding_window_pattern", "_sliding_window_pattern"].iter().find_map(|k| get_usize(json, k));
                (LayerType::pattern(n, pattern.unwrap_or(6)), None)
            }
        };
        let local_rope = match gen {
            // Gemma 3: `rope_parameters.sliding_attention`, or `rope_local_base_freq` (1e4).
            Gen::Gemma3 => {
                let empty = Value::Object(Default::default());
                let per_type = json.get("rope_parameters").filter(|p| p.as_object().is_some_and(|o| !o.is_empty()));
                if per_type.is_some_and(|p| p.get(LayerType::Full.hf_name()).is_none()) {
                    return Err(
                        "gemma3_text needs rope_parameters per layer type (full_attention, sliding_attention)".into()
                    );
                }
                let params = per_type.and_then(|p| p.get(LayerType::Sliding.hf_name())).unwrap_or(&empty);
                let theta = get_f64(json, "rope_local_base_freq").unwrap_or(10_000.0);
                rope_from_params(params, &empty, theta, cfg.head_dim, cfg.max_position_embeddings)?
            }
            _ => cfg.rope.clone(),
        };
        Ok(Settings {
            layer_types: LayerType::list_from_hf(json, n, default_types)?,
            query_pre_attn_scalar: match gen {
                Gen::Gemma => cfg.head_dim as f64,
                _ => get_f64(json, "query_pre_attn_scalar").unwrap_or(256.0),
            },
            // Gemma 3 drops attention softcapping: transformers ignores the key.
            attn_softcap: match gen {
                Gen::Gemma2 => cap(json, "attn_logit_softcapping", Some(50.0)),
                _ => None,
            },
            final_softcap: match gen {
                Gen::Gemma => None,
                _ => cap(json, "final_logit_softcapping", default_final),
            },
            local_rope,
            bidirectional,
        })
    }

    /// As llama.cpp reads a Gemma GGUF.
    fn from_gguf(cfg: &ModelConfig, gen: Gen, g: &GgufFile) -> std::result::Result<Settings, String> {
        let n = cfg.num_layers;
        let arch = g.architecture().map_err(|e| e.to_string())?;
        let key = |k: &str| format!("{arch}.{k}");
        let layer_types = match (gen, cfg.sliding_window) {
            (Gen::Gemma, _) | (Gen::Gemma3, None) => vec![LayerType::Full; n],
            (_, _) => gguf_layer_types(
                g,
                &key("attention.sliding_window_pattern"),
                n,
                if gen == Gen::Gemma2 { 2 } else { 6 },
            )?,
        };
        // The 27B models scale by hidden / heads, the others by head_dim (gemma_pytorch's
        // query_pre_attn_scalar, which the GGUF does not carry).
        let is_27b = matches!((gen, n), (Gen::Gemma2, 46) | (Gen::Gemma3, 62));
        let scalar = if is_27b { (cfg.hidden_size / cfg.num_heads) as f64 } else { cfg.head_dim as f64 };
        let local_theta = g.get_f64(&key("rope.freq_base_swa"));
        let local_rope = match gen {
            Gen::Gemma3 => RopeScaling {
                theta: local_theta.unwrap_or(10_000.0),
                rotary_dim: cfg.head_dim,
                kind: RopeKind::Default,
            },
            _ => RopeScaling { theta: local_theta.unwrap_or(cfg.rope.theta), ..cfg.rope.clone() },
        };
        crate::config::check_rope(&local_rope)?;
        let float = |k: &str| g.get_f64(&key(k)).map(|c| c as f32).filter(|c| *c > 0.0 && c.is_finite());
        Ok(Settings {
            layer_types,
            query_pre_attn_scalar: scalar,
            attn_softcap: match gen {
                Gen::Gemma2 => Some(float("attn_logit_softcapping").unwrap_or(50.0)),
                _ => None,
            },
            final_softcap: match gen {
                Gen::Gemma2 => Some(float("final_logit_softcapping").unwrap_or(30.0)),
                Gen::Gemma3 => float("final_logit_softcapping"),
                _ => None,
            },
            local_rope,
            bidirectional: false,
        })
    }
}

/// `{arch}.attention.sliding_window_pattern`: per-layer bools (true = sliding), or every n-th
/// layer global (`default` when absent).
fn gguf_layer_types(g: &GgufFile, key: &str, n: usize, default: usize) -> std::result::Result<Vec<LayerType>, String> {
    let Some(v) = g.get(key) else { return Ok(LayerType::pattern(n, default)) };
    if let Some(pattern) = v.as_u64() {
        return Ok(LayerType::pattern(n, pattern as usize));
    }
    let list =
        v.as_array().filter(|a| a.len() == n).ok_or_else(|| format!("{key} is neither a number nor {n} bools"))?;
    list.iter()
        .map(|b| b.as_bool().map(|s| if s { LayerType::Sliding } else { LayerType::Full }))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| format!("{key} holds a non-bool"))
}

/// The plan of a Gemma 1/2/3 config.
fn plan(cfg: &ModelConfig, src: &ConfigSource, gen: Gen) -> Result<DecoderPlan> {
    let s = match src {
        ConfigSource::Hf { json, .. } => Settings::from_hf(cfg, gen, json),
        ConfigSource::Gguf(g) => Settings::from_gguf(cfg, gen, g),
    }
    .map_err(|m| src.error(m))?;
    // The weights hold `w` of a `(1 + w)` norm.
    let (eps, offset) = (cfg.rms_norm_eps, 1.0);
    let window = |t: LayerType| match (t, cfg.sliding_window) {
        (LayerType::Sliding, Some(w)) if s.bidirectional => Ok(Some(w / 2 + 1)),
        (LayerType::Sliding, Some(w)) => Ok(Some(w)),
        (LayerType::Sliding, None) => Err(src.error("sliding_attention layers need a sliding_window")),
        (LayerType::Full, _) => Ok(None),
    };
    let mut kv_layers = Vec::with_capacity(cfg.num_layers);
    for &t in &s.layer_types {
        let kind = window(t)?.map_or(KvGroupKind::Full, |window| KvGroupKind::Sliding { window });
        kv_layers.push(LayerKv::Own { kind, n_kv_heads: cfg.num_kv_heads, head_dim: cfg.head_dim });
    }
    let (layout, _) = blocks::kv_layout(&kv_layers).map_err(|m| src.error(m))?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for (i, &t) in s.layer_types.iter().enumerate() {
        let attn = AttentionConfig {
            params: AttentionParams {
                n_heads: cfg.num_heads,
                n_kv_heads: cfg.num_kv_heads,
                head_dim: cfg.head_dim,
                scale: s.query_pre_attn_scalar.powf(-0.5) as f32,
                window: window(t)?,
                softcap: s.attn_softcap,
                causal: !s.bidirectional,
            },
            rope: if t == LayerType::Sliding { s.local_rope.clone() } else { cfg.rope.clone() },
            bias: cfg.qkv_bias,
            qk_norm: cfg.qk_norm.then_some(offset),
            qk_norm_whole: false,
            o_bias: false,
            v_norm: false,
            k_eq_v: false,
            shared: false,
            kv_index: i,
            eps,
            output_gate: false,
            linear: None,
        };
        let ffn = FfnPlan { act: cfg.hidden_act, intermediate: cfg.intermediate_size, bias: false, moe: None };
        // Gemma 1 is pre-norm; from Gemma 2 on each sublayer's output is normed too.
        let names = if gen == Gen::Gemma { LayerNames::llama(i) } else { LayerNames::sandwich(i) };
        layers.push(LayerPlan { attn, ffn, names });
    }
    Ok(DecoderPlan {
        layers,
        layout,
        input: InputKind::Tokens,
        norm: NormKind::Rms { offset },
        eps,
        final_norm: Some("model.norm".into()),
        embed_scale: Some((cfg.hidden_size as f64).sqrt() as f32),
        residual_scale: None,
        logit_scale: None,
        final_softcap: s.final_softcap,
        per_layer_input: None,
        layer_scalar: false,
        interleaved_rope: false,
    })
}
