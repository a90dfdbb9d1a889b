//! Qwen3-MoE (`qwen3_moe`; GGUF `qwen3moe`): the qwen3 layer (per-head q/k norms) whose
//! feed-forward is a mixture of SwiGLU experts (`mlp.gate` router, `mlp.experts`) on every
//! `decoder_sparse_step`-th layer not in `mlp_only_layers`, a dense MLP on the others; the
//! chosen experts' probabilities are renormalized when `norm_topk_prob`. A GGUF file's layers
//! are sparse where they have a router; llama.cpp always renormalizes.

use serde_json::Value;

use super::sparse_moe::{hf_count, Naming, Sparse};
use crate::config::{ConfigSource, ModelConfig};
use crate::error::Result;
use crate::moe::MoeShape;
use crate::plan::DecoderPlan;

pub(super) const NAMING: Naming = Naming { block: "mlp", projections: ("gate_proj", "up_proj", "down_proj") };

pub fn plan(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    let sparse = match src {
        ConfigSource::Hf { json, .. } => Some(from_hf(cfg, json, false).map_err(|m| src.error(m))?),
        ConfigSource::Gguf(g) => Sparse::from_gguf(cfg, g, src)?,
    };
    Ok(match sparse {
        Some(s) => s.plan(cfg, &NAMING),
        None => super::llama::base(cfg),
    })
}

/// The expert settings of a Qwen MoE config; `norm_topk_prob` is `renormalize` when absent
/// (transformers' default: false for Qwen3-MoE, true for Qwen3-Next).
pub(super) fn from_hf(cfg: &ModelConfig, json: &Value, renormalize: bool) -> std::result::Result<Sparse, String> {
    // transformers 5 saves `num_experts` as `num_local_experts`.
    let experts = hf_count(json, &["num_experts", "num_local_experts"], Some(128))?;
    let step = hf_count(json, &["decoder_sparse_step"], Some(1))?;
    if step == 0 {
        return Err("decoder_sparse_step is 0 (expected a positive step)".into());
    }
    let dense: Vec<usize> = match json.get("mlp_only_layers").filter(|v| !v.is_null()) {
        Some(list) => list
            .as_array()
            .and_then(|l| l.iter().map(|v| v.as_u64().map(|v| v as usize)).collect::<Option<Vec<_>>>())
            .ok_or("mlp_only_layers is not a list of layer indices")?,
        None => Vec::new(),
    };
    let layers: Vec<bool> =
        (0..cfg.num_layers).map(|i| experts > 0 && !dense.contains(&i) && (i + 1) % step == 0).collect();
    let shape = if layers.contains(&true) {
        let top_k = hf_count(json, &["num_experts_per_tok"], Some(8))?;
        MoeShape::checked(experts, top_k, hf_count(json, &["moe_intermediate_size"], None)?)?
    } else {
        // Every layer is dense: the expert settings are unused.
        MoeShape { num_experts: 0, top_k: 0, intermediate: 0 }
    };
    let renormalize = match json.get("norm_topk_prob") {
        None | Some(Value::Null) => renormalize,
        Some(v) => v.as_bool().ok_or("norm_topk_prob is not a bool")?,
    };
    Ok(Sparse { shape, renormalize, layers })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn settings(extra: Value) -> std::result::Result<Sparse, String> {
        let mut j = json!({
            "model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        });
        for (k, v) in extra.as_object().expect("object") {
            j[k] = v.clone();
        }
        let cfg = ModelConfig::from_hf_json(std::path::Path::new("config.json"), &j).map_err(|e| e.to_string())?;
        from_hf(&cfg, &j, false)
    }

    #[test]
    fn sparse_step_and_mlp_only_layers_pick_the_sparse_layers() {
        let s = settings(json!({"decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": true}))
            .expect("settings");
        assert_eq!(s.layers, vec![false, true, false, false, false, true]);
        assert!(s.renormalize);
        assert_eq!(s.shape, MoeShape { num_experts: 8, top_k: 2, intermediate: 16 });
        assert!(!settings(json!({})).expect("defaults").renormalize, "transformers' default is false");
        assert!(settings(json!({"num_experts": 0})).expect("dense").layers.iter().all(|s| !s));
    }

    #[test]
    fn bad_expert_settings_are_load_errors() {
        let err = |extra: Value| settings(extra.clone()).err().unwrap_or_else(|| panic!("{extra} accepted"));
        assert!(err(json!({"decoder_sparse_step": 0})).contains("decoder_sparse_step"));
        assert!(err(json!({"num_experts_per_tok": 9})).contains("9 experts per token of 8"));
        assert!(err(json!({"num_experts_per_tok": 0})).contains("positive"));
        assert!(err(json!({"mlp_only_layers": "all"})).contains("mlp_only_layers"));
        assert!(err(json!({"norm_topk_prob": 1})).contains("norm_topk_prob"));
        assert!(err(json!({"moe_intermediate_size": null})).contains("moe_intermediate_size"));
    }
}
