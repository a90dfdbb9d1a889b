//! GLM-4 (`glm4`): sandwich norms (`post_self_attn_layernorm`, `post_mlp_layernorm` on the
//! sublayer outputs; `post_attention_layernorm` is the pre-FFN norm), a fused `gate_up_proj`,
//! q/k/v biases, and partial rotary embeddings over adjacent pairs, which the loader turns into
//! the executors' rotate-half pairs by reordering the q and k rows (`DecoderPlan::interleaved_rope`).

use crate::config::{get_f64, ConfigSource, ModelConfig};
use crate::error::Result;
use crate::plan::{DecoderPlan, MlpNames};

pub fn plan(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    // transformers rotates `head_dim * partial_rotary_factor` dims whatever the rope type.
    let partial = match src {
        ConfigSource::Hf { json, .. } => get_f64(json, "partial_rotary_factor")
            .or_else(|| json.get("rope_parameters").and_then(|p| get_f64(p, "partial_rotary_factor")))
            .unwrap_or(0.5),
        ConfigSource::Gguf(_) => cfg.rope.rotary_dim as f64 / cfg.head_dim as f64,
    };
    let rotary = (cfg.head_dim as f64 * partial) as usize;
    if !rotary.is_multiple_of(2) || rotary > cfg.head_dim {
        return Err(
            src.error(format!("partial_rotary_factor {partial} gives {rotary} rotary dims of {}", cfg.head_dim))
        );
    }
    cfg.rope.rotary_dim = rotary;
    let mut plan = super::llama::base(cfg);
    for (i, l) in plan.layers.iter_mut().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        l.names.post_attn_norm = Some(p("post_self_attn_layernorm"));
        l.names.pre_ffn_norm = Some(p("post_attention_layernorm"));
        l.names.post_ffn_norm = Some(p("post_mlp_layernorm"));
        l.names.mlp = MlpNames::FusedGated { gate_up: p("mlp.gate_up_proj"), down: p("mlp.down_proj") };
    }
    plan.interleaved_rope = true;
    Ok(plan)
}
