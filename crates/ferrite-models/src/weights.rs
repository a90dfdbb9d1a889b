//! `Weights`: tensors by their Hugging Face name, from a safetensors dir or a GGUF file.
//!
//! GGUF names are translated (`blk.N.attn_q.weight` ↔ `model.layers.N.self_attn.q_proj.weight`)
//! and, for the llama architecture, the q/k rows llama.cpp's converter permuted are put back
//! in HF order. A model whose RoPE rotates adjacent pairs (GLM) gets its q/k rows (and
//! biases) reordered so that the executors' rotate-half RoPE rotates the same pairs: the
//! attention scores are unchanged, as q and k share the order. Every fetch checks the shape
//! the architecture expects. A bare backbone saved without the `model.` prefix (an embedding
//! model exported from `AutoModel`), or the text model of a multimodal checkpoint (under
//! `model.language_model.`, Qwen3.5), is read under the same names. A matrix of an
//! MLX-quantized checkpoint (`mlx`) is fetched by its `.weight` name like any other, as MLX
//! blocks; one of an FP8 checkpoint (`fp8`) dequantized to the checkpoint's float type, or,
//! for an executor that multiplies in FP8, as its codes and scales (`fp8`).

use std::path::Path;

use ferrite_runtime::{DType, Tensor};

use crate::error::{LoadError, Result};
use crate::fp8::{Fp8Quantization, Fp8Weight};
use crate::gguf::GgufFile;
use crate::mlx::MlxQuantization;
use crate::random_weights::RandomWeights;
use crate::safetensors::SafetensorsDir;

pub enum WeightSource {
    Safetensors(SafetensorsDir),
    Gguf(GgufFile),
    /// Random weights made on demand (a synthetic model on the CPU).
    Random(RandomWeights),
}

/// How the stored tensors differ from the layout the executors read.
#[derive(Debug, Clone, Copy, Default)]
pub struct WeightLayout {
    /// (n_heads, n_kv_heads, head_dim, rotary_dim) when the model's RoPE rotates adjacent
    /// pairs `(2j, 2j + 1)` of the first `rotary_dim` dims of each head.
    pub interleaved_rope: Option<(usize, usize, usize, usize)>,
    /// (n_heads, n_kv_heads, head_dim) when q/k rows must be un-permuted (llama).
    pub unpermute_qk: Option<(usize, usize, usize)>,
    /// Norms around both sublayers (Gemma 2/3): HF `post_attention_layernorm` is the GGUF
    /// `post_attention_norm`, not the pre-FFN `ffn_norm` it is for llama.
    pub sandwich_norms: bool,
}

pub struct Weights {
    source: WeightSource,
    layout: WeightLayout,
    /// The checkpoint's MLX quantization (safetensors only).
    mlx: Option<MlxQuantization>,
    /// The checkpoint's FP8 quantization (safetensors only).
    fp8: Option<Fp8Quantization>,
}

/// Translate an HF tensor name to its GGUF name.
pub fn gguf_name(hf: &str, layout: &WeightLayout) -> Option<String> {
    if let Some((module, suffix)) = hf.rsplit_once('.').filter(|(m, _)| !m.starts_with("model.layers.")) {
        let g = match module {
            "model.embed_tokens" => "token_embd",
            "model.norm" => "output_norm",
            "lm_head" => "output",
            _ => return None,
        };
        return Some(format!("{g}.{suffix}"));
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    // Linear attention's bare parameters: llama.cpp stores `A_log` as `−exp(A_log)` in
    // `ssm_a` (the plan knows) and the dt bias as the bias of `ssm_dt`.
    match rest {
        "linear_attn.A_log" => return Some(format!("blk.{layer}.ssm_a")),
        "linear_attn.dt_bias" => return Some(format!("blk.{layer}.ssm_dt.bias")),
        _ => {}
    }
    let (module, suffix) = rest.rsplit_once('.')?;
    let g = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.qkv_proj" => "attn_qkv",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" if layout.sandwich_norms => "post_attention_norm",
        "post_self_attn_layernorm" => "post_attention_norm",
        "post_mlp_layernorm" => "post_ffw_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" | "mlp.c_proj" => "ffn_down",
        "mlp.gate_up_proj" | "mlp.c_fc" => "ffn_up",
        // Experts: the router, and each projection of every expert stacked in one tensor.
        "mlp.gate" | "block_sparse_moe.gate" => "ffn_gate_inp",
        "mlp.experts.gate_proj" | "block_sparse_moe.experts.w1" => "ffn_gate_exps",
        "mlp.experts.up_proj" | "block_sparse_moe.experts.w3" => "ffn_up_exps",
        "mlp.experts.down_proj" | "block_sparse_moe.experts.w2" => "ffn_down_exps",
        // The shared expert and its sigmoid gate (Qwen3-Next).
        "mlp.shared_expert.gate_proj" => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" => "ffn_down_shexp",
        "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
        // Gated DeltaNet (Qwen3-Next's packed `in_proj_qkvz` becomes `attn_qkv` + `attn_gate`).
        "linear_attn.in_proj_qkv" => "attn_qkv",
        "linear_attn.in_proj_z" => "attn_gate",
        "linear_attn.in_proj_b" => "ssm_beta",
        "linear_attn.in_proj_a" => "ssm_alpha",
        "linear_attn.in_proj_ba" => "ssm_ba",
        "linear_attn.conv1d" => "ssm_conv1d",
        "linear_attn.norm" => "ssm_norm",
        "linear_attn.out_proj" => "ssm_out",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

impl Weights {
    pub fn new(source: WeightSource, layout: WeightLayout) -> Weights {
        Weights { source, layout, mlx: None, fp8: None }
    }

    /// These weights with the MLX quantization `config.json` declares (`None`: plain floats).
    pub fn with_mlx(self, mlx: Option<MlxQuantization>) -> Weights {
        Weights { mlx, ..self }
    }

    /// These weights with the FP8 quantization `config.json` declares (`None`: plain floats).
    pub fn with_fp8(self, fp8: Option<Fp8Quantization>) -> Weights {
        Weights { fp8, ..self }
    }

    /// The float type FP8 matrices are dequantized to for the CPU, when the checkpoint has any.
    pub fn fp8_dequantized_to(&self) -> Option<DType> {
        self.fp8.as_ref().map(Fp8Quantization::float)
    }

    /// The FP8 module whose `.weight` is the stored tensor `name`, if it is one.
    fn fp8_module<'a>(&self, name: &'a str) -> Option<(&Fp8Quantization, &SafetensorsDir, &'a str)> {
        let (WeightSource::Safetensors(s), Some(q)) = (&self.source, &self.fp8) else { return None };
        let module = name.strip_suffix(".weight")?;
        Fp8Quantization::quantized(s, module).then_some((q, s, module))
    }

    /// The matrix `hf` (`[rows, cols]`) as FP8 codes and scales, when the checkpoint stores it
    /// so (`None` otherwise), its rows in the order `get` would give them.
    pub fn fp8(&self, hf: &str, rows: usize, cols: usize) -> Result<Option<Fp8Weight>> {
        let Some(name) = self.file_name(hf) else { return Ok(None) };
        let Some((q, s, module)) = self.fp8_module(&name) else { return Ok(None) };
        let w = q.weight(s, module, rows, cols)?;
        Ok(Some(match self.rope_order(hf) {
            Some(order) => w.permute_rows(&order),
            None => w,
        }))
    }

    /// The MLX-quantized module whose `.weight` is the stored tensor `name`, if it is one.
    fn mlx_module<'a>(&self, name: &'a str) -> Option<(&MlxQuantization, &SafetensorsDir, &'a str)> {
        let (WeightSource::Safetensors(s), Some(q)) = (&self.source, &self.mlx) else { return None };
        let module = name.strip_suffix(".weight")?;
        MlxQuantization::quantized(s, module).then_some((q, s, module))
    }

    fn path(&self, name: &str) -> &Path {
        match &self.source {
            WeightSource::Safetensors(s) => s.path_of(name),
            WeightSource::Gguf(g) => g.path(),
            WeightSource::Random(_) => Path::new("synthetic"),
        }
    }

    fn file_name(&self, hf: &str) -> Option<String> {
        match &self.source {
            // A bare backbone (`Qwen3Model`, `Gemma3TextModel`) is saved without `model.`.
            WeightSource::Safetensors(s) => match hf.strip_prefix("model.") {
                Some(bare) if !s.contains(hf) && s.contains(bare) => Some(bare.to_string()),
                // A multimodal checkpoint's text model (Qwen3.5): `model.language_model.`.
                Some(rest) if !s.contains(hf) && s.contains(&format!("model.language_model.{rest}")) => {
                    Some(format!("model.language_model.{rest}"))
                }
                _ => Some(hf.to_string()),
            },
            WeightSource::Gguf(_) => gguf_name(hf, &self.layout),
            WeightSource::Random(_) => Some(hf.to_string()),
        }
    }

    pub fn contains(&self, hf: &str) -> bool {
        match (&self.source, self.file_name(hf)) {
            (WeightSource::Safetensors(s), Some(n)) => s.contains(&n),
            (WeightSource::Gguf(g), Some(n)) => g.tensor_info(&n).is_some(),
            // Optional tensors (biases, an untied head) are absent; the loader asks for the rest.
            (WeightSource::Random(_), _) => false,
            _ => false,
        }
    }

    /// The tensor `hf`, checked to have `shape`.
    pub fn get(&self, hf: &str, shape: &[usize]) -> Result<Tensor> {
        let name = self.file_name(hf).ok_or_else(|| LoadError::tensor(self.path(hf), hf, "has no GGUF name"))?;
        let t = match (&self.source, self.mlx_module(&name), self.fp8_module(&name)) {
            (_, Some((q, s, module)), _) => q.matrix(s, module, shape)?,
            (_, _, Some((q, s, module))) if shape.len() == 2 => q.dequantized(s, module, shape[0], shape[1])?,
            (_, _, Some(_)) => {
                let why = format!("FP8 codes read as {shape:?} (FP8 tensors are read as matrices, one per expert)");
                return Err(LoadError::tensor(self.path(hf), &name, why));
            }
            (WeightSource::Safetensors(s), _, _) => s.tensor(&name)?,
            (WeightSource::Gguf(g), _, _) => g.tensor(&name)?,
            (WeightSource::Random(r), _, _) => r.tensor(&name, shape)?,
        };
        if t.shape() != shape {
            return Err(LoadError::tensor(self.path(hf), &name, format!("shape {:?}, expected {shape:?}", t.shape())));
        }
        let t = match self.layout.unpermute_qk {
            Some((nh, _, hd)) if hf.ends_with("q_proj.weight") => unpermute(&t, nh, hd),
            Some((_, nkv, hd)) if hf.ends_with("k_proj.weight") => unpermute(&t, nkv, hd),
            _ => Ok(t),
        };
        let t = match (t, self.rope_order(hf)) {
            (Ok(t), Some(order)) if t.shape().len() == 2 => t.permute_rows(&order),
            (t, _) => t,
        };
        t.map_err(|e| LoadError::tensor(self.path(hf), &name, e.to_string()))
    }

    /// The row order that turns `hf`'s adjacent-pair RoPE dims into rotate-half pairs, for a q
    /// or k projection of an interleaved-RoPE model.
    fn rope_order(&self, hf: &str) -> Option<Vec<usize>> {
        let (nh, nkv, hd, rotary) = self.layout.interleaved_rope?;
        let heads = if hf.contains("q_proj.") {
            nh
        } else if hf.contains("k_proj.") {
            nkv
        } else {
            return None;
        };
        let half = rotary / 2;
        let within = |r: usize| {
            if r < half {
                2 * r
            } else if r < rotary {
                2 * (r - half) + 1
            } else {
                r
            }
        };
        Some((0..heads * hd).map(|r| (r / hd) * hd + within(r % hd)).collect())
    }

    /// A small tensor (norm weight, bias, scale) as f32 values, each checked to be finite: a
    /// NaN or infinite norm would turn every logit into NaN, so it is an error at load.
    pub fn get_f32(&self, hf: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.get(hf, shape)?;
        let values = t.to_f32_vec().map_err(|e| LoadError::tensor(self.path(hf), hf, e.to_string()))?;
        if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(LoadError::tensor(
                self.path(hf),
                hf,
                format!("value {i} is {v} (corrupt weights; --verify-weights checks the file's digest)"),
            ));
        }
        match self.rope_order(hf) {
            Some(order) if shape.len() == 1 && order.len() == values.len() => {
                Ok(order.iter().map(|&i| values[i]).collect())
            }
            _ => Ok(values),
        }
    }

    /// An RMSNorm weight as the multiplier the model applies: `offset + w` for HF files (Gemma
    /// 1–3 keep `w` of a `(1 + w)` norm: offset 1), the stored value for GGUF files, whose
    /// converter already added the offset.
    pub fn norm(&self, hf: &str, dim: usize, offset: f32) -> Result<Vec<f32>> {
        let mut w = self.get_f32(hf, &[dim])?;
        if matches!(self.source, WeightSource::Safetensors(_)) && offset != 0.0 {
            w.iter_mut().for_each(|v| *v += offset);
        }
        Ok(w)
    }

    /// Bytes of all weight files (for the load report).
    pub fn file_bytes(&self) -> usize {
        match &self.source {
            WeightSource::Safetensors(s) => s.total_bytes(),
            WeightSource::Gguf(g) => g.data_bytes(),
            WeightSource::Random(r) => r.bytes(),
        }
    }

    /// The dtype most of the model's matrices use (for reports).
    pub fn dtype_of(&self, hf: &str) -> Option<DType> {
        let name = self.file_name(hf)?;
        if let Some((q, s, module)) = self.mlx_module(&name) {
            return q.dtype_of(s, module);
        }
        if self.fp8_module(&name).is_some() {
            return Some(DType::F8E4M3);
        }
        match &self.source {
            WeightSource::Safetensors(s) => s.tensor(&name).ok().map(|t| t.dtype()),
            WeightSource::Gguf(g) => g.tensor_info(&name).map(|t| t.dtype),
            WeightSource::Random(r) => Some(r.dtype()),
        }
    }
}

/// Undo llama.cpp's rope permutation: GGUF row `h*hd + 2j + s` holds HF row `h*hd + s*hd/2 + j`.
fn unpermute(t: &Tensor, heads: usize, hd: usize) -> ferrite_runtime::Result<Tensor> {
    if t.rows() != heads * hd {
        return Err(ferrite_runtime::RuntimeError::Shape(format!("{} rows for {heads} heads of {hd}", t.rows())));
    }
    let half = hd / 2;
    let order: Vec<usize> = (0..heads * hd)
        .map(|r| {
            let (h, within) = (r / hd, r % hd);
            let (s, j) = (within / half, within % half);
            h * hd + 2 * j + s
        })
        .collect();
    t.permute_rows(&order)
}
