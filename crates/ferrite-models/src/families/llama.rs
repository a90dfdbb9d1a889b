//! The llama family of dense decoders: llama (SmolLM2, Llama 3.x), mistral (sliding window),
//! qwen2 (QKV bias) and qwen3 (per-head q/k norm). Pre-norm blocks of GQA attention with RoPE
//! and a SwiGLU MLP, HF llama tensor names. A GGUF file of one of them with expert tensors is
//! Mixtral (`mixtral`).

use ferrite_runtime::cpu::AttentionParams;
use ferrite_runtime::{KvGroupKind, KvLayout};

use crate::blocks::AttentionConfig;
use crate::config::{ConfigSource, ModelConfig};
use crate::error::Result;
use crate::plan::{DecoderPlan, FfnPlan, InputKind, LayerNames, LayerPlan, NormKind};

pub fn plan(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    match src {
        // Mixtral's GGUF files are this architecture with expert tensors.
        ConfigSource::Gguf(_) => super::mixtral::plan(cfg, src),
        ConfigSource::Hf { .. } => Ok(base(cfg)),
    }
}

/// The llama plan of `cfg`: the dense layout other families start from and adjust.
pub(super) fn base(cfg: &ModelConfig) -> DecoderPlan {
    let kind = cfg.sliding_window.map_or(KvGroupKind::Full, |window| KvGroupKind::Sliding { window });
    let params = AttentionParams {
        n_heads: cfg.num_heads,
        n_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        scale: 1.0 / (cfg.head_dim as f32).sqrt(),
        window: cfg.sliding_window,
        softcap: None,
        causal: true,
    };
    let layers = (0..cfg.num_layers)
        .map(|i| LayerPlan {
            attn: AttentionConfig {
                params,
                rope: cfg.rope.clone(),
                bias: cfg.qkv_bias,
                qk_norm: cfg.qk_norm.then_some(0.0),
                qk_norm_whole: false,
                o_bias: false,
                v_norm: false,
                k_eq_v: false,
                shared: false,
                kv_index: i,
                eps: cfg.rms_norm_eps,
                output_gate: false,
                linear: None,
            },
            ffn: FfnPlan { act: cfg.hidden_act, intermediate: cfg.intermediate_size, bias: false, moe: None },
            names: LayerNames::llama(i),
        })
        .collect();
    DecoderPlan {
        layers,
        layout: KvLayout::uniform(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kind),
        input: InputKind::Tokens,
        norm: NormKind::Rms { offset: 0.0 },
        eps: cfg.rms_norm_eps,
        final_norm: Some("model.norm".into()),
        embed_scale: None,
        residual_scale: None,
        logit_scale: None,
        final_softcap: None,
        per_layer_input: None,
        layer_scalar: false,
        interleaved_rope: false,
    }
}
