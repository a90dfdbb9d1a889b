//! Qwen3-Next (`qwen3_next`; GGUF `qwen3next`): the Qwen3.5 hybrid (`qwen3_5::hybrid`: gated
//! DeltaNet and gated full attention) with Qwen3-MoE's experts on every
//! `decoder_sparse_step`-th layer not in `mlp_only_layers` (`norm_topk_prob` true by default),
//! each sparse layer with a shared expert (`mlp.shared_expert`, `shared_expert_intermediate_size`
//! wide) scaled per token by `sigmoid(mlp.shared_expert_gate · x)`. Its DeltaNet projections are
//! packed by key head: `in_proj_qkvz` and `in_proj_ba` (a GGUF file splits the first into
//! `attn_qkv` and `attn_gate` and keeps `ssm_ba` packed).

use super::qwen3_5;
use super::qwen3_moe::{from_hf, NAMING};
use super::sparse_moe::{hf_count, Sparse};
use crate::config::{ConfigSource, ModelConfig};
use crate::deltanet::Packing;
use crate::error::Result;
use crate::plan::{DecoderPlan, MlpNames, SharedExpert};

pub fn plan(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    let hybrid = qwen3_5::read(cfg, src, Packing::Grouped, Packing::Grouped)?;
    let mut plan = qwen3_5::hybrid(cfg, &hybrid, src)?;
    let (sparse, shared) = match src {
        ConfigSource::Hf { json, .. } => {
            let sparse = from_hf(cfg, json, true).map_err(|m| src.error(m))?;
            let shared = hf_count(json, &["shared_expert_intermediate_size"], Some(0)).map_err(|m| src.error(m))?;
            (Some(sparse), shared)
        }
        ConfigSource::Gguf(g) => {
            let arch = g.architecture()?;
            let shared = g.get_u64(&format!("{arch}.expert_shared_feed_forward_length")).unwrap_or(0) as usize;
            (Sparse::from_gguf(cfg, g, src)?, shared)
        }
    };
    let Some(sparse) = sparse else { return Ok(plan) };
    sparse.apply(&mut plan, &NAMING);
    if shared > 0 {
        for (i, l) in plan.layers.iter_mut().enumerate() {
            let p = |s: &str| format!("model.layers.{i}.mlp.{s}");
            if let Some(moe) = l.ffn.moe.as_mut() {
                moe.shared = Some(SharedExpert {
                    intermediate: shared,
                    mlp: MlpNames::Gated {
                        gate: p("shared_expert.gate_proj"),
                        up: p("shared_expert.up_proj"),
                        down: p("shared_expert.down_proj"),
                    },
                    gate: Some(p("shared_expert_gate")),
                });
            }
        }
    }
    Ok(plan)
}
