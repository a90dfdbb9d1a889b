//! SmolLM3 (`smollm3`): the llama layer where some layers use no positional embedding (NoPE):
//! `no_rope_layers[i]` is 0 for those (by default every `no_rope_layer_interval`-th, 4).

use crate::config::{get_usize, ConfigSource, ModelConfig};
use crate::error::Result;
use crate::plan::DecoderPlan;

pub fn plan(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    let n = cfg.num_layers;
    let interval = |k: usize| (0..n).map(|i| (i + 1) % k.max(1) != 0).collect::<Vec<bool>>();
    let uses_rope: Vec<bool> = match src {
        ConfigSource::Hf { json, .. } => match json.get("no_rope_layers").filter(|v| !v.is_null()) {
            Some(list) => {
                let list = list
                    .as_array()
                    .filter(|l| l.len() == n)
                    .ok_or_else(|| src.error(format!("no_rope_layers must list {n} layers")))?;
                list.iter()
                    .map(|v| v.as_u64().filter(|v| *v <= 1).map(|v| v == 1))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| src.error("no_rope_layers holds a value other than 0 or 1"))?
            }
            None => interval(get_usize(json, "no_rope_layer_interval").unwrap_or(4)),
        },
        // llama.cpp writes no key for it: every 4th layer.
        ConfigSource::Gguf(_) => interval(4),
    };
    let mut plan = super::llama::base(cfg);
    for (l, rope) in plan.layers.iter_mut().zip(uses_rope) {
        if !rope {
            l.attn.rope.rotary_dim = 0;
        }
    }
    Ok(plan)
}
