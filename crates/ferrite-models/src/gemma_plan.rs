//! The shape of a Gemma model (1, 2, 3 or 4) layer by layer, as read from its config: each
//! layer's attention (heads, scale, window, softcap, RoPE, q/k/v norms, its KV cache layer or
//! its donor's) and MLP width, the KV layout, and the model-wide parts (norm offset, sandwich
//! norms, final softcap, per-layer inputs, MoE, layer scalars). The CPU models (`gemma`,
//! `gemma4`) and the CUDA model (`gpu::gemma`) are both built from it.

use ferrite_runtime::KvLayout;

use crate::blocks::AttentionConfig;
use crate::config::{Architecture, ConfigSource, ModelConfig};
use crate::error::Result;
use crate::moe::MoeShape;

/// One decoder layer.
pub struct LayerPlan {
    pub attn: AttentionConfig,
    /// Width of the dense MLP (Gemma 4's double-wide layers have twice the config's).
    pub intermediate: usize,
}

pub struct GemmaPlan {
    pub layers: Vec<LayerPlan>,
    pub layout: KvLayout,
    /// Added to every RMSNorm weight of the decoder (`1 + w` up to Gemma 3, 0 for Gemma 4).
    pub norm_offset: f32,
    /// Each sublayer's output is normed before its residual add (Gemma 2 on).
    pub sandwich: bool,
    pub final_softcap: Option<f32>,
    /// (vocab, width) of Gemma 4's per-layer inputs.
    pub per_layer_input: Option<(usize, usize)>,
    pub moe: Option<MoeShape>,
    /// Gemma 4 scales the residual stream by a learned scalar after each layer.
    pub layer_scalar: bool,
}

/// The plan of the Gemma model `cfg` describes; Gemma 4 also sets `cfg.rope` to its global
/// layers' schedule.
pub fn plan(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<GemmaPlan> {
    match cfg.arch {
        Architecture::Gemma4 => crate::gemma4::plan(cfg, src),
        _ => crate::gemma::plan(cfg, src),
    }
}
