//! Qwen3.5 (`qwen3_5_text`; GGUF `qwen35`): a hybrid of gated DeltaNet linear attention and
//! gated full attention. Three of every four layers (`layer_types`, or every
//! `full_attention_interval`-th full) mix tokens with gated DeltaNet over a recurrent state
//! (`deltanet`, separate `in_proj_qkv`/`in_proj_z`/`in_proj_b`/`in_proj_a`); the others are
//! qwen3 attention (per-head q/k norms) with a sigmoid output gate from doubled q rows and
//! RoPE on the first `partial_rotary_factor` (default 1/4) of each head. Every RMSNorm but the
//! DeltaNet output norm applies `1 + w`. Qwen3.5's multimodal RoPE sections coincide with plain
//! RoPE for text (every axis has the token's position), so text runs as plain RoPE.
//!
//! `hybrid` builds the plan Qwen3-Next (`qwen3_next`) shares. llama.cpp's files store the
//! decay as `−exp(A_log)`; its Qwen3.5 converter also stores the value heads tiled over the
//! key heads (`DeltaShape::tiled`) where there are more value heads than key heads.

use serde_json::Value;

use ferrite_runtime::cpu::gated_delta::DeltaShape;
use ferrite_runtime::KvGroupKind;

use super::sparse_moe::hf_count;
use crate::blocks::{kv_layout, LayerKv, StateShape};
use crate::config::{get_f64, ConfigSource, ModelConfig};
use crate::deltanet::{DecayParam, DeltaNetConfig, Packing};
use crate::error::Result;
use crate::plan::{DecoderPlan, NormKind};

/// The linear-attention settings of a hybrid config.
pub(super) struct Hybrid {
    /// Per layer, whether it is a gated DeltaNet layer.
    pub linear: Vec<bool>,
    pub shape: DeltaShape,
    pub conv_kernel: usize,
    pub qkvz: Packing,
    pub ba: Packing,
    pub decay: DecayParam,
}

pub fn plan(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    let settings = read(cfg, src, Packing::Split, Packing::Split)?;
    hybrid(cfg, &settings, src)
}

/// The hybrid settings of `src`; an HF file's projections are packed as `qkvz` and `ba` say.
/// In a GGUF file `in_proj_qkvz` is always split (llama.cpp's converter splits it) and the
/// value heads of a `qwen35` file are tiled.
pub(super) fn read(cfg: &mut ModelConfig, src: &ConfigSource, qkvz: Packing, ba: Packing) -> Result<Hybrid> {
    let n = cfg.num_layers;
    match src {
        ConfigSource::Hf { json, .. } => {
            let count = |k: &str, d: usize| hf_count(json, &[k], Some(d)).map_err(|m| src.error(m));
            let shape = DeltaShape {
                k_heads: count("linear_num_key_heads", 16)?,
                v_heads: count("linear_num_value_heads", 32)?,
                k_dim: count("linear_key_head_dim", 128)?,
                v_dim: count("linear_value_head_dim", 128)?,
                tiled: false,
            };
            let linear = layer_kinds(json, n).map_err(|m| src.error(m))?;
            set_partial_rotary(cfg, json);
            let conv_kernel = count("linear_conv_kernel_dim", 4)?;
            Ok(Hybrid { linear, shape, conv_kernel, qkvz, ba, decay: DecayParam::Log })
        }
        ConfigSource::Gguf(g) => {
            let arch = g.architecture()?.to_string();
            let key = |k: &str| g.require_u64(&format!("{arch}.{k}")).map(|v| v as usize);
            let (k_heads, v_heads) = (key("ssm.group_count")?, key("ssm.time_step_rank")?);
            let inner = key("ssm.inner_size")?;
            if v_heads == 0 || !inner.is_multiple_of(v_heads) {
                return Err(src.error(format!("ssm.inner_size {inner} is not a multiple of {v_heads} value heads")));
            }
            let shape = DeltaShape {
                k_heads,
                v_heads,
                k_dim: key("ssm.state_size")?,
                v_dim: inner / v_heads,
                tiled: arch == "qwen35" || arch == "qwen35moe",
            };
            // A layer is linear where the file has its decay.
            let linear = (0..n).map(|i| g.tensor_info(&format!("blk.{i}.ssm_a")).is_some()).collect();
            let ba = if arch == "qwen3next" { Packing::Grouped } else { Packing::Split };
            let conv_kernel = key("ssm.conv_kernel")?;
            Ok(Hybrid { linear, shape, conv_kernel, qkvz: Packing::Split, ba, decay: DecayParam::NegExp })
        }
    }
}

/// Which of the first `n` layers are linear: `layer_types`, else every
/// `full_attention_interval`-th (4) full (`n` may be below `num_hidden_layers` when a load keeps
/// only the first layers).
fn layer_kinds(json: &Value, n: usize) -> std::result::Result<Vec<bool>, String> {
    match json.get("layer_types").filter(|v| !v.is_null()) {
        Some(list) => {
            let list = list.as_array().ok_or("layer_types is not a list")?;
            let total = hf_count(json, &["num_hidden_layers"], Some(n))?;
            if list.len() != total || n > total {
                return Err(format!("layer_types has {} entries for {total} layers", list.len()));
            }
            list.iter()
                .take(n)
                .map(|t| match t.as_str() {
                    Some("linear_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(format!("layer type {t} is not supported (linear_attention, full_attention)")),
                })
                .collect()
        }
        None => {
            let every = hf_count(json, &["full_attention_interval"], Some(4))?.max(1);
            Ok((0..n).map(|i| !(i + 1).is_multiple_of(every)).collect())
        }
    }
}

/// RoPE turns the first `partial_rotary_factor` (default 1/4) of each head, whatever the RoPE
/// type (transformers' default RoPE of these models reads the factor too).
fn set_partial_rotary(cfg: &mut ModelConfig, json: &Value) {
    let params = json.get("rope_parameters").filter(|v| v.is_object());
    let partial = params
        .and_then(|p| get_f64(p, "partial_rotary_factor"))
        .or_else(|| get_f64(json, "partial_rotary_factor"))
        .unwrap_or(0.25);
    cfg.rope.rotary_dim = (cfg.head_dim as f64 * partial) as usize;
}

/// The hybrid plan of `cfg`: llama layers with `1 + w` norms, gated qwen3 attention on the full
/// layers and gated DeltaNet on the linear ones, whose states fill one recurrent KV group.
pub(super) fn hybrid(cfg: &ModelConfig, s: &Hybrid, src: &ConfigSource) -> Result<DecoderPlan> {
    if s.linear.len() != cfg.num_layers || s.linear.iter().all(|&l| l) {
        return Err(src.error("a hybrid model needs at least one full-attention layer"));
    }
    let channels = 2 * s.shape.k_heads * s.shape.k_dim + s.shape.v_heads * s.shape.v_dim;
    let state = StateShape {
        conv_channels: channels,
        conv_kernel: s.conv_kernel,
        heads: s.shape.v_heads,
        k_dim: s.shape.k_dim,
        v_dim: s.shape.v_dim,
    };
    let kinds: Vec<LayerKv> = (s.linear.iter())
        .map(|&linear| match linear {
            true => LayerKv::State(state),
            false => LayerKv::Own { kind: KvGroupKind::Full, n_kv_heads: cfg.num_kv_heads, head_dim: cfg.head_dim },
        })
        .collect();
    let (layout, index) = kv_layout(&kinds).map_err(|m| src.error(m))?;
    let mut plan = super::llama::base(cfg);
    plan.norm = NormKind::Rms { offset: 1.0 };
    plan.layout = layout;
    for (i, l) in plan.layers.iter_mut().enumerate() {
        let a = &mut l.attn;
        a.kv_index = index[i];
        a.qk_norm = Some(1.0);
        a.output_gate = true;
        if s.linear[i] {
            let c = DeltaNetConfig {
                shape: s.shape,
                conv_kernel: s.conv_kernel,
                state: index[i],
                eps: cfg.rms_norm_eps,
                prefix: format!("model.layers.{i}.linear_attn"),
                qkvz: s.qkvz,
                ba: s.ba,
                decay: s.decay,
            };
            c.check().map_err(|m| src.error(m))?;
            a.linear = Some(c);
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config(extra: Value) -> (ModelConfig, Value) {
        let mut j = json!({
            "model_type": "qwen3_5_text", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        });
        for (k, v) in extra.as_object().expect("object") {
            j[k] = v.clone();
        }
        let cfg = ModelConfig::from_hf_json(std::path::Path::new("config.json"), &j).expect("config");
        (cfg, j)
    }

    #[test]
    fn every_fourth_layer_is_full_and_the_rest_keep_state() {
        let (mut cfg, j) = config(json!({}));
        let src = ConfigSource::Hf { path: std::path::Path::new("config.json"), json: &j };
        let plan = plan(&mut cfg, &src).expect("plan");
        let linear: Vec<bool> = plan.layers.iter().map(|l| l.attn.linear.is_some()).collect();
        assert_eq!(linear, vec![true, true, true, false]);
        assert_eq!(plan.layout.groups, vec![KvGroupKind::Full, KvGroupKind::Recurrent]);
        assert_eq!(plan.layout.layers.len(), 1);
        assert_eq!(plan.layout.states.len(), 3);
        assert_eq!(plan.layout.states[0].conv_channels, 2 * 2 * 8 + 4 * 8);
        assert_eq!(cfg.rope.rotary_dim, 4, "a quarter of head_dim 16");
        assert!(plan.layers.iter().all(|l| l.attn.output_gate && l.attn.qk_norm == Some(1.0)));
        assert_eq!(plan.norm, NormKind::Rms { offset: 1.0 });
        // The CUDA executor runs it (DeltaNet layers, gated outputs).
        assert_eq!(crate::gpu::unsupported(&plan), None);
    }

    #[test]
    fn layer_types_and_bad_shapes() {
        let (mut cfg, j) = config(json!({
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        }));
        let src = ConfigSource::Hf { path: std::path::Path::new("config.json"), json: &j };
        let plan = plan(&mut cfg, &src).expect("plan");
        assert_eq!(plan.layers.iter().filter(|l| l.attn.linear.is_some()).count(), 2);
        let err = |extra: Value| {
            let (mut cfg, j) = config(extra);
            let src = ConfigSource::Hf { path: std::path::Path::new("config.json"), json: &j };
            super::plan(&mut cfg, &src).err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(err(json!({"layer_types": ["linear_attention"]})).contains("4 layers"));
        assert!(err(
            json!({"layer_types": ["linear_attention", "linear_attention", "linear_attention", "linear_attention"]})
        )
        .contains("full-attention"));
        assert!(err(json!({"linear_num_value_heads": 3})).contains("multiple"));
        assert!(err(json!({"layer_types": ["mamba", "full_attention", "full_attention", "full_attention"]}))
            .contains("not supported"));
    }
}
