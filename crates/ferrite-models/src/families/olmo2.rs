//! OLMo 2 (`olmo2`): post-norm layers (`x += norm(attn(x))`, `x += norm(mlp(x))`, no input
//! norms) with an RMSNorm over each token's whole q and k projections before RoPE.

use crate::config::{ConfigSource, ModelConfig};
use crate::error::Result;
use crate::plan::DecoderPlan;

pub fn plan(cfg: &mut ModelConfig, _src: &ConfigSource) -> Result<DecoderPlan> {
    let mut plan = super::llama::base(cfg);
    for (i, l) in plan.layers.iter_mut().enumerate() {
        let p = |s: &str| Some(format!("model.layers.{i}.{s}"));
        l.names.input_norm = None;
        l.names.pre_ffn_norm = None;
        l.names.post_attn_norm = p("post_attention_layernorm");
        l.names.post_ffn_norm = p("post_feedforward_layernorm");
        l.attn.qk_norm = Some(0.0);
        l.attn.qk_norm_whole = true;
    }
    Ok(plan)
}
