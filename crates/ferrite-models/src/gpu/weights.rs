//! The llama family's weights on a CUDA device: each layer's fused QKV and gate-up matrices
//! (one GEMM each), its output and down projections, f32 norm weights, and the embedding
//! (shared with the LM head when tied). A matrix is bf16, or — from a GGUF file whose pieces
//! of it are all in block types the GPU reads (`QuantMatrix::supports`) — the file's blocks
//! as they are, dequantized inside the kernels. Uploaded once from the host weights (other
//! dtypes dequantized to f32 and rounded to bf16 on the way), or generated on the device from
//! a seed for synthetic models, in bf16 or a block type.

use std::cell::Cell;
use std::sync::Arc;

use ferrite_runtime::cuda::ops::{self, Matrix, QuantMatrix};
use ferrite_runtime::cuda::{CudaSlice, Gpu};
use ferrite_runtime::DType;
use half::bf16;

use crate::config::ModelConfig;
use crate::error::{LoadError, Result};
use crate::weights::Weights;

pub struct LayerWeights {
    pub attn_norm: CudaSlice<f32>,
    /// `[(n_heads + 2 n_kv_heads) * head_dim, hidden]`: q rows, then k, then v.
    pub qkv: Matrix,
    pub qkv_bias: Option<CudaSlice<bf16>>,
    pub o: Matrix,
    pub ffn_norm: CudaSlice<f32>,
    /// `[2 * intermediate, hidden]`: gate rows, then up.
    pub gate_up: Matrix,
    pub down: Matrix,
}

pub struct LlamaWeights {
    pub embed: Arc<Matrix>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: CudaSlice<f32>,
    /// The embedding itself when the model ties them.
    pub lm_head: Arc<Matrix>,
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

/// The rows of one piece of a fused matrix: a host tensor's raw bytes and block type.
struct Piece {
    dtype: DType,
    rows: usize,
    bytes: Vec<u8>,
}

/// A matrix stacked from `pieces` (each `[rows, cols]`): the GGUF blocks when every piece is in
/// a block type the kernels read (neighbouring pieces of one type merged into one part, so a
/// fused gate-up of one type takes the fused kernel), bf16 otherwise.
fn stack(gpu: &Gpu, cols: usize, pieces: Vec<Piece>) -> Result<Matrix> {
    if pieces.iter().all(|p| QuantMatrix::supports(p.dtype)) {
        let mut merged: Vec<Piece> = Vec::new();
        for p in pieces {
            match merged.last_mut() {
                Some(last) if last.dtype == p.dtype => {
                    last.rows += p.rows;
                    last.bytes.extend_from_slice(&p.bytes);
                }
                _ => merged.push(p),
            }
        }
        let parts: Vec<(DType, usize, &[u8])> = merged.iter().map(|p| (p.dtype, p.rows, p.bytes.as_slice())).collect();
        return Ok(Matrix::Quant(QuantMatrix::upload(gpu, cols, &parts)?));
    }
    let mut all = Vec::new();
    for p in &pieces {
        let mut values = vec![0f32; p.rows * cols];
        for (row, out) in p.bytes.chunks_exact(p.dtype.row_bytes(cols)?).zip(values.chunks_exact_mut(cols)) {
            ferrite_runtime::quant::dequantize_row(p.dtype, row, out)?;
        }
        all.extend(to_bf16(&values));
    }
    Ok(Matrix::Bf16(gpu.upload(&all)?))
}

impl LlamaWeights {
    /// Upload `w` (HF names, any dtype) to `gpu`; `progress` is told after each layer.
    pub fn upload(cfg: &ModelConfig, w: &Weights, gpu: &Gpu, progress: &dyn Fn(usize)) -> Result<LlamaWeights> {
        let (d, inter, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let (q_rows, kv_rows) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let matrix = |names: &[(&str, usize)], inp: usize| -> Result<Matrix> {
            let mut pieces = Vec::with_capacity(names.len());
            for &(name, rows) in names {
                let t = w.get(name, &[rows, inp])?;
                pieces.push(Piece { dtype: t.dtype(), rows, bytes: t.bytes().to_vec() });
            }
            stack(gpu, inp, pieces)
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
        Ok(Self::assemble(cfg, embed, layers, final_norm, lm_head))
    }

    /// Random weights made on `gpu` from `seed`, in bf16 or a block type the kernels read:
    /// matrices uniform with the variance of a 1/fan-in init (quantized: random blocks about
    /// as wide), unit norms, zero-mean biases; no host data beyond the norm vectors.
    pub fn random(cfg: &ModelConfig, gpu: &Gpu, seed: u64, dtype: DType) -> Result<LlamaWeights> {
        if dtype != DType::BF16 && !QuantMatrix::supports(dtype) {
            return Err(LoadError::Other(format!(
                "synthetic weights in {dtype}: the CUDA path takes bf16, q4_0, q4_1, q5_0, q8_0, q4_k, q5_k or q6_k"
            )));
        }
        let (d, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let stream = Cell::new(seed);
        let next_seed = || {
            stream.set(stream.get().wrapping_add(0x9E37_79B9_7F4A_7C15));
            stream.get()
        };
        let bf16_random = |len: usize, fan_in: usize| -> Result<CudaSlice<bf16>> {
            let mut buf = gpu.alloc::<bf16>(len)?;
            ops::random_uniform(gpu, &mut buf, next_seed(), (3.0 / fan_in as f32).sqrt())?;
            Ok(buf)
        };
        let random = |rows: usize, cols: usize, fan_in: usize| -> Result<Matrix> {
            if dtype == DType::BF16 {
                return Ok(Matrix::Bf16(bf16_random(rows * cols, fan_in)?));
            }
            let amp = (3.0 / fan_in as f32).sqrt();
            Ok(Matrix::Quant(QuantMatrix::random(gpu, dtype, rows, cols, next_seed(), amp)?))
        };
        let embed = Arc::new(random(cfg.vocab_size, d, 3)?);
        let ones = vec![1f32; d];
        let q_width = cfg.num_heads * cfg.head_dim;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            layers.push(LayerWeights {
                attn_norm: gpu.upload(&ones)?,
                qkv: random(qkv_rows(cfg), d, d)?,
                qkv_bias: if cfg.qkv_bias { Some(bf16_random(qkv_rows(cfg), 300)?) } else { None },
                o: random(d, q_width, q_width)?,
                ffn_norm: gpu.upload(&ones)?,
                gate_up: random(2 * inter, d, d)?,
                down: random(d, inter, inter)?,
            });
        }
        let lm_head = if cfg.tie_word_embeddings { embed.clone() } else { Arc::new(random(cfg.vocab_size, d, d)?) };
        let final_norm = gpu.upload(&ones)?;
        gpu.synchronize()?;
        Ok(Self::assemble(cfg, embed, layers, final_norm, lm_head))
    }

    fn assemble(
        cfg: &ModelConfig,
        embed: Arc<Matrix>,
        layers: Vec<LayerWeights>,
        final_norm: CudaSlice<f32>,
        lm_head: Arc<Matrix>,
    ) -> LlamaWeights {
        let matrices: usize =
            layers.iter().map(|l| l.qkv.bytes() + l.o.bytes() + l.gate_up.bytes() + l.down.bytes()).sum();
        let head = if Arc::ptr_eq(&embed, &lm_head) { 0 } else { lm_head.bytes() };
        let small = 4 * (2 * cfg.num_layers + 1) * cfg.hidden_size
            + if cfg.qkv_bias { 2 * cfg.num_layers * qkv_rows(cfg) } else { 0 };
        LlamaWeights { bytes: matrices + embed.bytes() + head + small, embed, layers, final_norm, lm_head }
    }

    /// bf16 values of scratch the larger-batch GEMMs over the layers' quantized matrices use
    /// (the largest such matrix; 0 when all are bf16). The LM head is not counted: its
    /// many-row products run the skinny GEMM 8 rows at a time rather than hold a vocab-sized
    /// scratch.
    pub fn scratch_len(&self) -> usize {
        let layer = |l: &LayerWeights| [&l.qkv, &l.o, &l.gate_up, &l.down].map(|m| m.scratch_len()).into_iter().max();
        self.layers.iter().filter_map(layer).max().unwrap_or(0)
    }
}

/// Device bytes of the weights of `cfg` in bf16 (f32 norms).
pub fn weight_bytes(cfg: &ModelConfig) -> usize {
    let (d, inter) = (cfg.hidden_size, cfg.intermediate_size);
    let per_layer = qkv_rows(cfg) * d + d * cfg.num_heads * cfg.head_dim + 3 * inter * d;
    let heads = if cfg.tie_word_embeddings { 1 } else { 2 };
    2 * (cfg.num_layers * per_layer + heads * cfg.vocab_size * d) + 4 * (2 * cfg.num_layers + 1) * d
}
