//! Granite (`granite`): the llama layer with multipliers on the embedding
//! (`embedding_multiplier`), on each sublayer output before its residual add
//! (`residual_multiplier`), on the attention scores (`attention_multiplier`, in place of
//! `1/sqrt(head_dim)`) and on the logits (`1 / logits_scaling`).

use crate::config::{get_f64, ConfigSource, ModelConfig};
use crate::error::Result;
use crate::plan::DecoderPlan;

pub fn plan(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    let (embedding, residual, attention, logits) = match src {
        ConfigSource::Hf { json, .. } => (
            get_f64(json, "embedding_multiplier").unwrap_or(1.0),
            get_f64(json, "residual_multiplier").unwrap_or(1.0),
            get_f64(json, "attention_multiplier").unwrap_or(1.0),
            get_f64(json, "logits_scaling").unwrap_or(1.0),
        ),
        ConfigSource::Gguf(g) => {
            let key = |k: &str| g.get_f64(&format!("granite.{k}"));
            (
                key("embedding_scale").unwrap_or(1.0),
                key("residual_scale").unwrap_or(1.0),
                key("attention.scale").unwrap_or(1.0),
                key("logit_scale").unwrap_or(1.0),
            )
        }
    };
    for (name, v) in [("embedding", embedding), ("residual", residual), ("attention", attention), ("logits", logits)] {
        if !v.is_finite() || v <= 0.0 {
            return Err(src.error(format!("granite {name} multiplier {v} must be a positive number")));
        }
    }
    let mut plan = super::llama::base(cfg);
    plan.embed_scale = Some(embedding as f32);
    plan.residual_scale = Some(residual as f32);
    plan.logit_scale = Some((1.0 / logits) as f32);
    for l in &mut plan.layers {
        l.attn.params.scale = attention as f32;
    }
    Ok(plan)
}
