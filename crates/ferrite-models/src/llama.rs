//! The llama family of dense decoders: llama (SmolLM2, Llama 3.x), mistral, qwen2 (QKV bias)
//! and qwen3 (q/k norm). Pre-norm blocks of GQA attention with RoPE and a SwiGLU MLP.

use ferrite_runtime::cpu::AttentionParams;
use ferrite_runtime::{ForwardBatch, KvCache, KvGroupKind, KvLayout, Result, Tensor};

use crate::blocks::{self, Attention, AttentionConfig, GatedMlp, LmHead, RmsNorm};
use crate::config::ModelConfig;
use crate::model::CausalLm;
use crate::weights::Weights;

struct Layer {
    attn_norm: RmsNorm,
    attn: Attention,
    ffn_norm: RmsNorm,
    mlp: GatedMlp,
}

pub struct Llama {
    cfg: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    head: LmHead,
    layout: KvLayout,
}

impl Llama {
    /// Build from `weights`, checking every tensor; `progress` is told after each layer.
    pub fn load(cfg: ModelConfig, w: &Weights, progress: &dyn Fn(usize)) -> crate::Result<Llama> {
        let (d, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let embed = w.get("model.embed_tokens.weight", &[cfg.vocab_size, d])?;
        let kind = match cfg.sliding_window {
            Some(window) => KvGroupKind::Sliding { window },
            None => KvGroupKind::Full,
        };
        let layout = KvLayout::uniform(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kind);
        let params = AttentionParams {
            n_heads: cfg.num_heads,
            n_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            window: cfg.sliding_window,
            softcap: None,
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let attn = AttentionConfig {
                params,
                rope: cfg.rope.clone(),
                bias: cfg.qkv_bias,
                qk_norm: cfg.qk_norm.then_some(0.0),
                v_norm: false,
                k_eq_v: false,
                shared: false,
                kv_index: i,
                eps,
            };
            layers.push(Layer {
                attn_norm: RmsNorm::load(w, &p("input_layernorm.weight"), d, 0.0, eps)?,
                attn: Attention::load(w, &p("self_attn"), d, attn)?,
                ffn_norm: RmsNorm::load(w, &p("post_attention_layernorm.weight"), d, 0.0, eps)?,
                mlp: GatedMlp::load(w, &p("mlp"), d, cfg.intermediate_size, cfg.hidden_act)?,
            });
            progress(i + 1);
        }
        let head = LmHead::load(w, &cfg, &embed, 0.0, None)?;
        Ok(Llama { cfg, embed, layers, head, layout })
    }
}

impl CausalLm for Llama {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn kv_layout(&self) -> KvLayout {
        self.layout.clone()
    }

    fn forward(&self, batch: &ForwardBatch, kv: &mut KvCache) -> Result<Vec<f32>> {
        let t = batch.num_tokens();
        let mut x = blocks::embed(&self.embed, &batch.tokens, None)?;
        let mut h = vec![0f32; x.len()];
        let mut o = vec![0f32; x.len()];
        // Each residual add runs fused with the norm that reads its sum (the last layer's
        // with the head's).
        if let Some(first) = self.layers.first() {
            first.attn_norm.forward(&x, &mut h);
        }
        for (i, l) in self.layers.iter().enumerate() {
            l.attn.forward(&h, batch, kv, &mut o)?;
            l.ffn_norm.forward_add(&mut x, &o, &mut h);
            l.mlp.forward(&h, t, &mut o)?;
            match self.layers.get(i + 1) {
                Some(next) => next.attn_norm.forward_add(&mut x, &o, &mut h),
                None => blocks::add_in_place(&mut x, &o),
            }
        }
        self.head.logits(&x, batch)
    }
}
