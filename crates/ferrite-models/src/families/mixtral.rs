//! Mixtral (`mixtral`; in GGUF the `llama` architecture with expert tensors): the llama layer
//! (sliding window when `sliding_window` is set) whose feed-forward is, on every layer,
//! `num_experts_per_tok` of `num_local_experts` SwiGLU experts (`block_sparse_moe.gate` router,
//! experts `w1` gate, `w3` up, `w2` down), the chosen probabilities renormalized.

use super::sparse_moe::{hf_count, Naming, Sparse};
use crate::config::{ConfigSource, ModelConfig};
use crate::error::Result;
use crate::moe::MoeShape;
use crate::plan::DecoderPlan;

const NAMING: Naming = Naming { block: "block_sparse_moe", projections: ("w1", "w3", "w2") };

pub fn plan(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    match src {
        ConfigSource::Hf { json, .. } => {
            let shape = hf_shape(cfg, json).map_err(|m| src.error(m))?;
            let sparse = Sparse { shape, renormalize: true, layers: vec![true; cfg.num_layers] };
            Ok(sparse.plan(cfg, &NAMING))
        }
        ConfigSource::Gguf(g) => Ok(match Sparse::from_gguf(cfg, g, src)? {
            Some(s) => s.plan(cfg, &NAMING),
            None => super::llama::base(cfg),
        }),
    }
}

/// `num_local_experts` (default 8) experts of width `intermediate_size`, `num_experts_per_tok`
/// (default 2) per token.
fn hf_shape(cfg: &ModelConfig, json: &serde_json::Value) -> std::result::Result<MoeShape, String> {
    let experts = hf_count(json, &["num_local_experts"], Some(8))?;
    MoeShape::checked(experts, hf_count(json, &["num_experts_per_tok"], Some(2))?, cfg.intermediate_size)
}
