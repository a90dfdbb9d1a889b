//! StarCoder2 (`starcoder2`): pre-norm layers with LayerNorm (weight and bias,
//! `norm_epsilon`), biases on every projection (`use_bias`), a plain GELU MLP (`c_fc`,
//! `c_proj`) and an optional sliding window.

use crate::config::{get_f64, ConfigSource, ModelConfig};
use crate::error::Result;
use crate::plan::{DecoderPlan, MlpNames, NormKind};

pub fn plan(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    let (bias, eps) = match src {
        ConfigSource::Hf { json, .. } => (
            json.get("use_bias").and_then(serde_json::Value::as_bool).unwrap_or(true),
            get_f64(json, "norm_epsilon").unwrap_or(1e-5),
        ),
        ConfigSource::Gguf(g) => (
            g.tensor_info("blk.0.attn_q.bias").is_some(),
            g.get_f64("starcoder2.attention.layer_norm_epsilon").unwrap_or(1e-5),
        ),
    };
    if !(eps.is_finite() && eps > 0.0) {
        return Err(src.error(format!("norm_epsilon {eps} must be a positive number")));
    }
    cfg.qkv_bias = bias;
    cfg.rms_norm_eps = eps as f32;
    let mut plan = super::llama::base(cfg);
    plan.norm = NormKind::Layer;
    for (i, l) in plan.layers.iter_mut().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        l.attn.o_bias = bias;
        l.ffn.bias = bias;
        l.names.mlp = MlpNames::Plain { up: p("mlp.c_fc"), down: p("mlp.c_proj") };
    }
    Ok(plan)
}
