//! `GpuDecoder`: the CUDA executor of a `DecoderPlan`, for every family, behind the same
//! `CausalLm` interface as the CPU executor; the step machinery, graphs and LM head are
//! `runner`'s.
//!
//! A layer is: the input norm (RMSNorm or LayerNorm, fused with the residual add of the
//! sublayer before it, scaled by the residual multiplier), or with no input norm (post-norm)
//! that add alone → fused QKV GEMM (+bias) → q/k norms per head or over each whole projection
//! (and Gemma 4's unscaled v norm) → RoPE of the layer's schedule with the KV write (none for a
//! KV-shared layer, which reads its donor's cache layer; a schedule that depends on the row's
//! length, dynamic NTK or long RoPE, rotates by the per-row tables `upload_step` wrote) →
//! paged attention (the layer's window, scale and softcap) → output GEMM (+bias) → the output
//! norm added to the residual, or the add left to the next norm → the pre-FFN norm (or the
//! add alone) → fused gate-up GEMM with the gated activation, or the up GEMM and a plain
//! activation (+biases) → down GEMM (+bias), or routed experts in its place (qwen3_moe,
//! mixtral) or beside it (Gemma 4; `moe`: routed on the device, so MoE decode steps replay
//! graphs too) → the FFN output norm, then Gemma 4's per-layer input and layer scalar. In a
//! decode step of a layer with a fixed RoPE table, the attention kernel itself rotates q and
//! the new key and stores K and V (one launch instead of two). Matrices are bf16 or GGUF blocks
//! (`Matrix`, `ExpertMatrix`); activations are bf16, every kernel computes in f32, GEMMs
//! accumulate in f32. What a plan does not ask for (biases, scales, LayerNorm, per-row RoPE
//! tables) launches nothing. In a step with LoRA rows, each adapted projection's GEMM is
//! followed by the adapters' shrink and expand (`lora`), and the gated activation runs after
//! the gate-up GEMM instead of in it.

use std::sync::Arc;

use ferrite_runtime::cpu::AttentionParams;
use ferrite_runtime::cuda::ops::{
    self, GatedActivation, Matrix, PerLayerShape, QkNorms, QkvHeads, RopeShape, DELTA_MAX_CONV_KERNEL, DELTA_MAX_K_DIM,
};
use ferrite_runtime::cuda::{CudaSlice, DevicePtr, DevicePtrMut, Gpu};
use ferrite_runtime::{ForwardBatch, KvCache, KvLayout, Padding, Result as RtResult, RuntimeError};
use half::bf16;

use super::decoder_weights::{AttentionWeights, DecoderWeights, DeviceNorm, LayerWeights, Mixer, MlpWeights};
use super::deltanet::{self, DeltaBuffers};
use super::lora::{GpuLoras, LoraBuffers, LoraGroup, LoraShapes, StepLora};
use super::moe::{self, MoeBuffers, MoeStep};
use super::rope::{Ropes, StepRope};
use super::runner::{step_inputs, Decode, GpuModel, LayerBuffers, Layers, StepIo};
use crate::blocks::AttentionConfig;
use crate::config::{Activation, ModelConfig};
use crate::error::{LoadError, Result};
use crate::lora::{LoraAdapter, LoraTarget};
use crate::plan::{DecoderPlan, InputKind};

/// Any family on the device.
pub type GpuDecoder = GpuModel<DecoderLayers>;

/// Head widths the CUDA attention kernels are built for.
const HEAD_DIMS: [usize; 6] = [16, 32, 64, 128, 256, 512];

pub struct DecoderLayers {
    cfg: ModelConfig,
    plan: DecoderPlan,
    /// Each layer's attention shape (in layer order).
    params: Vec<AttentionParams>,
    ropes: Ropes,
    act: GatedActivation,
    w: DecoderWeights,
    loras: GpuLoras,
}

/// Why `plan` cannot run on the CUDA executor, if it cannot.
pub fn unsupported(plan: &DecoderPlan) -> Option<String> {
    if !plan.causal() {
        return Some("bidirectional attention has no CUDA kernel yet".into());
    }
    if plan.input != InputKind::Tokens || plan.final_norm.as_deref() != Some("model.norm") {
        return Some("an encoder's input embeddings and post-LN layers have no CUDA path yet".into());
    }
    for (i, l) in plan.layers.iter().enumerate() {
        if let Some(c) = &l.attn.linear {
            if c.shape.k_dim > DELTA_MAX_K_DIM || c.conv_kernel > DELTA_MAX_CONV_KERNEL {
                return Some(format!(
                    "layer {i}: gated DeltaNet with key heads of {} and a conv of {} taps (the CUDA kernels take up \
                     to {DELTA_MAX_K_DIM} and {DELTA_MAX_CONV_KERNEL})",
                    c.shape.k_dim, c.conv_kernel
                ));
            }
        } else if !HEAD_DIMS.contains(&l.attn.params.head_dim) {
            let hd = l.attn.params.head_dim;
            return Some(format!("layer {i}: head_dim {hd} has no CUDA attention kernel ({HEAD_DIMS:?})"));
        }
        if l.ffn.act == Activation::Gelu {
            return Some(format!("layer {i}: the exact (erf) GELU has no CUDA kernel yet"));
        }
        if l.names.attn_residual_norm.is_some() || l.names.ffn_residual_norm.is_some() {
            return Some(format!("layer {i}: post-LN norms of the residual stream have no CUDA path yet"));
        }
        if plan.layer_scalar && l.names.post_ffn_norm.is_none() && plan.per_layer_input.is_none() {
            // The scalar is applied by the norm that adds the FFN (or per-layer input) output.
            return Some(format!("layer {i}: a layer scalar without a post-FFN norm has no CUDA path"));
        }
    }
    moe::unsupported(plan)
}

/// The activation buffers of a step.
pub struct Buffers {
    layer: LayerBuffers,
    /// `o` still has to be added to the residual (by the next norm, fused).
    pending: bool,
    per_layer: Option<PerLayerBuffers>,
    moe: Option<MoeBuffers>,
    /// The step's tables of each per-row RoPE schedule.
    ropes: Vec<StepRope>,
    /// The step's adapted tokens, grouped by adapter.
    lora: LoraBuffers,
    /// The DeltaNet layers' activations and the step's state slots.
    delta: Option<DeltaBuffers>,
}

struct PerLayerBuffers {
    /// `[tokens, layers * width]`, then the inputs `[layers][tokens][width]`.
    proj: CudaSlice<bf16>,
    inputs: CudaSlice<bf16>,
    gate: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
}

impl GpuDecoder {
    /// A model of `cfg` laid out by `plan`, with weights `w` already on `gpu`.
    pub fn new(cfg: ModelConfig, plan: DecoderPlan, w: DecoderWeights, gpu: Arc<Gpu>) -> Result<GpuDecoder> {
        if let Some(why) = unsupported(&plan) {
            return Err(LoadError::Other(why));
        }
        let ropes = Ropes::new(&gpu, &plan)?;
        let act = match cfg.hidden_act {
            Activation::Silu => GatedActivation::Silu,
            Activation::GeluTanh => GatedActivation::GeluTanh,
            Activation::Gelu => return Err(LoadError::Other("the exact (erf) GELU has no CUDA kernel yet".into())),
        };
        let params = plan.layers.iter().map(|l| l.attn.params).collect();
        let bytes = w.bytes;
        let loras = GpuLoras::new(&plan, cfg.hidden_size, |i| w.layers[i].mlp.as_ref().map(|m| m.gated));
        Ok(GpuModel::from_layers(DecoderLayers { cfg, plan, params, ropes, act, w, loras }, gpu, bytes))
    }
}

/// Width of a layer's fused QKV rows: q, k and v (none of a KV-shared layer's), then the gates
/// of a gated output.
fn qkv_width(p: &AttentionParams, a: &AttentionConfig) -> usize {
    let gates = if a.output_gate { p.n_heads } else { 0 };
    (p.n_heads + if a.shared { 0 } else { 2 * p.n_kv_heads } + gates) * p.head_dim
}

impl DecoderLayers {
    /// The multiplier of each sublayer output as it joins the residual (granite).
    fn residual_scale(&self) -> f32 {
        self.plan.residual_scale.unwrap_or(1.0)
    }

    /// `h = norm(x)`, first adding a pending sublayer output `o` to `x` (in the same launch).
    fn norm_into(&self, gpu: &Gpu, io: &mut StepIo, b: &mut Buffers, n: &DeviceNorm, tokens: usize) -> RtResult<()> {
        let (d, params) = (self.cfg.hidden_size, n.params(self.plan.eps));
        if std::mem::take(&mut b.pending) {
            let residual = Some((&mut io.x as &mut dyn DevicePtrMut<bf16>, self.residual_scale()));
            ops::norm(gpu, &b.layer.o, residual, params, (tokens, d), &mut io.h)?;
        } else {
            ops::norm(gpu, &io.x, None, params, (tokens, d), &mut io.h)?;
        }
        Ok(())
    }

    /// Add a pending sublayer output `o` to `x` (a sublayer that reads the residual stream
    /// itself, with no norm before it to fuse the add into).
    fn settle(&self, gpu: &Gpu, io: &mut StepIo, b: &mut Buffers, tokens: usize) -> RtResult<()> {
        if std::mem::take(&mut b.pending) {
            ops::residual_add(gpu, &b.layer.o, &mut io.x, tokens * self.cfg.hidden_size, self.residual_scale())?;
        }
        Ok(())
    }

    /// The sublayer output in `b.layer.o` joins the residual: normed, scaled by the residual
    /// multiplier and added (the sum scaled by `scale`) with an output norm, else left pending
    /// for the next norm.
    fn residual(
        &self,
        gpu: &Gpu,
        io: &mut StepIo,
        b: &mut Buffers,
        post_norm: Option<&DeviceNorm>,
        tokens: usize,
        scale: f32,
    ) -> RtResult<()> {
        let (d, eps, ys) = (self.cfg.hidden_size, self.plan.eps, self.residual_scale());
        match post_norm {
            Some(n) => ops::norm_add(gpu, &b.layer.o, n.params(eps), &mut io.x, (tokens, d), ys, scale)?,
            None => b.pending = true,
        }
        Ok(())
    }

    /// Layer `i`'s q/k norms (per head, or over each token's whole q and k projections) and
    /// Gemma 4's unscaled per-head v norm, in place in the fused QKV rows (`own` KV heads).
    fn queue_qkv_norms(
        &self,
        gpu: &Gpu,
        qkv: &mut CudaSlice<bf16>,
        l: &AttentionWeights,
        i: usize,
        tokens: usize,
        own: usize,
    ) -> RtResult<()> {
        let (a, p, eps) = (&self.plan.layers[i].attn, &self.params[i], self.plan.eps);
        let (stride, hd) = (qkv_width(p, a), p.head_dim);
        let heads = |n_q, n_k, n_v, head_dim| QkvHeads { tokens, stride, head_dim, n_q, n_k, n_v };
        let wq = l.q_norm.as_ref().map(|w| w as &dyn DevicePtr<f32>);
        let wk = l.k_norm.as_ref().map(|w| w as &dyn DevicePtr<f32>);
        let n_v = if a.v_norm { own } else { 0 };
        if a.qk_norm.is_some() && !a.qk_norm_whole {
            // q, k and v heads in one launch.
            return Ok(ops::qkv_norm(gpu, qkv, heads(p.n_heads, own, n_v, hd), wq, wk, eps)?);
        }
        let q_w = p.n_heads * hd;
        if a.qk_norm.is_some() {
            // One "head" as wide as each projection.
            ops::qkv_norm(gpu, qkv, heads(1, 0, 0, q_w), wq, None, eps)?;
            if own > 0 {
                ops::qkv_norm(gpu, &mut qkv.slice_mut(q_w..), heads(1, 0, 0, own * hd), wk, None, eps)?;
            }
        }
        if n_v > 0 {
            ops::qkv_norm(gpu, &mut qkv.slice_mut(q_w + own * hd..), heads(0, 0, n_v, hd), None, None, eps)?;
        }
        Ok(())
    }

    /// Queue layer `i`'s attention (with the step's adapters): its output projection lands in
    /// `b.layer.o`. A gated output is multiplied by the sigmoid of its gates (the QKV rows' last
    /// `q` columns) before the projection.
    #[allow(clippy::too_many_arguments)]
    fn queue_attention(
        &self,
        gpu: &Gpu,
        io: &mut StepIo,
        b: &mut Buffers,
        lora: &mut Option<StepLora>,
        kv: &mut KvCache,
        tokens: usize,
        decode: Option<Decode>,
        i: usize,
        input_norm: bool,
        l: &AttentionWeights,
    ) -> RtResult<()> {
        let d = self.cfg.hidden_size;
        let a = &self.plan.layers[i].attn;
        let p = &self.params[i];
        let (nh, nkv, hd) = (p.n_heads, p.n_kv_heads, p.head_dim);
        let (q_w, qkv_w) = (nh * hd, qkv_width(p, a));
        let bias = l.qkv_bias.as_ref().map(|b| b as &dyn DevicePtr<bf16>);
        // A layer without an input norm (post-norm) reads the residual stream itself.
        let input = if input_norm { &io.h } else { &io.x };
        l.qkv.linear(gpu, input, bias, &mut b.layer.qkv, (tokens, qkv_w, d), io.dequant.as_mut())?;
        if let Some(lora) = lora {
            let last = if a.shared { LoraTarget::Q } else { LoraTarget::V };
            lora.add(gpu, i, LoraTarget::Q..=last, input, &mut b.layer.qkv, qkv_w)?;
        }
        let own = if a.shared { 0 } else { nkv };
        let plan = decode.map(|dec| dec.plan(gpu, p));
        // Decode of a layer with its own KV and a fixed RoPE: the attention kernel rotates q
        // and the new keys and stores K and V itself (with no rotary pairs it would take the
        // keys as already stored, so a NoPE layer stores them through `rope`), and applies
        // per-head q/k norms first when those are the layer's only ones.
        let folds = plan.is_some() && self.ropes.fixed(i).is_some() && !a.shared;
        let norms = match (&l.q_norm, &l.k_norm) {
            (Some(q), Some(k)) if folds && a.qk_norm.is_some() && !a.qk_norm_whole && !a.v_norm => {
                Some(QkNorms { q, k, eps: self.plan.eps })
            }
            _ => None,
        };
        if norms.is_none() {
            self.queue_qkv_norms(gpu, &mut b.layer.qkv, l, i, tokens, own)?;
        }
        let group = self.plan.layout.layers[a.kv_index].group;
        let layer_kv = kv.device_layer_mut(a.kv_index)?;
        match (plan, self.ropes.fixed(i)) {
            (Some(plan), Some(r)) if folds => {
                let (meta, scratch) = (&io.metas[group], &mut io.scratch);
                ops::decode_attention_rope(
                    gpu,
                    &mut b.layer.qkv,
                    qkv_w,
                    meta,
                    layer_kv,
                    p,
                    r,
                    norms,
                    plan,
                    scratch,
                    &mut b.layer.attn,
                    q_w,
                )?;
            }
            _ => {
                let shape = RopeShape { tokens, n_heads: nh + own, head_dim: hd, stride: qkv_w };
                let store = (!a.shared).then_some((&io.metas[group], &mut *layer_kv));
                let [_, positions, _] = step_inputs(&io.inputs, tokens, 0)?;
                self.ropes.queue(gpu, i, &b.ropes, &mut b.layer.qkv, &positions, shape, store)?;
                let (meta, scratch) = (&io.metas[group], &mut io.scratch);
                ops::attention(gpu, &b.layer.qkv, qkv_w, meta, layer_kv, p, plan, scratch, &mut b.layer.attn, q_w)?;
            }
        }
        if a.output_gate {
            let gates = b.layer.qkv.slice(qkv_w - q_w..);
            ops::sigmoid_gate_mul(gpu, &mut b.layer.attn, &gates, (tokens, q_w, qkv_w))?;
        }
        let o_bias = l.o_bias.as_ref().map(|b| b as &dyn DevicePtr<bf16>);
        l.o.linear(gpu, &b.layer.attn, o_bias, &mut b.layer.o, (tokens, d, q_w), io.dequant.as_mut())?;
        if let Some(lora) = lora {
            lora.add(gpu, i, LoraTarget::O..=LoraTarget::O, &b.layer.attn, &mut b.layer.o, d)?;
        }
        Ok(())
    }

    /// Queue layer `i`'s dense MLP `mlp` (`inter` wide, with the step's adapters) over `h`
    /// (or, with no pre-FFN norm, the residual stream): its output lands in `b.layer.o`. The
    /// gated activation fuses into the gate-up GEMM unless a bias or an adapter comes between
    /// them.
    #[allow(clippy::too_many_arguments)]
    fn queue_mlp(
        &self,
        gpu: &Gpu,
        io: &mut StepIo,
        b: &mut Buffers,
        lora: &mut Option<StepLora>,
        i: usize,
        l: &LayerWeights,
        mlp: &MlpWeights,
        inter: usize,
        tokens: usize,
    ) -> RtResult<()> {
        let d = self.cfg.hidden_size;
        let input = if l.pre_ffn_norm.is_some() { &io.h } else { &io.x };
        let l = mlp;
        let (act, dequant) = (&mut b.layer.act, io.dequant.as_mut());
        let bias = l.gate_up_bias.as_ref().map(|b| b as &dyn DevicePtr<bf16>);
        let adapted = lora.as_ref().is_some_and(|lora| lora.covers(LoraGroup::GateUp));
        if l.gated && (bias.is_some() || adapted) {
            l.gate_up.linear(gpu, input, bias, &mut b.layer.gate_up, (tokens, 2 * inter, d), dequant)?;
            if let Some(lora) = lora {
                lora.add(gpu, i, LoraTarget::Gate..=LoraTarget::Up, input, &mut b.layer.gate_up, 2 * inter)?;
            }
            let (gate, up) = (&b.layer.gate_up, b.layer.gate_up.slice(inter..));
            ops::gated_activation(gpu, self.act, gate, &up, (tokens, inter, 2 * inter), act)?;
        } else if l.gated {
            l.gate_up.linear_gated(gpu, self.act, input, &mut b.layer.gate_up, act, (tokens, inter, d), dequant)?;
        } else {
            l.gate_up.linear(gpu, input, bias, act, (tokens, inter, d), dequant)?;
            if let Some(lora) = lora {
                lora.add(gpu, i, LoraTarget::Up..=LoraTarget::Up, input, act, inter)?;
            }
            ops::activation(gpu, self.act, act, tokens * inter)?;
        }
        let bias = l.down_bias.as_ref().map(|b| b as &dyn DevicePtr<bf16>);
        l.down.linear(gpu, &b.layer.act, bias, &mut b.layer.o, (tokens, d, inter), io.dequant.as_mut())?;
        if let Some(lora) = lora {
            lora.add(gpu, i, LoraTarget::Down..=LoraTarget::Down, &b.layer.act, &mut b.layer.o, d)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn queue_layer(
        &self,
        gpu: &Gpu,
        io: &mut StepIo,
        b: &mut Buffers,
        lora: &mut Option<StepLora>,
        kv: &mut KvCache,
        tokens: usize,
        decode: Option<Decode>,
        i: usize,
        l: &LayerWeights,
    ) -> RtResult<()> {
        let (d, eps) = (self.cfg.hidden_size, self.plan.eps);
        let inter = self.plan.layers[i].ffn.intermediate;
        match &l.input_norm {
            Some(n) => self.norm_into(gpu, io, b, n, tokens)?,
            None => self.settle(gpu, io, b, tokens)?,
        }
        match &l.mixer {
            Mixer::Attention(w) => {
                self.queue_attention(gpu, io, b, lora, kv, tokens, decode, i, l.input_norm.is_some(), w)?
            }
            Mixer::DeltaNet(w) => {
                let (c, delta) = (self.plan.layers[i].attn.linear.as_ref(), b.delta.as_mut());
                let (Some(c), Some(delta)) = (c, delta) else {
                    return Err(RuntimeError::Shape(format!("layer {i}: DeltaNet weights without its plan")));
                };
                let input = if l.input_norm.is_some() { &io.h } else { &io.x };
                let shape = (tokens, d);
                deltanet::queue_deltanet(gpu, c, w, delta, kv, input, &mut b.layer.o, shape, &mut io.dequant)?;
            }
        }
        self.residual(gpu, io, b, l.post_attn_norm.as_ref(), tokens, 1.0)?;
        match &l.pre_ffn_norm {
            Some(n) => self.norm_into(gpu, io, b, n, tokens)?,
            None => self.settle(gpu, io, b, tokens)?,
        }
        if let Some(mlp) = &l.mlp {
            self.queue_mlp(gpu, io, b, lora, i, l, mlp, inter, tokens)?;
        }
        if let (Some(w), Some(m), Some(plan)) = (&l.moe, b.moe.as_mut(), &self.plan.layers[i].ffn.moe) {
            // Sparse experts read the pre-FFN normed rows; Gemma 4's router and experts the
            // residual stream.
            let input = if l.pre_ffn_norm.is_some() { &io.h } else { &io.x };
            let step = MoeStep { tokens, hidden: d, eps, act: self.act };
            moe::queue_moe(gpu, plan, w, m, input, &io.x, &mut b.layer.o, step, &mut io.dequant)?;
        }
        let after_ffn = if l.input.is_some() { 1.0 } else { l.scalar };
        self.residual(gpu, io, b, l.post_ffn_norm.as_ref(), tokens, after_ffn)?;
        if l.input.is_some() {
            self.settle(gpu, io, b, tokens)?;
        }
        if let (Some(li), Some(pl), Some((_, width))) = (&l.input, b.per_layer.as_mut(), self.plan.per_layer_input) {
            ops::linear(gpu, &io.x, &li.gate, None, &mut pl.gate, (tokens, width, d))?;
            let mine = pl.inputs.slice(i * tokens * width..(i + 1) * tokens * width);
            ops::gated_activation(gpu, self.act, &pl.gate, &mine, (tokens, width, width), &mut pl.act)?;
            ops::linear(gpu, &pl.act, &li.projection, None, &mut b.layer.o, (tokens, d, width))?;
            ops::rms_norm_add(gpu, &b.layer.o, &li.norm, &mut io.x, (tokens, d), eps, l.scalar)?;
        }
        Ok(())
    }
}

impl Layers for DecoderLayers {
    type Buffers = Buffers;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn layout(&self) -> &KvLayout {
        &self.plan.layout
    }

    fn attention(&self) -> &[AttentionParams] {
        &self.params
    }

    fn buffers(&self, gpu: &Gpu, tokens: usize) -> RtResult<Buffers> {
        let (d, n) = (self.cfg.hidden_size, self.plan.layers.len());
        let bf = |len: usize| gpu.alloc::<bf16>(len);
        let max = |f: &dyn Fn(usize) -> usize| (0..n).map(f).max().unwrap_or(0);
        // Softmax-attention layers' widths (DeltaNet layers have their own buffers).
        let softmax = |i: usize| self.plan.layers[i].attn.linear.is_none();
        let qkv = max(&|i| if softmax(i) { qkv_width(&self.params[i], &self.plan.layers[i].attn) } else { 0 });
        let attn = max(&|i| if softmax(i) { self.params[i].n_heads * self.params[i].head_dim } else { 0 });
        // The dense MLPs' width (layers whose experts replace it have none).
        let inter = max(&|i| if self.plan.layers[i].ffn.dense() { self.plan.layers[i].ffn.intermediate } else { 0 });
        let per_layer = match self.plan.per_layer_input {
            Some((_, width)) => Some(PerLayerBuffers {
                proj: bf(tokens * n * width)?,
                inputs: bf(tokens * n * width)?,
                gate: bf(tokens * width)?,
                act: bf(tokens * width)?,
            }),
            None => None,
        };
        let moe = MoeBuffers::new(gpu, &self.plan, d, tokens)?;
        let ropes = self.ropes.step_buffers(gpu, tokens)?;
        let layer = LayerBuffers::new(gpu, tokens, qkv.max(1), attn.max(1), d, inter.max(1))?;
        let delta = DeltaBuffers::new(gpu, &self.plan, tokens)?;
        Ok(Buffers { layer, pending: false, per_layer, moe, ropes, lora: LoraBuffers::new(tokens), delta })
    }

    fn queue_layers(
        &self,
        gpu: &Gpu,
        io: &mut StepIo,
        b: &mut Buffers,
        kv: &mut KvCache,
        tokens: usize,
        decode: Option<Decode>,
    ) -> RtResult<()> {
        let (d, v, n) = (self.cfg.hidden_size, self.cfg.vocab_size, self.plan.layers.len());
        b.pending = false;
        let [ids, _, _] = step_inputs(&io.inputs, tokens, 0)?;
        self.w.embed.embedding(gpu, (v, d), &ids, tokens, self.plan.embed_scale.unwrap_or(1.0), &mut io.x)?;
        if let (Some(pw), Some(pl), Some((vocab, width))) =
            (&self.w.per_layer, b.per_layer.as_mut(), self.plan.per_layer_input)
        {
            ops::linear(gpu, &io.x, &pw.projection, None, &mut pl.proj, (tokens, n * width, d))?;
            let shape = PerLayerShape {
                tokens,
                layers: n,
                width,
                vocab,
                proj_scale: (d as f64).powf(-0.5) as f32,
                emb_scale: (width as f64).sqrt() as f32,
                eps: self.plan.eps,
            };
            ops::per_layer_inputs(gpu, &pl.proj, &pw.table, &ids, &pw.norm, shape, &mut pl.inputs)?;
        }
        // The step's adapters (taken out of `b` while the layers borrow it).
        let mut lora_buffers = std::mem::take(&mut b.lora);
        let mut lora = lora_buffers.for_step(&self.loras, tokens);
        let queued = (self.w.layers.iter().enumerate())
            .try_for_each(|(i, l)| self.queue_layer(gpu, io, b, &mut lora, kv, tokens, decode, i, l));
        drop(lora);
        b.lora = lora_buffers;
        queued
    }

    fn final_norm(&self, gpu: &Gpu, io: &mut StepIo, b: &mut Buffers, tokens: usize) -> RtResult<()> {
        self.norm_into(gpu, io, b, &self.w.final_norm, tokens)
    }

    fn lm_head(&self) -> &Matrix {
        &self.w.lm_head
    }

    fn scratch_len(&self, tokens: usize) -> usize {
        self.w.scratch_len(tokens)
    }

    fn final_softcap(&self) -> Option<f32> {
        self.plan.final_softcap
    }

    fn logit_scale(&self) -> Option<f32> {
        self.plan.logit_scale
    }

    fn upload_step(
        &self,
        gpu: &Gpu,
        b: &mut Buffers,
        batch: &ForwardBatch,
        pad: Padding,
        kv: &KvCache,
    ) -> RtResult<u64> {
        self.ropes.upload(gpu, &mut b.ropes, batch, pad)?;
        if let (Some(delta), Some(group)) = (b.delta.as_mut(), self.plan.layout.recurrent_group()) {
            delta.upload(gpu, batch, pad, kv, group)?;
        }
        b.lora.upload(gpu, &self.loras, batch)
    }

    fn attach_lora(&self, gpu: &Gpu, id: u32, adapter: &LoraAdapter) -> Result<()> {
        self.loras.attach(gpu, id, adapter)
    }

    fn detach_lora(&self, gpu: &Gpu, id: u32) {
        self.loras.detach(gpu, id)
    }

    fn lora_shapes(&self) -> LoraShapes {
        self.loras.shapes().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ConfigSource;

    /// The plan of the config.json of fixture `name` (`tests/fixtures/models`).
    fn fixture_plan(name: &str) -> DecoderPlan {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name);
        let path = path.join("config.json");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("config.json")).expect("json");
        let mut cfg = ModelConfig::from_hf_json(&path, &json).expect("config");
        (cfg.arch.plan)(&mut cfg, &ConfigSource::Hf { path: &path, json: &json }).expect("plan")
    }

    #[test]
    fn every_roster_family_has_a_cuda_path() {
        let names = ["phi3", "olmo2", "glm4", "granite", "starcoder2", "smollm3", "qwen3-hd32", "llama-rope-dynamic"];
        for name in names {
            assert_eq!(unsupported(&fixture_plan(name)), None, "{name}");
        }
        // What has no kernel is refused, saying why: qwen3's head_dim 24.
        let why = unsupported(&fixture_plan("qwen3")).expect("head_dim 24 has no kernel");
        assert!(why.contains("head_dim 24"), "{why}");
        // Experts in place of the dense MLP and beside it (Gemma 4).
        for name in ["qwen3-moe", "mixtral", "gemma4-moe"] {
            assert_eq!(unsupported(&fixture_plan(name)), None, "{name}");
        }
        // Hybrids: gated DeltaNet, gated attention outputs, Qwen3-Next's shared expert.
        for name in ["qwen3.5", "qwen3-next"] {
            assert_eq!(unsupported(&fixture_plan(name)), None, "{name}");
        }
    }

    /// A DeltaNet layer wider than the kernels' registers is refused, saying why.
    #[test]
    fn a_deltanet_layer_past_the_kernels_limits_is_refused() {
        let mut plan = fixture_plan("qwen3.5");
        let c = plan.layers[1].attn.linear.as_mut().expect("layer 1 is linear");
        c.shape.k_dim = DELTA_MAX_K_DIM + 1;
        let why = unsupported(&plan).expect("refused");
        assert!(why.contains("layer 1: gated DeltaNet with key heads of 129"), "{why}");
    }

    /// A BERT plan is refused for each thing the CUDA executor lacks: bidirectional attention,
    /// the encoder input and post-LN norms, the exact GELU.
    #[test]
    fn an_encoder_has_no_cuda_path() {
        let mut plan = fixture_plan("bert-embed");
        assert!(unsupported(&plan).is_some_and(|why| why.contains("bidirectional")));
        plan.layers.iter_mut().for_each(|l| l.attn.params.causal = true);
        assert!(unsupported(&plan).is_some_and(|why| why.contains("encoder's input")));
        let mut llama = fixture_plan("llama");
        llama.layers[1].ffn.act = Activation::Gelu;
        assert!(unsupported(&llama).is_some_and(|why| why.contains("layer 1: the exact (erf) GELU")));
        llama.layers[1].ffn.act = Activation::Silu;
        llama.layers[0].names.ffn_residual_norm = Some("x".into());
        assert!(unsupported(&llama).is_some_and(|why| why.contains("layer 0: post-LN")));
    }
}
