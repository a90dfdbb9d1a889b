//! Phi-3 (`phi3`): the llama layer with q, k and v in one `qkv_proj` and gate and up in one
//! `gate_up_proj`, partial rotary embeddings and long RoPE (per-frequency short and long
//! factors, read by `config::rope_from_params`).

use crate::config::{ConfigSource, ModelConfig};
use crate::error::Result;
use crate::plan::{DecoderPlan, MlpNames, QkvNames};

pub fn plan(cfg: &mut ModelConfig, _src: &ConfigSource) -> Result<DecoderPlan> {
    let mut plan = super::llama::base(cfg);
    for (i, l) in plan.layers.iter_mut().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        l.names.qkv = QkvNames::Fused(p("self_attn.qkv_proj"));
        l.names.mlp = MlpNames::FusedGated { gate_up: p("mlp.gate_up_proj"), down: p("mlp.down_proj") };
    }
    Ok(plan)
}
