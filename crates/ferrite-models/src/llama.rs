//! The llama family of dense decoders: llama (SmolLM2, Llama 3.x), mistral, qwen2 (QKV bias)
//! and qwen3 (q/k norm). Pre-norm blocks of GQA attention with RoPE and a SwiGLU MLP.

use ferrite_runtime::cpu::{self, AttentionParams};
use ferrite_runtime::{ForwardBatch, KvCache, KvGroupKind, KvLayout, Result, Tensor};

use crate::config::ModelConfig;
use crate::model::CausalLm;
use crate::weights::Weights;

struct Layer {
    attn_norm: Vec<f32>,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

pub struct Llama {
    cfg: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Tensor,
}

impl Llama {
    /// Build from `weights`, checking every tensor; `progress` is told after each layer.
    pub fn load(cfg: ModelConfig, w: &Weights, progress: &dyn Fn(usize)) -> crate::Result<Llama> {
        let (d, nh, nkv, hd, ff) = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size);
        let embed = w.get("model.embed_tokens.weight", &[cfg.vocab_size, d])?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let bias = |s: &str, n: usize| -> crate::Result<Option<Vec<f32>>> {
                if cfg.qkv_bias {
                    Ok(Some(w.get_f32(&p(s), &[n])?))
                } else {
                    Ok(None)
                }
            };
            let qk_norm = |s: &str| -> crate::Result<Option<Vec<f32>>> {
                if cfg.qk_norm {
                    Ok(Some(w.get_f32(&p(s), &[hd])?))
                } else {
                    Ok(None)
                }
            };
            layers.push(Layer {
                attn_norm: w.get_f32(&p("input_layernorm.weight"), &[d])?,
                q: w.get(&p("self_attn.q_proj.weight"), &[nh * hd, d])?,
                k: w.get(&p("self_attn.k_proj.weight"), &[nkv * hd, d])?,
                v: w.get(&p("self_attn.v_proj.weight"), &[nkv * hd, d])?,
                o: w.get(&p("self_attn.o_proj.weight"), &[d, nh * hd])?,
                q_bias: bias("self_attn.q_proj.bias", nh * hd)?,
                k_bias: bias("self_attn.k_proj.bias", nkv * hd)?,
                v_bias: bias("self_attn.v_proj.bias", nkv * hd)?,
                q_norm: qk_norm("self_attn.q_norm.weight")?,
                k_norm: qk_norm("self_attn.k_norm.weight")?,
                ffn_norm: w.get_f32(&p("post_attention_layernorm.weight"), &[d])?,
                gate: w.get(&p("mlp.gate_proj.weight"), &[ff, d])?,
                up: w.get(&p("mlp.up_proj.weight"), &[ff, d])?,
                down: w.get(&p("mlp.down_proj.weight"), &[d, ff])?,
            });
            progress(i + 1);
        }
        let norm = w.get_f32("model.norm.weight", &[d])?;
        let lm_head = if cfg.tie_word_embeddings && !w.contains("lm_head.weight") {
            embed.clone()
        } else {
            w.get("lm_head.weight", &[cfg.vocab_size, d])?
        };
        Ok(Llama { cfg, embed, layers, norm, lm_head })
    }

    fn attention_params(&self) -> AttentionParams {
        AttentionParams {
            n_heads: self.cfg.num_heads,
            n_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
            scale: 1.0 / (self.cfg.head_dim as f32).sqrt(),
            window: self.cfg.sliding_window,
            softcap: None,
        }
    }

    /// Apply RoPE to `x` (`[tokens, heads * head_dim]`); dynamic scaling is per row.
    fn rope(&self, x: &mut [f32], batch: &ForwardBatch, heads: usize) {
        let hd = self.cfg.head_dim;
        if !self.cfg.rope.is_dynamic() {
            self.cfg.rope.rope_for(0).apply(x, &batch.positions, heads, hd);
            return;
        }
        for row in &batch.rows {
            let span = row.query_start..row.query_start + row.query_len;
            let rope = self.cfg.rope.rope_for(row.context_len);
            rope.apply(&mut x[span.start * heads * hd..span.end * heads * hd], &batch.positions[span], heads, hd);
        }
    }
}

impl CausalLm for Llama {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn kv_layout(&self) -> KvLayout {
        let kind = match self.cfg.sliding_window {
            Some(window) => KvGroupKind::Sliding { window },
            None => KvGroupKind::Full,
        };
        KvLayout::uniform(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, kind)
    }

    fn forward(&self, batch: &ForwardBatch, kv: &mut KvCache) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let t = batch.num_tokens();
        let (d, nh, nkv, hd, ff) = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size);
        let eps = c.rms_norm_eps;
        let params = self.attention_params();
        let block_size = kv.block_size();

        let mut x = vec![0f32; t * d];
        cpu::embedding(&self.embed, &batch.tokens, &mut x)?;
        let mut h = vec![0f32; t * d];
        let mut q = vec![0f32; t * nh * hd];
        let mut k = vec![0f32; t * nkv * hd];
        let mut v = vec![0f32; t * nkv * hd];
        let mut attn = vec![0f32; t * nh * hd];
        let mut gate = vec![0f32; t * ff];
        let mut up = vec![0f32; t * ff];
        for (i, l) in self.layers.iter().enumerate() {
            cpu::rms_norm(&x, &l.attn_norm, eps, 0.0, &mut h);
            cpu::linear(&h, t, &l.q, l.q_bias.as_deref(), &mut q)?;
            cpu::linear(&h, t, &l.k, l.k_bias.as_deref(), &mut k)?;
            cpu::linear(&h, t, &l.v, l.v_bias.as_deref(), &mut v)?;
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                cpu::rms_norm_in_place(&mut q, qn, eps, 0.0);
                cpu::rms_norm_in_place(&mut k, kn, eps, 0.0);
            }
            self.rope(&mut q, batch, nh);
            self.rope(&mut k, batch, nkv);
            let layer_kv = kv.layer_mut(i);
            cpu::write_kv(&k, &v, batch, layer_kv, block_size)?;
            cpu::paged_attention(&q, batch, layer_kv, block_size, &params, &mut attn)?;
            cpu::linear(&attn, t, &l.o, None, &mut h)?;
            add_in_place(&mut x, &h);
            cpu::rms_norm(&x, &l.ffn_norm, eps, 0.0, &mut h);
            cpu::linear(&h, t, &l.gate, None, &mut gate)?;
            cpu::linear(&h, t, &l.up, None, &mut up)?;
            cpu::silu_mul(&mut gate, &up);
            cpu::linear(&gate, t, &l.down, None, &mut h)?;
            add_in_place(&mut x, &h);
        }
        let n_out = batch.logits_indices.len();
        let mut picked = Vec::with_capacity(n_out * d);
        for &idx in &batch.logits_indices {
            picked.extend_from_slice(&x[idx * d..(idx + 1) * d]);
        }
        let mut normed = vec![0f32; n_out * d];
        cpu::rms_norm(&picked, &self.norm, eps, 0.0, &mut normed);
        let mut logits = vec![0f32; n_out * c.vocab_size];
        cpu::linear(&normed, n_out, &self.lm_head, None, &mut logits)?;
        Ok(logits)
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}
