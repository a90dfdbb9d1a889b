//! The llama family's weights on a CUDA device, bf16: each layer's fused QKV and gate-up
//! matrices (one GEMM each), its output and down projections, f32 norm weights, and the
//! embedding (shared with the LM head when tied). Uploaded once from the host weights
//! (any stored dtype, dequantized to f32 and rounded to bf16 on the way), or generated on the
//! device from a seed for synthetic models.

use std::sync::Arc;

use ferrite_runtime::cuda::{ops, CudaSlice, Gpu};
use half::bf16;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights::Weights;

pub struct LayerWeights {
    pub attn_norm: CudaSlice<f32>,
    /// `[(n_heads + 2 n_kv_heads) * head_dim, hidden]`: q rows, then k, then v.
    pub qkv: CudaSlice<bf16>,
    pub qkv_bias: Option<CudaSlice<bf16>>,
    pub o: CudaSlice<bf16>,
    pub ffn_norm: CudaSlice<f32>,
    /// `[2 * intermediate, hidden]`: gate rows, then up.
    pub gate_up: CudaSlice<bf16>,
    pub down: CudaSlice<bf16>,
}

pub struct LlamaWeights {
    pub embed: Arc<CudaSlice<bf16>>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: CudaSlice<f32>,
    /// The embedding itself when the model ties them.
    pub lm_head: Arc<CudaSlice<bf16>>,
    /// Bytes of device memory the weights take.
    pub bytes: usize,
}

/// Widths of the fused matrices of `cfg`.
pub fn qkv_rows(cfg: &ModelConfig) -> usize {
    (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

impl LlamaWeights {
    /// Upload `w` (HF names, any dtype) to `gpu`; `progress` is told after each layer.
    pub fn upload(cfg: &ModelConfig, w: &Weights, gpu: &Gpu, progress: &dyn Fn(usize)) -> Result<LlamaWeights> {
        let (d, inter, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let (q_rows, kv_rows) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let matrix = |names: &[(&str, usize)], inp: usize| -> Result<CudaSlice<bf16>> {
            let mut all = Vec::new();
            for &(name, rows) in names {
                all.extend(to_bf16(&w.get(name, &[rows, inp])?.to_f32_vec()?));
            }
            Ok(gpu.upload(&all)?)
        };
        let norm = |name: &str| -> Result<CudaSlice<f32>> { Ok(gpu.upload(&w.norm(name, d, 0.0)?)?) };
        let embed = Arc::new(matrix(&[("model.embed_tokens.weight", cfg.vocab_size)], d)?);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let (q, k, v) = (p("self_attn.q_proj"), p("self_attn.k_proj"), p("self_attn.v_proj"));
            let qkv_bias = if cfg.qkv_bias {
                let mut b = w.get_f32(&format!("{q}.bias"), &[q_rows])?;
                b.extend(w.get_f32(&format!("{k}.bias"), &[kv_rows])?);
                b.extend(w.get_f32(&format!("{v}.bias"), &[kv_rows])?);
                Some(gpu.upload(&to_bf16(&b))?)
            } else {
                None
            };
            let (qw, kw, vw) = (format!("{q}.weight"), format!("{k}.weight"), format!("{v}.weight"));
            let (gw, uw) = (p("mlp.gate_proj.weight"), p("mlp.up_proj.weight"));
            layers.push(LayerWeights {
                attn_norm: norm(&p("input_layernorm.weight"))?,
                qkv: matrix(&[(&qw, q_rows), (&kw, kv_rows), (&vw, kv_rows)], d)?,
                qkv_bias,
                o: matrix(&[(&p("self_attn.o_proj.weight"), d)], q_rows)?,
                ffn_norm: norm(&p("post_attention_layernorm.weight"))?,
                gate_up: matrix(&[(&gw, inter), (&uw, inter)], d)?,
                down: matrix(&[(&p("mlp.down_proj.weight"), d)], inter)?,
            });
            progress(i + 1);
        }
        let lm_head = if cfg.tie_word_embeddings && !w.contains("lm_head.weight") {
            embed.clone()
        } else {
            Arc::new(matrix(&[("lm_head.weight", cfg.vocab_size)], d)?)
        };
        let final_norm = norm("model.norm.weight")?;
        Ok(LlamaWeights { bytes: weight_bytes(cfg), embed, layers, final_norm, lm_head })
    }

    /// Random weights made on `gpu` from `seed`: matrices uniform with the variance of a
    /// 1/fan-in init, unit norms, zero-mean biases; no host data beyond the norm vectors.
    pub fn random(cfg: &ModelConfig, gpu: &Gpu, seed: u64) -> Result<LlamaWeights> {
        let (d, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let mut stream = seed;
        let mut random = |len: usize, fan_in: usize| -> Result<CudaSlice<bf16>> {
            let mut buf = gpu.alloc::<bf16>(len)?;
            stream = stream.wrapping_add(0x9E37_79B9_7F4A_7C15);
            ops::random_uniform(gpu, &mut buf, stream, (3.0 / fan_in as f32).sqrt())?;
            Ok(buf)
        };
        let embed = Arc::new(random(cfg.vocab_size * d, 3)?);
        let ones = vec![1f32; d];
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            layers.push(LayerWeights {
                attn_norm: gpu.upload(&ones)?,
                qkv: random(qkv_rows(cfg) * d, d)?,
                qkv_bias: if cfg.qkv_bias { Some(random(qkv_rows(cfg), 300)?) } else { None },
                o: random(d * cfg.num_heads * cfg.head_dim, cfg.num_heads * cfg.head_dim)?,
                ffn_norm: gpu.upload(&ones)?,
                gate_up: random(2 * inter * d, d)?,
                down: random(d * inter, inter)?,
            });
        }
        let lm_head = if cfg.tie_word_embeddings { embed.clone() } else { Arc::new(random(cfg.vocab_size * d, d)?) };
        let final_norm = gpu.upload(&ones)?;
        gpu.synchronize()?;
        Ok(LlamaWeights { bytes: weight_bytes(cfg), embed, layers, final_norm, lm_head })
    }
}

/// Device bytes of the weights of `cfg` in bf16 (f32 norms).
pub fn weight_bytes(cfg: &ModelConfig) -> usize {
    let (d, inter) = (cfg.hidden_size, cfg.intermediate_size);
    let per_layer = qkv_rows(cfg) * d + d * cfg.num_heads * cfg.head_dim + 3 * inter * d;
    let heads = if cfg.tie_word_embeddings { 1 } else { 2 };
    2 * (cfg.num_layers * per_layer + heads * cfg.vocab_size * d) + 4 * (2 * cfg.num_layers + 1) * d
}
