//! The Gemma families' weights on a CUDA device, bf16 matrices and f32 norm weights (the
//! `1 + w` offset folded in at upload): per layer a fused QKV matrix (q only for a KV-shared
//! layer; the keys twice for `attention_k_eq_v`), q/k norms, output, fused gate-up and down
//! projections, the sandwich norms, Gemma 4's per-layer-input projections, layer scalar and
//! MoE experts; the embedding, LM head and Gemma 4's per-layer embedding table. Read from the
//! host weights (any stored dtype), or random from a seed for synthetic models: one builder
//! over either source.

use std::sync::Arc;

use ferrite_runtime::cuda::ops::{self, Matrix};
use ferrite_runtime::cuda::{CudaSlice, Gpu};
use half::bf16;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::gemma_plan::GemmaPlan;
use crate::weights::Weights;

/// Gemma 4's per-layer-input weights of one layer.
pub struct LayerInputWeights {
    /// `[width, hidden]`.
    pub gate: CudaSlice<bf16>,
    /// `[hidden, width]`.
    pub projection: CudaSlice<bf16>,
    pub norm: CudaSlice<f32>,
}

/// A layer's MoE block.
pub struct MoeWeights {
    /// The router's norm weight: its learned scale times `hidden^-1/2`.
    pub router_norm: CudaSlice<f32>,
    /// `[experts, hidden]`.
    pub router: CudaSlice<bf16>,
    /// Per expert, on the host (routing happens there).
    pub per_expert_scale: Vec<f32>,
    /// `[experts, 2 * inter, hidden]`: each expert's gate rows, then its up rows.
    pub gate_up: CudaSlice<bf16>,
    /// `[experts, hidden, inter]`.
    pub down: CudaSlice<bf16>,
    pub post_mlp_norm: CudaSlice<f32>,
    pub pre_norm: CudaSlice<f32>,
    pub post_norm: CudaSlice<f32>,
}

pub struct LayerWeights {
    pub input_norm: CudaSlice<f32>,
    pub qkv: CudaSlice<bf16>,
    pub qkv_bias: Option<CudaSlice<bf16>>,
    pub q_norm: Option<CudaSlice<f32>>,
    pub k_norm: Option<CudaSlice<f32>>,
    pub o: CudaSlice<bf16>,
    pub post_attn_norm: Option<CudaSlice<f32>>,
    /// `pre_feedforward_layernorm` (Gemma 1: `post_attention_layernorm`).
    pub ffn_norm: CudaSlice<f32>,
    pub gate_up: CudaSlice<bf16>,
    pub down: CudaSlice<bf16>,
    pub post_ffn_norm: Option<CudaSlice<f32>>,
    pub input: Option<LayerInputWeights>,
    pub moe: Option<MoeWeights>,
    pub scalar: f32,
}

/// Gemma 4's per-layer embedding table and the projection of the embeddings.
pub struct PerLayerWeights {
    /// `[vocab_per_layer, layers * width]`.
    pub table: CudaSlice<bf16>,
    /// `[layers * width, hidden]`.
    pub projection: CudaSlice<bf16>,
    pub norm: CudaSlice<f32>,
}

pub struct GemmaWeights {
    pub embed: Arc<Matrix>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: CudaSlice<f32>,
    /// The embedding itself when the model ties them.
    pub lm_head: Arc<Matrix>,
    pub per_layer: Option<PerLayerWeights>,
    /// Bytes of device memory the weights take.
    pub bytes: usize,
}

/// Where the values come from: a checkpoint's tensors by HF name, or a seeded generator.
trait Source {
    /// The tensors `parts` (name, shape), concatenated as one bf16 matrix.
    fn matrix(&mut self, parts: &[(&str, &[usize])]) -> Result<CudaSlice<bf16>>;
    /// An f32 vector of `len` values plus `offset` (norm weights, scales).
    fn vector(&mut self, name: &str, len: usize, offset: f32) -> Result<Vec<f32>>;
    fn contains(&self, name: &str) -> bool;
}

struct FileSource<'a> {
    w: &'a Weights,
    gpu: &'a Gpu,
}

impl Source for FileSource<'_> {
    fn matrix(&mut self, parts: &[(&str, &[usize])]) -> Result<CudaSlice<bf16>> {
        let mut all = Vec::new();
        for &(name, shape) in parts {
            all.extend(self.w.get(name, shape)?.to_f32_vec()?.into_iter().map(bf16::from_f32));
        }
        Ok(self.gpu.upload(&all)?)
    }

    fn vector(&mut self, name: &str, len: usize, offset: f32) -> Result<Vec<f32>> {
        self.w.norm(name, len, offset)
    }

    fn contains(&self, name: &str) -> bool {
        self.w.contains(name)
    }
}

/// Matrices uniform with the variance of a 1/fan-in init, made on the device; unit norms and
/// scales.
struct RandomSource<'a> {
    gpu: &'a Gpu,
    stream: u64,
}

impl Source for RandomSource<'_> {
    fn matrix(&mut self, parts: &[(&str, &[usize])]) -> Result<CudaSlice<bf16>> {
        let len: usize = parts.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        let fan_in = parts.first().and_then(|(_, s)| s.last()).copied().unwrap_or(1);
        let mut buf = self.gpu.alloc::<bf16>(len)?;
        self.stream = self.stream.wrapping_add(0x9E37_79B9_7F4A_7C15);
        ops::random_uniform(self.gpu, &mut buf, self.stream, (3.0 / fan_in as f32).sqrt())?;
        Ok(buf)
    }

    fn vector(&mut self, _name: &str, len: usize, _offset: f32) -> Result<Vec<f32>> {
        Ok(vec![1.0; len])
    }

    fn contains(&self, _name: &str) -> bool {
        false
    }
}

impl GemmaWeights {
    /// Upload `w` (HF names, any dtype) for `plan`; `progress` is told after each layer.
    pub fn upload(
        cfg: &ModelConfig,
        plan: &GemmaPlan,
        w: &Weights,
        gpu: &Gpu,
        progress: &dyn Fn(usize),
    ) -> Result<GemmaWeights> {
        build(cfg, plan, &mut FileSource { w, gpu }, gpu, progress)
    }

    /// Random weights for `plan` made on `gpu` from `seed` (embeddings of unit-ish scale).
    pub fn random(cfg: &ModelConfig, plan: &GemmaPlan, gpu: &Gpu, seed: u64) -> Result<GemmaWeights> {
        let w = build(cfg, plan, &mut RandomSource { gpu, stream: seed }, gpu, &|_| {})?;
        gpu.synchronize()?;
        Ok(w)
    }
}

fn build(
    cfg: &ModelConfig,
    plan: &GemmaPlan,
    src: &mut dyn Source,
    gpu: &Gpu,
    progress: &dyn Fn(usize),
) -> Result<GemmaWeights> {
    let (d, n) = (cfg.hidden_size, plan.layers.len());
    let offset = plan.norm_offset;
    let mut bytes = 0usize;
    let mut norm = |src: &mut dyn Source, name: &str, dim: usize, offset: f32| -> Result<CudaSlice<f32>> {
        bytes += 4 * dim;
        Ok(gpu.upload(&src.vector(name, dim, offset)?)?)
    };
    let embed = Arc::new(Matrix::Bf16(src.matrix(&[("model.embed_tokens.weight", &[cfg.vocab_size, d])])?));
    let mut matrix_bytes = cfg.vocab_size * d;
    let mut layers = Vec::with_capacity(n);
    for (i, l) in plan.layers.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let a = &l.attn;
        let (nh, nkv, hd) = (a.params.n_heads, a.params.n_kv_heads, a.params.head_dim);
        let (q, k, v) = (p("self_attn.q_proj"), p("self_attn.k_proj"), p("self_attn.v_proj"));
        let (qw, kw, vw) = (format!("{q}.weight"), format!("{k}.weight"), format!("{v}.weight"));
        let (q_shape, kv_shape) = ([nh * hd, d], [nkv * hd, d]);
        let mut parts: Vec<(&str, &[usize])> = vec![(&qw, &q_shape)];
        if !a.shared {
            parts.push((&kw, &kv_shape));
            // `attention_k_eq_v`: the raw keys are the values, so the key rows serve twice.
            parts.push((if a.k_eq_v { &kw } else { &vw }, &kv_shape));
        }
        let qkv_rows: usize = parts.iter().map(|(_, s)| s[0]).sum();
        let qkv = src.matrix(&parts)?;
        let qkv_bias = if a.bias {
            let mut b = src.vector(&format!("{q}.bias"), nh * hd, 0.0)?;
            if !a.shared {
                b.extend(src.vector(&format!("{k}.bias"), nkv * hd, 0.0)?);
                let vb = if a.k_eq_v { format!("{k}.bias") } else { format!("{v}.bias") };
                b.extend(src.vector(&vb, nkv * hd, 0.0)?);
            }
            Some(gpu.upload(&b.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>())?)
        } else {
            None
        };
        let (q_norm, k_norm) = match a.qk_norm {
            Some(off) => (
                Some(norm(src, &p("self_attn.q_norm.weight"), hd, off)?),
                if a.shared { None } else { Some(norm(src, &p("self_attn.k_norm.weight"), hd, off)?) },
            ),
            None => (None, None),
        };
        let inter = l.intermediate;
        let (gw, uw, dw) = (p("mlp.gate_proj.weight"), p("mlp.up_proj.weight"), p("mlp.down_proj.weight"));
        let (sandwich, ffn_name) = if plan.sandwich {
            (true, p("pre_feedforward_layernorm.weight"))
        } else {
            (false, p("post_attention_layernorm.weight"))
        };
        let input = match plan.per_layer_input {
            Some((_, width)) => {
                matrix_bytes += 2 * width * d;
                Some(LayerInputWeights {
                    gate: src.matrix(&[(&p("per_layer_input_gate.weight"), &[width, d])])?,
                    projection: src.matrix(&[(&p("per_layer_projection.weight"), &[d, width])])?,
                    norm: norm(src, &p("post_per_layer_input_norm.weight"), d, offset)?,
                })
            }
            None => None,
        };
        let moe = match plan.moe {
            Some(shape) => {
                let (e, mi) = (shape.num_experts, shape.intermediate);
                let root = (d as f64).powf(-0.5) as f32;
                let scale = src.vector(&p("router.scale"), d, 0.0)?;
                matrix_bytes += e * d + 3 * e * mi * d;
                Some(MoeWeights {
                    router_norm: gpu.upload(&scale.iter().map(|s| s * root).collect::<Vec<_>>())?,
                    router: src.matrix(&[(&p("router.proj.weight"), &[e, d])])?,
                    per_expert_scale: src.vector(&p("router.per_expert_scale"), e, 0.0)?,
                    gate_up: src.matrix(&[(&p("experts.gate_up_proj"), &[e, 2 * mi, d])])?,
                    down: src.matrix(&[(&p("experts.down_proj"), &[e, d, mi])])?,
                    post_mlp_norm: norm(src, &p("post_feedforward_layernorm_1.weight"), d, offset)?,
                    pre_norm: norm(src, &p("pre_feedforward_layernorm_2.weight"), d, offset)?,
                    post_norm: norm(src, &p("post_feedforward_layernorm_2.weight"), d, offset)?,
                })
            }
            None => None,
        };
        let scalar = if plan.layer_scalar { src.vector(&p("layer_scalar"), 1, 0.0)?[0] } else { 1.0 };
        matrix_bytes += qkv_rows * d + d * nh * hd + 3 * inter * d;
        layers.push(LayerWeights {
            input_norm: norm(src, &p("input_layernorm.weight"), d, offset)?,
            qkv,
            qkv_bias,
            q_norm,
            k_norm,
            o: src.matrix(&[(&p("self_attn.o_proj.weight"), &[d, nh * hd])])?,
            post_attn_norm: sandwich
                .then(|| norm(src, &p("post_attention_layernorm.weight"), d, offset))
                .transpose()?,
            ffn_norm: norm(src, &ffn_name, d, offset)?,
            gate_up: src.matrix(&[(&gw, &[inter, d]), (&uw, &[inter, d])])?,
            down: src.matrix(&[(&dw, &[d, inter])])?,
            post_ffn_norm: sandwich
                .then(|| norm(src, &p("post_feedforward_layernorm.weight"), d, offset))
                .transpose()?,
            input,
            moe,
            scalar,
        });
        progress(i + 1);
    }
    let per_layer = match plan.per_layer_input {
        Some((vocab, width)) => {
            matrix_bytes += (vocab + d) * n * width;
            Some(PerLayerWeights {
                table: src.matrix(&[("model.embed_tokens_per_layer.weight", &[vocab, n * width])])?,
                projection: src.matrix(&[("model.per_layer_model_projection.weight", &[n * width, d])])?,
                norm: norm(src, "model.per_layer_projection_norm.weight", width, 0.0)?,
            })
        }
        None => None,
    };
    let lm_head = if cfg.tie_word_embeddings && !src.contains("lm_head.weight") {
        embed.clone()
    } else {
        matrix_bytes += cfg.vocab_size * d;
        Arc::new(Matrix::Bf16(src.matrix(&[("lm_head.weight", &[cfg.vocab_size, d])])?))
    };
    let final_norm = norm(src, "model.norm.weight", d, offset)?;
    Ok(GemmaWeights { embed, layers, final_norm, lm_head, per_layer, bytes: bytes + 2 * matrix_bytes })
}
