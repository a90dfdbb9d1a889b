//! A decoder plan's weights on a CUDA device. Matrices are `Matrix` values: bf16, or — from a
//! GGUF file whose pieces of a matrix are all in block types the kernels read — the file's
//! blocks as they are, or — from an FP8 checkpoint whose pieces are all FP8, or any layer
//! projection under `--quantization fp8` — e4m3 codes with their scales (the embedding, the LM
//! head and routers stay bf16; routed experts are FP8 rows likewise). Per layer: a fused QKV matrix (q only for a KV-shared
//! layer; the keys twice for `attention_k_eq_v`; a gated output's gate rows last) with its
//! bias, q/k norms (per head or over the whole projection), the output projection and its
//! bias — or a gated DeltaNet layer's projections, conv and gates (`deltanet`) — the dense MLP (a fused gate-up or a plain
//! up matrix and the down projection with their biases; none where experts replace it), the
//! norms the layer's names list (f32, the `1 + w` offset folded in; LayerNorm with its bias),
//! Gemma 4's per-layer-input projections and layer scalar, and the routed experts
//! (`moe::MoeWeights`: a bf16 router and one stacked `ExpertMatrix` per projection, in the
//! file's block type where the kernels read it, and a shared expert with its gate); the embedding, LM head, final norm and
//! per-layer embedding table. Read from the host weights (any stored dtype) or random from a
//! seed for synthetic models: one builder over either source.

use std::cell::Cell;
use std::sync::Arc;

use ferrite_runtime::cuda::ops::{self, ExpertMatrix, Fp8Matrix, Matrix, NormWeights, QuantMatrix};
use ferrite_runtime::cuda::{CudaSlice, DevicePtr, Gpu};
use ferrite_runtime::DType;
use half::bf16;

use super::deltanet::DeltaWeights;
use super::moe::{stack_experts, Gemma4Moe, MoeWeights, SharedWeights};
use crate::config::ModelConfig;
use crate::error::{LoadError, Result};
use crate::fp8::Fp8Weight;
use crate::moe::MoeShape;
use crate::plan::{DecoderPlan, ExpertNames, LayerPlan, MlpNames, MoePlan, MoeStyle, NormKind, QkvNames};
use crate::weights::Weights;

/// Gemma 4's per-layer-input weights of one layer.
pub struct LayerInputWeights {
    /// `[width, hidden]`.
    pub gate: CudaSlice<bf16>,
    /// `[hidden, width]`.
    pub projection: CudaSlice<bf16>,
    pub norm: CudaSlice<f32>,
}

/// A norm's weights: RMSNorm's scale, or LayerNorm's scale and bias.
pub struct DeviceNorm {
    pub weight: CudaSlice<f32>,
    pub bias: Option<CudaSlice<f32>>,
}

impl DeviceNorm {
    /// The norm as the ops take it, with `eps`.
    pub fn params(&self, eps: f32) -> NormWeights<'_> {
        NormWeights::new(&self.weight, self.bias.as_ref().map(|b| b as &dyn DevicePtr<f32>), eps)
    }

    fn bytes(&self) -> usize {
        4 * (self.weight.len() + self.bias.as_ref().map_or(0, |b| b.len()))
    }
}

/// A layer's dense MLP.
pub struct MlpWeights {
    /// `[2 * inter, hidden]`: gate rows, then up; a plain MLP's up matrix `[inter, hidden]`.
    pub gate_up: Matrix,
    /// `gate_up` is a gated MLP's.
    pub gated: bool,
    pub gate_up_bias: Option<CudaSlice<bf16>>,
    pub down: Matrix,
    pub down_bias: Option<CudaSlice<bf16>>,
}

impl MlpWeights {
    fn scratch_len(&self, tokens: usize) -> usize {
        self.gate_up.scratch_len(tokens).max(self.down.scratch_len(tokens))
    }

    pub(super) fn bytes(&self) -> usize {
        let biases =
            [&self.gate_up_bias, &self.down_bias].iter().filter_map(|b| b.as_ref()).map(|b| 2 * b.len()).sum::<usize>();
        self.gate_up.bytes() + self.down.bytes() + biases
    }
}

/// A softmax-attention layer's projections.
pub struct AttentionWeights {
    /// q rows, then k, then v (none for a KV-shared layer), then, for a gated output, each
    /// head's gate rows.
    pub qkv: Matrix,
    pub qkv_bias: Option<CudaSlice<bf16>>,
    /// Per head (`head_dim` values) or over the whole projection (`plan`'s `qk_norm_whole`).
    pub q_norm: Option<CudaSlice<f32>>,
    pub k_norm: Option<CudaSlice<f32>>,
    pub o: Matrix,
    pub o_bias: Option<CudaSlice<bf16>>,
}

impl AttentionWeights {
    fn bytes(&self) -> usize {
        let qk = [&self.q_norm, &self.k_norm].iter().filter_map(|n| n.as_ref()).map(|n| 4 * n.len()).sum::<usize>();
        let biases =
            [&self.qkv_bias, &self.o_bias].iter().filter_map(|b| b.as_ref()).map(|b| 2 * b.len()).sum::<usize>();
        self.qkv.bytes() + self.o.bytes() + qk + biases
    }

    fn scratch_len(&self, tokens: usize) -> usize {
        self.qkv.scratch_len(tokens).max(self.o.scratch_len(tokens))
    }
}

/// A layer's token mixer.
pub enum Mixer {
    Attention(AttentionWeights),
    /// Gated DeltaNet linear attention.
    DeltaNet(DeltaWeights),
}

impl Mixer {
    fn bytes(&self) -> usize {
        match self {
            Mixer::Attention(a) => a.bytes(),
            Mixer::DeltaNet(d) => d.bytes(),
        }
    }

    fn scratch_len(&self, tokens: usize) -> usize {
        match self {
            Mixer::Attention(a) => a.scratch_len(tokens),
            Mixer::DeltaNet(d) => d.scratch_len(tokens),
        }
    }
}

pub struct LayerWeights {
    pub input_norm: Option<DeviceNorm>,
    pub mixer: Mixer,
    pub post_attn_norm: Option<DeviceNorm>,
    pub pre_ffn_norm: Option<DeviceNorm>,
    /// The dense MLP (none where experts replace it).
    pub mlp: Option<MlpWeights>,
    pub post_ffn_norm: Option<DeviceNorm>,
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

pub struct DecoderWeights {
    pub embed: Arc<Matrix>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: DeviceNorm,
    /// The embedding itself when the model ties them.
    pub lm_head: Arc<Matrix>,
    pub per_layer: Option<PerLayerWeights>,
    /// Bytes of device memory the weights take.
    pub bytes: usize,
}

/// One piece of a stacked matrix: a tensor's rows `rows` of a `[total, cols]` tensor.
pub(super) struct Part<'a> {
    pub name: &'a str,
    pub total: usize,
    pub rows: std::ops::Range<usize>,
}

impl<'a> Part<'a> {
    pub fn whole(name: &'a str, rows: usize) -> Part<'a> {
        Part { name, total: rows, rows: 0..rows }
    }
}

/// Whether a matrix of `parts` is a layer's projection (FP8 applies), not the embedding or
/// the LM head.
fn layer_projection(parts: &[Part]) -> bool {
    parts.iter().all(|p| p.name.starts_with("model.layers."))
}

/// The FP8 parts of a matrix stacked into one `Fp8Weight` (their scale runs brought to the
/// finest), or `None` when their runs do not nest.
pub(super) fn stack_fp8(parts: Vec<Fp8Weight>) -> Option<Fp8Weight> {
    let block = parts.iter().map(|p| p.col_block).min()?;
    let nests = |p: &Fp8Weight| p.col_block == p.cols || p.col_block.is_multiple_of(block);
    if !parts.iter().all(nests) {
        return None;
    }
    let mut parts: Vec<Fp8Weight> = parts.into_iter().map(|p| p.with_col_block(block)).collect();
    if parts.len() == 1 {
        return parts.pop();
    }
    let first = parts.first()?;
    Some(Fp8Weight {
        rows: parts.iter().map(|p| p.rows).sum(),
        cols: first.cols,
        codes: parts.iter().flat_map(|p| p.codes.iter().copied()).collect(),
        col_block: block,
        scales: parts.iter().flat_map(|p| p.scales.iter().copied()).collect(),
    })
}

/// Weight formats an upload converts to: `--quantization fp8` quantizes each bf16 layer
/// projection per output channel on the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum UploadQuantization {
    #[default]
    None,
    Fp8,
}

/// Where the values come from: a checkpoint's tensors by HF name, or a seeded generator.
pub(super) trait Source {
    /// `parts` of `cols` columns stacked into one matrix (quantized where the source allows).
    fn matrix(&mut self, parts: &[Part], cols: usize) -> Result<Matrix>;
    /// The tensor `name` of `shape` as bf16 values.
    fn bf16(&mut self, name: &str, shape: &[usize]) -> Result<CudaSlice<bf16>>;
    /// An f32 vector of `len` values plus `offset` (norm weights, scales).
    fn vector(&mut self, name: &str, len: usize, offset: f32) -> Result<Vec<f32>>;
    /// The f32 values of the tensor `name`, stored in the first of `shapes` it has.
    fn values(&mut self, name: &str, shapes: &[&[usize]]) -> Result<Vec<f32>>;
    fn contains(&self, name: &str) -> bool;
    /// A layer's experts (`names`, of `shape`, `hidden` wide): the gate-up matrix (`[experts,
    /// 2 × inter, hidden]`, each expert's gate rows then its up rows) and the down matrix
    /// (`[experts, hidden, inter]`), each one allocation.
    fn experts(&mut self, names: &ExpertNames, shape: MoeShape, hidden: usize) -> Result<[ExpertMatrix; 2]>;
}

struct FileSource<'a> {
    w: &'a Weights,
    gpu: &'a Gpu,
    quantize: UploadQuantization,
}

impl FileSource<'_> {
    /// The matrix of `parts` as FP8, when the checkpoint stores every part so; an error when
    /// it does and the device has no FP8.
    fn fp8_matrix(&self, parts: &[Part], cols: usize) -> Result<Option<Matrix>> {
        let mut fp8 = Vec::with_capacity(parts.len());
        for p in parts {
            match self.w.fp8(&format!("{}.weight", p.name), p.total, cols)? {
                Some(w) if p.rows == (0..p.total) => fp8.push(w),
                Some(w) => fp8.push(w.slice_rows(p.rows.clone())),
                None => return Ok(None),
            }
        }
        if !Fp8Matrix::supported_on(self.gpu) {
            let (major, minor) = self.gpu.info().compute_capability;
            return Err(LoadError::Other(format!(
                "{}: FP8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper); this one is \
                 {major}.{minor} (run it on the CPU, which dequantizes them)",
                parts[0].name
            )));
        }
        let Some(w) = stack_fp8(fp8).filter(|w| w.cols.is_multiple_of(16) && w.col_block.is_multiple_of(16)) else {
            return Ok(None);
        };
        Ok(Some(Matrix::Fp8(Fp8Matrix::upload(self.gpu, (w.rows, w.cols), &w.codes, &w.scales, w.col_block)?)))
    }
}

impl Source for FileSource<'_> {
    fn matrix(&mut self, parts: &[Part], cols: usize) -> Result<Matrix> {
        if let Some(m) = self.fp8_matrix(parts, cols)? {
            return Ok(m);
        }
        let m = self.stored_matrix(parts, cols)?;
        match (self.quantize, m) {
            (UploadQuantization::Fp8, Matrix::Bf16(w)) if layer_projection(parts) && cols.is_multiple_of(16) => {
                let rows = w.len() / cols;
                Ok(Matrix::Fp8(Fp8Matrix::quantize(self.gpu, &w, rows, cols)?))
            }
            (_, m) => Ok(m),
        }
    }

    fn bf16(&mut self, name: &str, shape: &[usize]) -> Result<CudaSlice<bf16>> {
        let values = self.w.get(name, shape)?.to_f32_vec()?;
        Ok(self.gpu.upload(&values.into_iter().map(bf16::from_f32).collect::<Vec<_>>())?)
    }

    fn vector(&mut self, name: &str, len: usize, offset: f32) -> Result<Vec<f32>> {
        self.w.norm(name, len, offset)
    }

    fn values(&mut self, name: &str, shapes: &[&[usize]]) -> Result<Vec<f32>> {
        let mut last = None;
        for shape in shapes {
            match self.w.get_f32(name, shape) {
                Ok(v) => return Ok(v),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| LoadError::Other(format!("{name}: no shape to read it as"))))
    }

    fn contains(&self, name: &str) -> bool {
        self.w.contains(name)
    }

    /// The experts as stored (`stack_experts`); under `--quantization fp8`, bf16 ones quantized
    /// to FP8 rows, a scale a row.
    fn experts(&mut self, names: &ExpertNames, shape: MoeShape, hidden: usize) -> Result<[ExpertMatrix; 2]> {
        let [gate_up, down] = stack_experts(self.w, self.gpu, names, shape, hidden)?;
        let quantize = |m: ExpertMatrix| -> Result<ExpertMatrix> {
            match self.quantize {
                UploadQuantization::Fp8 if m.dtype() == DType::BF16 && m.cols().is_multiple_of(16) => {
                    Ok(ExpertMatrix::quantize_fp8(self.gpu, &m)?)
                }
                _ => Ok(m),
            }
        };
        Ok([quantize(gate_up)?, quantize(down)?])
    }
}

impl FileSource<'_> {
    /// The matrix of `parts` as the file stores it: blocks the kernels read, or bf16.
    fn stored_matrix(&self, parts: &[Part], cols: usize) -> Result<Matrix> {
        // (dtype, rows, raw bytes) of each part, neighbours of one block type merged so that a
        // fused gate-up of one type takes the fused kernel.
        let mut pieces: Vec<(DType, usize, Vec<u8>)> = Vec::with_capacity(parts.len());
        for p in parts {
            let t = self.w.get(&format!("{}.weight", p.name), &[p.total, cols])?;
            let bytes = t.row_range_bytes(p.rows.clone()).to_vec();
            match pieces.last_mut() {
                Some(last) if last.0 == t.dtype() => {
                    last.1 += p.rows.len();
                    last.2.extend_from_slice(&bytes);
                }
                _ => pieces.push((t.dtype(), p.rows.len(), bytes)),
            }
        }
        if pieces.iter().all(|(dtype, _, _)| QuantMatrix::supports(*dtype)) {
            let parts: Vec<(DType, usize, &[u8])> = pieces.iter().map(|(d, r, b)| (*d, *r, b.as_slice())).collect();
            return Ok(Matrix::Quant(QuantMatrix::upload(self.gpu, cols, &parts)?));
        }
        let mut all = Vec::new();
        for (dtype, rows, bytes) in &pieces {
            let mut values = vec![0f32; rows * cols];
            for (row, out) in bytes.chunks_exact(dtype.row_bytes(cols)?).zip(values.chunks_exact_mut(cols)) {
                ferrite_runtime::quant::dequantize_row(*dtype, row, out)?;
            }
            all.extend(values.into_iter().map(bf16::from_f32));
        }
        Ok(Matrix::Bf16(self.gpu.upload(&all)?))
    }
}

/// Matrices uniform with the variance of a 1/fan-in init, made on the device in bf16 or a
/// block type the kernels read; unit norms and scales.
struct RandomSource<'a> {
    gpu: &'a Gpu,
    stream: Cell<u64>,
    dtype: DType,
    /// The fan-in the embedding table is drawn for: unit-ish rows (3) unless the model scales
    /// its embeddings up (Gemma), then that of a projection.
    embed_fan_in: usize,
}

impl RandomSource<'_> {
    fn seed(&self) -> u64 {
        self.stream.set(self.stream.get().wrapping_add(0x9E37_79B9_7F4A_7C15));
        self.stream.get()
    }

    /// The block type of a matrix of `cols` columns: the source's, except that a k-quant
    /// whose 256-value blocks do not tile a row falls back as llama.cpp's quantizer does
    /// (Q4_K to Q5_0; Q5_K and Q6_K to Q8_0, the nearest type the kernels read for its Q5_1
    /// and Q8_0); an FP8 model's experts are FP8 rows (bf16 where a row is not a multiple of
    /// 16 values).
    fn dtype_for(&self, cols: usize) -> DType {
        match self.dtype {
            DType::F8E4M3 if cols.is_multiple_of(16) => DType::F8E4M3,
            DType::F8E4M3 => DType::BF16,
            d if cols.is_multiple_of(d.block_elems()) => d,
            DType::Q4K => DType::Q5_0,
            _ => DType::Q8_0,
        }
    }

    fn random_bf16(&self, len: usize, fan_in: usize) -> Result<CudaSlice<bf16>> {
        let mut buf = self.gpu.alloc::<bf16>(len)?;
        ops::random_uniform(self.gpu, &mut buf, self.seed(), (3.0 / fan_in as f32).sqrt())?;
        Ok(buf)
    }
}

impl Source for RandomSource<'_> {
    fn matrix(&mut self, parts: &[Part], cols: usize) -> Result<Matrix> {
        let rows: usize = parts.iter().map(|p| p.rows.len()).sum();
        // An embedding table (one part named so) gets unit-ish rows; projections 1/fan-in.
        let fan_in =
            if parts.first().is_some_and(|p| p.name == "model.embed_tokens") { self.embed_fan_in } else { cols };
        let amp = (3.0 / fan_in as f32).sqrt();
        match self.dtype {
            DType::F8E4M3 if layer_projection(parts) => {
                return Ok(Matrix::Fp8(Fp8Matrix::random(self.gpu, rows, cols, self.seed(), amp)?))
            }
            DType::BF16 | DType::F8E4M3 => return Ok(Matrix::Bf16(self.random_bf16(rows * cols, fan_in)?)),
            _ => {}
        }
        Ok(Matrix::Quant(QuantMatrix::random(self.gpu, self.dtype_for(cols), rows, cols, self.seed(), amp)?))
    }

    fn bf16(&mut self, _name: &str, shape: &[usize]) -> Result<CudaSlice<bf16>> {
        self.random_bf16(shape.iter().product(), shape.last().copied().unwrap_or(1))
    }

    fn vector(&mut self, _name: &str, len: usize, _offset: f32) -> Result<Vec<f32>> {
        Ok(vec![1.0; len])
    }

    /// Values of a 1/fan-in scale (the last dimension of the first shape), all alike: a
    /// DeltaNet layer's conv taps, decay and time-step bias.
    fn values(&mut self, _name: &str, shapes: &[&[usize]]) -> Result<Vec<f32>> {
        let shape = shapes.first().copied().unwrap_or(&[]);
        let fan_in = shape.last().copied().unwrap_or(1).max(1);
        Ok(vec![1.0 / fan_in as f32; shape.iter().product()])
    }

    fn contains(&self, _name: &str) -> bool {
        false
    }

    fn experts(&mut self, _names: &ExpertNames, shape: MoeShape, hidden: usize) -> Result<[ExpertMatrix; 2]> {
        let (e, inter) = (shape.num_experts, shape.intermediate);
        let random = |rows: usize, cols: usize| -> Result<ExpertMatrix> {
            let amp = (3.0 / cols as f32).sqrt();
            Ok(ExpertMatrix::random(self.gpu, self.dtype_for(cols), (e, rows, cols), self.seed(), amp)?)
        };
        Ok([random(2 * inter, hidden)?, random(hidden, inter)?])
    }
}

impl DecoderWeights {
    /// Upload `w` (HF names, any dtype) for `plan`, converting as `quantize` says; `progress` is
    /// told after each layer.
    pub fn upload(
        cfg: &ModelConfig,
        plan: &DecoderPlan,
        w: &Weights,
        gpu: &Gpu,
        quantize: UploadQuantization,
        progress: &dyn Fn(usize),
    ) -> Result<DecoderWeights> {
        build(cfg, plan, &mut FileSource { w, gpu, quantize }, gpu, progress)
    }

    /// Random weights for `plan` made on `gpu` from `seed`, matrices in `dtype` (bf16 or a
    /// block type the kernels read).
    pub fn random(cfg: &ModelConfig, plan: &DecoderPlan, gpu: &Gpu, seed: u64, dtype: DType) -> Result<DecoderWeights> {
        if dtype != DType::BF16 && dtype != DType::F8E4M3 && !QuantMatrix::supports(dtype) {
            return Err(LoadError::Other(format!(
                "synthetic weights in {dtype}: the CUDA path takes bf16, fp8, q4_0, q4_1, q5_0, q8_0, q4_k, q5_k, \
                 q6_k or an MLX format (mlx4, mlx8, MLX4_G32_BF16, ...)"
            )));
        }
        let embed_fan_in = if plan.embed_scale.is_some() { cfg.hidden_size } else { 3 };
        let mut src = RandomSource { gpu, stream: Cell::new(seed), dtype, embed_fan_in };
        let w = build(cfg, plan, &mut src, gpu, &|_| {})?;
        gpu.synchronize()?;
        Ok(w)
    }

    /// bf16 values of scratch the GEMMs of steps of up to `tokens` tokens over the layers'
    /// quantized matrices use (the most any matrix needs; 0 when all are bf16). The LM head is
    /// not counted: its many-row products run the skinny GEMM 8 rows at a time rather than
    /// hold a vocab-sized scratch.
    pub fn scratch_len(&self, tokens: usize) -> usize {
        let layer = |l: &LayerWeights| {
            let mlps = l.mlp.iter().chain(l.moe.as_ref().and_then(|m| m.shared.as_ref()).map(|s| &s.mlp));
            let mlp = mlps.map(|m| m.scratch_len(tokens)).max().unwrap_or(0);
            l.mixer.scratch_len(tokens).max(mlp)
        };
        self.layers.iter().map(layer).max().unwrap_or(0)
    }
}

/// A tensor's rows by HF name: (name, rows of the tensor, the rows taken).
pub(super) type Piece<'a> = (&'a str, usize, std::ops::Range<usize>);

fn build(
    cfg: &ModelConfig,
    plan: &DecoderPlan,
    src: &mut dyn Source,
    gpu: &Gpu,
    progress: &dyn Fn(usize),
) -> Result<DecoderWeights> {
    let (d, n) = (cfg.hidden_size, plan.layers.len());
    let offset = plan.norm_offset();
    let norm = |src: &mut dyn Source, name: &str, dim: usize| -> Result<CudaSlice<f32>> {
        Ok(gpu.upload(&src.vector(name, dim, offset)?)?)
    };
    // A norm of the model's kind: `{prefix}.weight` (and `{prefix}.bias` for LayerNorm).
    let model_norm = |src: &mut dyn Source, prefix: &str| -> Result<DeviceNorm> {
        let weight = norm(src, &format!("{prefix}.weight"), d)?;
        let bias = match plan.norm {
            NormKind::Rms { .. } => None,
            NormKind::Layer => Some(norm(src, &format!("{prefix}.bias"), d)?),
        };
        Ok(DeviceNorm { weight, bias })
    };
    let norm_of = |src: &mut dyn Source, name: &Option<String>| -> Result<Option<DeviceNorm>> {
        name.as_ref().map(|name| model_norm(src, name)).transpose()
    };
    let embed = Arc::new(src.matrix(&[Part::whole("model.embed_tokens", cfg.vocab_size)], d)?);
    let mut bf16_bytes = 0usize;
    let mut layers = Vec::with_capacity(n);
    for (i, l) in plan.layers.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let names = &l.names;
        let mixer = match &l.attn.linear {
            Some(c) => Mixer::DeltaNet(DeltaWeights::load(src, gpu, c, d)?),
            None => Mixer::Attention(attention_weights(src, gpu, l, d)?),
        };
        let mlp = if l.ffn.dense() {
            Some(mlp_weights(src, gpu, &names.mlp, l.ffn.intermediate, l.ffn.bias, d)?)
        } else {
            None
        };
        let input = match plan.per_layer_input {
            Some((_, width)) => {
                bf16_bytes += 2 * width * d;
                Some(LayerInputWeights {
                    gate: src.bf16(&p("per_layer_input_gate.weight"), &[width, d])?,
                    projection: src.bf16(&p("per_layer_projection.weight"), &[d, width])?,
                    norm: norm(src, &p("post_per_layer_input_norm.weight"), d)?,
                })
            }
            None => None,
        };
        let moe = l.ffn.moe.as_ref().map(|m| moe_weights(src, gpu, m, i, d)).transpose()?;
        let scalar = if plan.layer_scalar { src.vector(&p("layer_scalar"), 1, 0.0)?[0] } else { 1.0 };
        layers.push(LayerWeights {
            input_norm: norm_of(src, &names.input_norm)?,
            mixer,
            post_attn_norm: norm_of(src, &names.post_attn_norm)?,
            pre_ffn_norm: norm_of(src, &names.pre_ffn_norm)?,
            mlp,
            post_ffn_norm: norm_of(src, &names.post_ffn_norm)?,
            input,
            moe,
            scalar,
        });
        progress(i + 1);
    }
    let per_layer = match plan.per_layer_input {
        Some((vocab, width)) => {
            bf16_bytes += (vocab + d) * n * width;
            Some(PerLayerWeights {
                table: src.bf16("model.embed_tokens_per_layer.weight", &[vocab, n * width])?,
                projection: src.bf16("model.per_layer_model_projection.weight", &[n * width, d])?,
                norm: gpu.upload(&src.vector("model.per_layer_projection_norm.weight", width, 0.0)?)?,
            })
        }
        None => None,
    };
    let lm_head = if cfg.tie_word_embeddings && !src.contains("lm_head.weight") {
        embed.clone()
    } else {
        Arc::new(src.matrix(&[Part::whole("lm_head", cfg.vocab_size)], d)?)
    };
    let final_norm = model_norm(src, "model.norm")?;
    let matrices: usize = layers
        .iter()
        .map(|l| {
            let ffn = l.mlp.as_ref().map_or(0, MlpWeights::bytes) + l.moe.as_ref().map_or(0, MoeWeights::bytes);
            l.mixer.bytes() + ffn
        })
        .sum();
    let head = if Arc::ptr_eq(&embed, &lm_head) { 0 } else { lm_head.bytes() };
    let small: usize = layers
        .iter()
        .map(|l| {
            let norms = [&l.input_norm, &l.post_attn_norm, &l.pre_ffn_norm, &l.post_ffn_norm];
            norms.iter().filter_map(|n| n.as_ref()).map(DeviceNorm::bytes).sum::<usize>()
        })
        .sum::<usize>()
        + final_norm.bytes();
    let bytes = matrices + embed.bytes() + head + 2 * bf16_bytes + small;
    Ok(DecoderWeights { embed, layers, final_norm, lm_head, per_layer, bytes })
}

/// A softmax-attention layer's projections: q rows, then (unless KV-shared) k and v, then for
/// a gated output each head's gate rows (stored after its q rows, `[q, gate]` per head), fused
/// into one matrix with their biases; the q/k norms and the output projection.
fn attention_weights(src: &mut dyn Source, gpu: &Gpu, l: &LayerPlan, d: usize) -> Result<AttentionWeights> {
    let (a, names) = (&l.attn, &l.names);
    let (nh, nkv, hd) = (a.params.n_heads, a.params.n_kv_heads, a.params.head_dim);
    let (q_rows, kv_rows) = (nh * hd, nkv * hd);
    // A gated layer's q tensor holds each head's q rows, then its gate rows.
    let q_total = if a.output_gate { 2 * q_rows } else { q_rows };
    // q's tensor, its rows and where they start in it; then k's and v's.
    let (q, [k, v]): (Piece, [Piece; 2]) = match &names.qkv {
        QkvNames::Separate { q, k, v } => {
            let v = if a.k_eq_v { k } else { v };
            ((q, q_total, 0..q_total), [(k, kv_rows, 0..kv_rows), (v, kv_rows, 0..kv_rows)])
        }
        QkvNames::Fused(qkv) => {
            let total = q_total + 2 * kv_rows;
            let end = q_total + kv_rows;
            ((qkv, total, 0..q_total), [(qkv, total, q_total..end), (qkv, total, end..total)])
        }
    };
    let (q_name, total, q_start) = (q.0, q.1, q.2.start);
    let head_rows = |part: usize| -> Vec<Piece> {
        (0..nh).map(|h| (q_name, total, q_start + (2 * h + part) * hd..q_start + (2 * h + part + 1) * hd)).collect()
    };
    let mut pieces: Vec<Piece> = if a.output_gate { head_rows(0) } else { vec![q] };
    if !a.shared {
        pieces.extend([k, v]);
    }
    if a.output_gate {
        pieces.extend(head_rows(1));
    }
    let parts: Vec<Part> =
        pieces.iter().map(|(name, total, rows)| Part { name, total: *total, rows: rows.clone() }).collect();
    let qkv = src.matrix(&parts, d)?;
    let qkv_bias = if a.bias { Some(biases(src, gpu, &pieces)?) } else { None };
    let (q_norm, k_norm) = match a.qk_norm {
        Some(off) => {
            // Over a head, or over the heads of a whole projection.
            let qk_norm = |src: &mut dyn Source, name: &str, heads: usize| -> Result<CudaSlice<f32>> {
                let len = if a.qk_norm_whole { heads * hd } else { hd };
                Ok(gpu.upload(&src.vector(&format!("{name}.weight"), len, off)?)?)
            };
            let q = qk_norm(src, &names.q_norm, nh)?;
            (Some(q), if a.shared { None } else { Some(qk_norm(src, &names.k_norm, nkv)?) })
        }
        None => (None, None),
    };
    let o = src.matrix(&[Part::whole(&names.o, d)], q_rows)?;
    let o_bias = if a.o_bias { Some(biases(src, gpu, &[(names.o.as_str(), d, 0..d)])?) } else { None };
    Ok(AttentionWeights { qkv, qkv_bias, q_norm, k_norm, o, o_bias })
}

/// The biases of `pieces` (`{name}.bias`, its rows of each), in bf16 as the GEMMs add them.
fn biases(src: &mut dyn Source, gpu: &Gpu, pieces: &[Piece]) -> Result<CudaSlice<bf16>> {
    let mut b = Vec::new();
    for (name, total, rows) in pieces {
        b.extend_from_slice(&src.vector(&format!("{name}.bias"), *total, 0.0)?[rows.clone()]);
    }
    Ok(gpu.upload(&b.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>())?)
}

/// A dense MLP `inter` wide over `d`: the gate-up (or up) rows fused, the down projection, and
/// their biases when `bias`.
fn mlp_weights(
    src: &mut dyn Source,
    gpu: &Gpu,
    names: &MlpNames,
    inter: usize,
    bias: bool,
    d: usize,
) -> Result<MlpWeights> {
    // The gate-up (or up) rows by name, as the bias reads them too.
    let (up_pieces, down): (Vec<Piece>, &String) = match names {
        MlpNames::Gated { gate, up, down } => (vec![(gate, inter, 0..inter), (up, inter, 0..inter)], down),
        MlpNames::FusedGated { gate_up, down } => (vec![(gate_up, 2 * inter, 0..2 * inter)], down),
        MlpNames::Plain { up, down } => (vec![(up, inter, 0..inter)], down),
    };
    let up_parts: Vec<Part> = up_pieces.iter().map(|(name, rows, _)| Part::whole(name, *rows)).collect();
    let gate_up = src.matrix(&up_parts, d)?;
    let (gate_up_bias, down_bias) = if bias {
        (Some(biases(src, gpu, &up_pieces)?), Some(biases(src, gpu, &[(down.as_str(), d, 0..d)])?))
    } else {
        (None, None)
    };
    let down = src.matrix(&[Part::whole(down, d)], inter)?;
    Ok(MlpWeights { gate_up, gated: !matches!(names, MlpNames::Plain { .. }), gate_up_bias, down, down_bias })
}

/// Layer `layer`'s experts as `plan` names them: the router (bf16), the stacked expert
/// matrices, and Gemma 4's router scale (times `d^-1/2`), per-expert scales and norms.
fn moe_weights(src: &mut dyn Source, gpu: &Gpu, plan: &MoePlan, layer: usize, d: usize) -> Result<MoeWeights> {
    let e = plan.shape.num_experts;
    let router = Matrix::Bf16(src.bf16(&format!("{}.weight", plan.names.router), &[e, d])?);
    let [gate_up, down] = src.experts(&plan.names, plan.shape, d)?;
    let gemma4 = match plan.style {
        MoeStyle::Sparse => None,
        MoeStyle::Gemma4 => {
            let p = |s: &str| format!("model.layers.{layer}.{s}");
            let root = (d as f64).powf(-0.5) as f32;
            let scale: Vec<f32> = src.vector(&p("router.scale"), d, 0.0)?.iter().map(|s| s * root).collect();
            let mut upload = |name: &str, len: usize| -> Result<CudaSlice<f32>> {
                Ok(gpu.upload(&src.vector(&p(name), len, 0.0)?)?)
            };
            Some(Gemma4Moe {
                router_norm: gpu.upload(&scale)?,
                per_expert_scale: upload("router.per_expert_scale", e)?,
                post_mlp_norm: upload("post_feedforward_layernorm_1.weight", d)?,
                pre_norm: upload("pre_feedforward_layernorm_2.weight", d)?,
                post_norm: upload("post_feedforward_layernorm_2.weight", d)?,
            })
        }
    };
    let shared = match &plan.shared {
        Some(sh) => Some(SharedWeights {
            mlp: mlp_weights(src, gpu, &sh.mlp, sh.intermediate, false, d)?,
            gate: match &sh.gate {
                // A GGUF file may store the `[1, hidden]` gate as a vector.
                Some(g) => {
                    let name = format!("{g}.weight");
                    let v = src.values(&name, &[&[1, d], &[d]])?;
                    Some(Matrix::Bf16(gpu.upload(&v.into_iter().map(bf16::from_f32).collect::<Vec<_>>())?))
                }
                None => None,
            },
        }),
        None => None,
    };
    Ok(MoeWeights { router, gate_up, down, gemma4, shared })
}
