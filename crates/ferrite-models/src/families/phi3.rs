//! Phi-3 (`phi3`): the llama layer with q, k and v in one `qkv_proj` and gate and up in one
//! `gate_up_proj`, partial rotary embeddings and long RoPE (per-frequency short and long
//! factors: `rope_parameters` in an HF config, read by `config::rope_from_params`; in a GGUF
//! the `rope_factors_short`/`rope_factors_long` tensors and `phi3.rope.scaling.*` keys).

use crate::config::{ConfigSource, ModelConfig};
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::plan::{DecoderPlan, MlpNames, QkvNames};
use crate::rope_scaling::RopeKind;

pub fn plan(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    if let ConfigSource::Gguf(g) = src {
        if let Some(kind) = gguf_long_rope(g, cfg)? {
            cfg.rope.kind = kind;
        }
    }
    let mut plan = super::llama::base(cfg);
    for (i, l) in plan.layers.iter_mut().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        l.names.qkv = QkvNames::Fused(p("self_attn.qkv_proj"));
        l.names.mlp = MlpNames::FusedGated { gate_up: p("mlp.gate_up_proj"), down: p("mlp.down_proj") };
    }
    Ok(plan)
}

/// Long RoPE as llama.cpp's converter stores it, if the file has its factor tensors.
fn gguf_long_rope(g: &GgufFile, cfg: &ModelConfig) -> Result<Option<RopeKind>> {
    if g.tensor_info("rope_factors_long.weight").is_none() {
        return Ok(None);
    }
    let half = cfg.rope.rotary_dim / 2;
    let factors = |name: &str| -> Result<Vec<f64>> {
        let v = g.tensor(name)?.to_f32_vec()?;
        if v.len() != half || v.iter().any(|f| !f.is_finite() || *f <= 0.0) {
            let why = format!("{} values, expected {half} positive ones", v.len());
            return Err(crate::error::LoadError::tensor(g.path(), name, why));
        }
        Ok(v.into_iter().map(f64::from).collect())
    };
    let original =
        g.get_u64("phi3.rope.scaling.original_context_length").map_or(cfg.max_position_embeddings, |v| v as usize);
    let attention_factor = g.get_f64("phi3.rope.scaling.attn_factor").unwrap_or(1.0);
    Ok(Some(RopeKind::LongRope {
        short: factors("rope_factors_short.weight")?,
        long: factors("rope_factors_long.weight")?,
        original_max_position_embeddings: original,
        attention_factor,
    }))
}
