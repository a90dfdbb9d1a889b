//! What the sparse mixture-of-experts families (qwen3_moe, mixtral) share: their experts in
//! place of the dense MLP of the chosen layers (`MoeStyle::Sparse`), and reading the expert
//! settings of a GGUF file, where a layer is sparse when it has a router (`ffn_gate_inp`).

use serde_json::Value;

use crate::config::{ConfigSource, ModelConfig};
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::moe::MoeShape;
use crate::plan::{DecoderPlan, ExpertNames, MoePlan, MoeStyle};

/// How a family stores its experts (HF names; GGUF names follow from `weights::gguf_name`).
pub(super) struct Naming {
    /// The module of layer N's experts and router: `mlp` (Qwen3-MoE), `block_sparse_moe` (Mixtral).
    pub block: &'static str,
    /// The projection names: (gate, up, down).
    pub projections: (&'static str, &'static str, &'static str),
}

/// The expert settings of a family's config.
pub(super) struct Sparse {
    pub shape: MoeShape,
    pub renormalize: bool,
    /// Per layer, whether its experts replace the dense MLP.
    pub layers: Vec<bool>,
}

impl Sparse {
    /// The llama plan of `cfg` with these experts.
    pub fn plan(&self, cfg: &ModelConfig, naming: &Naming) -> DecoderPlan {
        let mut plan = super::llama::base(cfg);
        self.apply(&mut plan, naming);
        plan
    }

    /// Put these experts in place of the dense MLP of the sparse layers of `plan`.
    pub fn apply(&self, plan: &mut DecoderPlan, naming: &Naming) {
        for (i, (l, &sparse)) in plan.layers.iter_mut().zip(&self.layers).enumerate() {
            if !sparse {
                continue;
            }
            let block = format!("model.layers.{i}.{}", naming.block);
            let (gate, up, down) = naming.projections;
            l.ffn.moe = Some(MoePlan {
                shape: self.shape,
                renormalize: self.renormalize,
                style: MoeStyle::Sparse,
                names: ExpertNames {
                    router: format!("{block}.gate"),
                    experts: format!("{block}.experts"),
                    gate,
                    up,
                    down,
                },
                shared: None,
            });
        }
    }

    /// The settings a GGUF file gives: `{arch}.expert_count`, `{arch}.expert_used_count`, the
    /// expert width `{arch}.expert_feed_forward_length` (else `feed_forward_length`, as Mixtral
    /// files store it), renormalized unless `{arch}.expert_weights_norm` is false; `None` when
    /// the file has no experts.
    pub fn from_gguf(cfg: &ModelConfig, g: &GgufFile, src: &ConfigSource) -> Result<Option<Sparse>> {
        let arch = g.architecture()?;
        let key = |k: &str| format!("{arch}.{k}");
        let count = |k: &str| g.get_u64(&key(k)).map(|v| v as usize);
        let experts = count("expert_count").unwrap_or(0);
        if experts == 0 {
            return Ok(None);
        }
        let width = count("expert_feed_forward_length").unwrap_or(cfg.intermediate_size);
        let shape =
            MoeShape::checked(experts, count("expert_used_count").unwrap_or(0), width).map_err(|m| src.error(m))?;
        let renormalize = g.get(&key("expert_weights_norm")).and_then(|v| v.as_bool()).unwrap_or(true);
        let layers = (0..cfg.num_layers).map(|i| g.tensor_info(&format!("blk.{i}.ffn_gate_inp.weight")).is_some());
        Ok(Some(Sparse { shape, renormalize, layers: layers.collect() }))
    }
}

/// An integer of an HF config under the first of `keys` it holds, else `default`.
pub(super) fn hf_count(json: &Value, keys: &[&str], default: Option<usize>) -> std::result::Result<usize, String> {
    match keys.iter().find_map(|k| json.get(*k).filter(|v| !v.is_null()).map(|v| (*k, v))) {
        Some((k, v)) => v.as_u64().map(|v| v as usize).ok_or_else(|| format!("{k} is not a non-negative integer")),
        None => default.ok_or_else(|| format!("{} is missing", keys[0])),
    }
}
