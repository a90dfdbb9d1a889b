//! Gemma 4 text decoders (`gemma4_text`, as transformers 5.17 defines it).
//!
//! The Gemma 3 layer (scaled embeddings, four norms per layer, GeGLU, q/k norms, sliding and
//! global layers with their own RoPE) with plain `w` RMSNorm, an unscaled v norm, attention
//! scale 1 and a learned per-layer output scalar, plus:
//! - per-layer head shapes: global layers are wider (`global_head_dim`, stored by transformers
//!   as `per_layer_config`) and use `proportional` partial RoPE;
//! - KV-shared layers: the last `num_kv_shared_layers` layers compute no keys or values and
//!   read those of the last earlier layer of their attention type (the donor);
//! - `attention_k_eq_v`: global layers reuse the key projection as values;
//! - `use_double_wide_mlp`: the KV-shared layers have a 2× wider MLP;
//! - per-layer inputs (`hidden_size_per_layer_input`): a second embedding table plus a
//!   projection of the embeddings feed each layer a small gated residual;
//! - the MoE block (`enable_moe_block`): a routed top-k mixture of GeGLU experts beside the
//!   dense MLP of every layer (`MoeStyle::Gemma4`, see `moe`).
//!
//! Every key of the config is checked: an unknown or unsupported setting is a load error.

use ferrite_runtime::cpu::AttentionParams;
use ferrite_runtime::KvGroupKind;
use serde_json::Value;

use crate::blocks::{self, AttentionConfig, LayerKv};
use crate::config::{get_usize, rope_from_params, ConfigSource, LayerType, ModelConfig};
use crate::error::Result;
use crate::moe::MoeShape;
use crate::plan::{DecoderPlan, ExpertNames, FfnPlan, InputKind, LayerNames, LayerPlan, MoePlan, MoeStyle, NormKind};
use crate::rope_scaling::RopeScaling;

/// Every `Gemma4TextConfig` key (and the generic `PreTrainedConfig` ones) ferrite understands;
/// those not read below change nothing at inference.
#[rustfmt::skip]
const KNOWN_KEYS: &[&str] = &[
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_activation", "max_position_embeddings", "initializer_range",
    "rms_norm_eps", "use_cache", "pad_token_id", "eos_token_id", "bos_token_id", "tie_word_embeddings",
    "rope_parameters", "attention_bias", "attention_dropout", "sliding_window", "layer_types",
    "final_logit_softcapping", "use_bidirectional_attention", "vocab_size_per_layer_input",
    "hidden_size_per_layer_input", "attention_k_eq_v", "num_kv_shared_layers", "enable_moe_block",
    "use_double_wide_mlp", "num_experts", "top_k_experts", "moe_intermediate_size", "global_head_dim",
    "num_global_key_value_heads", "per_layer_config",
    // PreTrainedConfig
    "model_type", "transformers_version", "architectures", "output_hidden_states", "output_attentions",
    "return_dict", "dtype", "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
    "label2id", "problem_type", "_name_or_path",
];

/// One layer's attention shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    head_dim: usize,
    n_kv_heads: usize,
}

/// The Gemma 4 settings beyond `ModelConfig`.
struct Settings {
    layer_types: Vec<LayerType>,
    /// The window of the sliding layers.
    window: Option<usize>,
    shapes: Vec<Shape>,
    ropes: Vec<RopeScaling>,
    /// Per layer: the donor whose KV a shared layer reads.
    donors: Vec<Option<usize>>,
    final_softcap: Option<f32>,
    k_eq_v: bool,
    double_wide: bool,
    /// (vocab, width) of the per-layer inputs.
    per_layer_input: Option<(usize, usize)>,
    moe: Option<MoeShape>,
}

fn flag(json: &Value, key: &str) -> std::result::Result<bool, String> {
    match json.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(v) => v.as_bool().ok_or_else(|| format!("{key} is not a bool")),
    }
}

fn positive(json: &Value, key: &str) -> std::result::Result<usize, String> {
    get_usize(json, key).filter(|&v| v > 0).ok_or_else(|| format!("{key} must be a positive integer"))
}

impl Settings {
    fn from_hf(cfg: &ModelConfig, json: &Value) -> std::result::Result<Settings, String> {
        let obj = json.as_object().ok_or("config.json is not an object")?;
        if let Some(k) = obj.keys().find(|k| !KNOWN_KEYS.contains(&k.as_str())) {
            return Err(format!("config key '{k}' is not supported for gemma4_text"));
        }
        match json.get("use_bidirectional_attention").and_then(Value::as_str) {
            Some("all") => return Err("use_bidirectional_attention = \"all\" is not supported".into()),
            // "vision" only changes how image tokens attend: text is causal.
            None | Some("vision") => {}
            Some(other) => return Err(format!("use_bidirectional_attention = {other:?} is not supported")),
        }
        let n = cfg.num_layers;
        let mut layer_types = LayerType::list_from_hf(json, n, LayerType::pattern(n, 6))?;
        // transformers forces the last layer to full attention (with a warning).
        if let Some(last) = layer_types.last_mut() {
            *last = LayerType::Full;
        }
        if cfg.sliding_window.is_none() && layer_types.contains(&LayerType::Sliding) {
            return Err("sliding_attention layers need a sliding_window".into());
        }
        let shapes = layer_shapes(cfg, json, &layer_types)?;
        let ropes = layer_types
            .iter()
            .zip(&shapes)
            .map(|(&t, s)| layer_rope(json, t, s.head_dim, cfg.max_position_embeddings))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let shared = get_usize(json, "num_kv_shared_layers").unwrap_or(0);
        let first_shared = n.checked_sub(shared).ok_or("num_kv_shared_layers is larger than num_hidden_layers")?;
        let donors = (0..n)
            .map(|i| {
                if i < first_shared {
                    return Ok(None);
                }
                let donor = (0..first_shared).rev().find(|&j| layer_types[j] == layer_types[i]);
                donor.map(Some).ok_or_else(|| {
                    format!("KV-shared layer {i} has no earlier {} layer to read", layer_types[i].hf_name())
                })
            })
            .collect::<std::result::Result<Vec<_>, String>>()?;
        let ple_width = get_usize(json, "hidden_size_per_layer_input").unwrap_or(0);
        let per_layer_input = if ple_width > 0 {
            Some((get_usize(json, "vocab_size_per_layer_input").unwrap_or(cfg.vocab_size), ple_width))
        } else {
            None
        };
        let moe = if flag(json, "enable_moe_block")? {
            let shape = MoeShape {
                num_experts: positive(json, "num_experts")?,
                top_k: positive(json, "top_k_experts")?,
                intermediate: positive(json, "moe_intermediate_size")?,
            };
            if shape.top_k > shape.num_experts {
                return Err(format!("top_k_experts {} > num_experts {}", shape.top_k, shape.num_experts));
            }
            Some(shape)
        } else {
            None
        };
        Ok(Settings {
            layer_types,
            window: cfg.sliding_window,
            shapes,
            ropes,
            donors,
            final_softcap: json
                .get("final_logit_softcapping")
                .and_then(Value::as_f64)
                .filter(|c| *c > 0.0)
                .map(|c| c as f32),
            k_eq_v: flag(json, "attention_k_eq_v")?,
            double_wide: flag(json, "use_double_wide_mlp")?,
            per_layer_input,
            moe,
        })
    }
}

impl Settings {
    /// The attention window of a layer of type `t`.
    fn window(&self, t: LayerType) -> Option<usize> {
        self.window.filter(|_| t == LayerType::Sliding)
    }

    /// What each layer needs from the KV cache: its own (by type and shape) or its donor's.
    fn kv_plan(&self) -> Vec<LayerKv> {
        (0..self.layer_types.len())
            .map(|i| match self.donors[i] {
                Some(donor) => LayerKv::Donor(donor),
                None => LayerKv::Own {
                    kind: self
                        .window(self.layer_types[i])
                        .map_or(KvGroupKind::Full, |window| KvGroupKind::Sliding { window }),
                    n_kv_heads: self.shapes[i].n_kv_heads,
                    head_dim: self.shapes[i].head_dim,
                },
            })
            .collect()
    }
}

/// Head shapes per layer: `per_layer_config` overrides (as transformers saves them), else
/// `global_head_dim` (default 512) and, with `attention_k_eq_v`, `num_global_key_value_heads`
/// on the full-attention layers.
fn layer_shapes(cfg: &ModelConfig, json: &Value, types: &[LayerType]) -> std::result::Result<Vec<Shape>, String> {
    let base = Shape { head_dim: cfg.head_dim, n_kv_heads: cfg.num_kv_heads };
    let mut shapes = vec![base; types.len()];
    match json.get("per_layer_config").filter(|v| !v.is_null()) {
        Some(per_layer) => {
            let map = per_layer.as_object().ok_or("per_layer_config is not an object")?;
            for (idx, over) in map {
                let i: usize = idx
                    .parse()
                    .ok()
                    .filter(|&i| i < types.len())
                    .ok_or_else(|| format!("per_layer_config key '{idx}' is not a layer"))?;
                let over = over.as_object().ok_or("per_layer_config entries must be objects")?;
                for (k, v) in over {
                    let v = v
                        .as_u64()
                        .map(|v| v as usize)
                        .ok_or_else(|| format!("per_layer_config.{idx}.{k} is not an integer"))?;
                    match k.as_str() {
                        "head_dim" => shapes[i].head_dim = v,
                        "num_key_value_heads" => shapes[i].n_kv_heads = v,
                        other => return Err(format!("per-layer override '{other}' (layer {i}) is not supported")),
                    }
                }
            }
        }
        None => {
            let global = Shape {
                head_dim: get_usize(json, "global_head_dim").unwrap_or(512),
                n_kv_heads: match (flag(json, "attention_k_eq_v")?, get_usize(json, "num_global_key_value_heads")) {
                    (true, Some(kv)) => kv,
                    _ => cfg.num_kv_heads,
                },
            };
            for (s, t) in shapes.iter_mut().zip(types) {
                if *t == LayerType::Full {
                    *s = global;
                }
            }
        }
    }
    if let Some((i, s)) = shapes
        .iter()
        .enumerate()
        .find(|(_, s)| s.head_dim == 0 || s.n_kv_heads == 0 || !cfg.num_heads.is_multiple_of(s.n_kv_heads))
    {
        return Err(format!(
            "layer {i}: {} heads cannot use {} KV heads of {}",
            cfg.num_heads, s.n_kv_heads, s.head_dim
        ));
    }
    Ok(shapes)
}

/// The RoPE of a layer of type `t` and width `head_dim` (defaults: default θ 1e4 on sliding
/// layers, proportional θ 1e6 with a quarter rotated on full layers).
fn layer_rope(json: &Value, t: LayerType, head_dim: usize, max_pos: usize) -> std::result::Result<RopeScaling, String> {
    let defaults = serde_json::json!({
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    });
    let all = json.get("rope_parameters").filter(|v| !v.is_null()).unwrap_or(&defaults);
    let params = all.get(t.hf_name()).ok_or_else(|| format!("rope_parameters has no {}", t.hf_name()))?;
    let empty = Value::Object(Default::default());
    rope_from_params(params, &empty, 10_000.0, head_dim, max_pos)
}

/// The plan of a `gemma4_text` config; sets `cfg.rope` to the global layers' schedule (at
/// their head_dim).
pub fn plan(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    let s = match src {
        ConfigSource::Hf { json, .. } => Settings::from_hf(cfg, json).map_err(|m| src.error(m))?,
        ConfigSource::Gguf(_) => return Err(src.error("gemma4 GGUF files are not supported yet")),
    };
    let (layout, kv_index) = blocks::kv_layout(&s.kv_plan()).map_err(|m| src.error(m))?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for (i, &kv_index) in kv_index.iter().enumerate() {
        let (t, shape, shared) = (s.layer_types[i], s.shapes[i], s.donors[i].is_some());
        if let Some(donor) = s.donors[i].filter(|&dn| s.shapes[dn] != shape) {
            return Err(src.error(format!("KV-shared layer {i} has another head shape than its donor {donor}")));
        }
        let attn = AttentionConfig {
            params: AttentionParams {
                n_heads: cfg.num_heads,
                n_kv_heads: shape.n_kv_heads,
                head_dim: shape.head_dim,
                scale: 1.0,
                window: s.window(t),
                softcap: None,
                causal: true,
            },
            rope: s.ropes[i].clone(),
            bias: cfg.qkv_bias,
            qk_norm: Some(0.0),
            qk_norm_whole: false,
            o_bias: false,
            v_norm: true,
            k_eq_v: s.k_eq_v && t == LayerType::Full,
            shared,
            kv_index,
            eps: cfg.rms_norm_eps,
            output_gate: false,
            linear: None,
        };
        let intermediate = cfg.intermediate_size * if s.double_wide && shared { 2 } else { 1 };
        let moe = s.moe.map(|shape| MoePlan {
            shape,
            renormalize: true,
            style: MoeStyle::Gemma4,
            names: ExpertNames {
                router: format!("model.layers.{i}.router.proj"),
                experts: format!("model.layers.{i}.experts"),
                gate: "gate_proj",
                up: "up_proj",
                down: "down_proj",
            },
            shared: None,
        });
        let ffn = FfnPlan { act: cfg.hidden_act, intermediate, bias: false, moe };
        layers.push(LayerPlan { attn, ffn, names: LayerNames::sandwich(i) });
    }
    if let Some(i) = s.layer_types.iter().position(|t| *t == LayerType::Full) {
        cfg.rope = s.ropes[i].clone();
    }
    Ok(DecoderPlan {
        layers,
        layout,
        input: InputKind::Tokens,
        norm: NormKind::Rms { offset: 0.0 },
        eps: cfg.rms_norm_eps,
        final_norm: Some("model.norm".into()),
        embed_scale: Some((cfg.hidden_size as f64).sqrt() as f32),
        residual_scale: None,
        logit_scale: None,
        final_softcap: s.final_softcap,
        per_layer_input: s.per_layer_input,
        layer_scalar: true,
        interleaved_rope: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A Gemma-4-E4B-shaped text config: 42 layers (every 6th global, last forced global),
    /// d 2560, 8 heads / 2 KV heads of 256 (global 512), window 512, 18 KV-shared layers.
    fn e4b(shared: usize) -> Value {
        json!({
            "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 2560, "intermediate_size": 10240,
            "num_hidden_layers": 42, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
            "global_head_dim": 512, "sliding_window": 512, "num_kv_shared_layers": shared,
            "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
        })
    }

    fn settings(json: &Value) -> std::result::Result<Settings, String> {
        let cfg = ModelConfig::from_hf_json(std::path::Path::new("config.json"), json).map_err(|e| e.to_string())?;
        Settings::from_hf(&cfg, json)
    }

    fn kv_bytes_per_token(json: &Value) -> usize {
        let s = settings(json).expect("settings");
        let (layout, _) = blocks::kv_layout(&s.kv_plan()).expect("layout");
        layout.block_bytes(1).iter().sum()
    }

    #[test]
    fn kv_shared_layers_take_no_kv_memory() {
        let s = settings(&e4b(18)).expect("settings");
        let (layout, index) = blocks::kv_layout(&s.kv_plan()).expect("layout");
        assert_eq!(layout.layers.len(), 24, "only the first 24 layers own KV");
        // Shared layers read the last owning layer of their type: 23 (global) or 22 (sliding).
        assert_eq!(index[41], index[23]);
        assert_eq!(index[24], index[22]);
        let (with, without) = (kv_bytes_per_token(&e4b(18)), kv_bytes_per_token(&e4b(0)));
        // What the 18 shared layers would own (K and V at the host cache's value size): 15 sliding
        // of 2×256, 3 global of 2×512.
        let row = |hd: usize| ferrite_runtime::KvDtype::default().row_bytes(hd);
        let shared: usize = (24..42).map(|i| 2 * 2 * row(s.shapes[i].head_dim)).sum();
        assert_eq!(shared, 15 * 2 * 2 * row(256) + 3 * 2 * 2 * row(512));
        assert_eq!(without - with, shared);
        assert!(with * 10 < without * 6, "{with} vs {without} bytes per token");
    }

    #[test]
    fn shapes_follow_per_layer_config_or_global_head_dim() {
        let s = settings(&e4b(0)).expect("settings");
        assert_eq!((s.shapes[4].head_dim, s.shapes[5].head_dim, s.shapes[41].head_dim), (256, 512, 512));
        let mut j = e4b(0);
        j["per_layer_config"] = json!({"05": {"head_dim": 128, "num_key_value_heads": 1}});
        let s = settings(&j).expect("settings");
        assert_eq!((s.shapes[5].head_dim, s.shapes[5].n_kv_heads, s.shapes[11].head_dim), (128, 1, 256));
        // k_eq_v gives global layers num_global_key_value_heads.
        let mut j = e4b(0);
        j["attention_k_eq_v"] = json!(true);
        j["num_global_key_value_heads"] = json!(1);
        assert_eq!(settings(&j).expect("settings").shapes[5].n_kv_heads, 1);
    }

    #[test]
    fn unsupported_settings_are_load_errors() {
        let err = |patch: Value| {
            let mut j = e4b(18);
            for (k, v) in patch.as_object().expect("object") {
                j[k] = v.clone();
            }
            settings(&j).err().unwrap_or_else(|| panic!("{patch} should be rejected"))
        };
        assert!(err(json!({"altup_num_inputs": 4})).contains("altup_num_inputs"));
        assert!(err(json!({"use_bidirectional_attention": "all"})).contains("bidirectional"));
        assert!(err(json!({"per_layer_config": {"3": {"intermediate_size": 5}}})).contains("intermediate_size"));
        assert!(err(json!({"enable_moe_block": true, "top_k_experts": 2, "moe_intermediate_size": 8}))
            .contains("num_experts"));
        assert!(err(json!({"num_kv_shared_layers": 50})).contains("num_kv_shared_layers"));
        assert!(err(json!({"hidden_activation": "relu"})).contains("relu"));
        assert!(err(json!({"rope_parameters": {"full_attention": {"rope_type": "longrope", "rope_theta": 1.0}}}))
            .contains("longrope"));
        // A shared sliding layer with no sliding layer before the shared ones.
        let mut j = e4b(0);
        j["num_hidden_layers"] = json!(3);
        j["layer_types"] = json!(["full_attention", "sliding_attention", "full_attention"]);
        j["num_kv_shared_layers"] = json!(2);
        assert!(settings(&j).err().expect("no donor").contains("no earlier sliding_attention"));
    }
}
