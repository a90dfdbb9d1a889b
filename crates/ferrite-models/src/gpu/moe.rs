//! A layer's routed experts on the device: the CUDA executor's side of a `MoePlan`, one path
//! for every style. The router GEMM writes f32 logits; `moe_route` picks each token's experts
//! and groups the step's (token, expert) pairs by expert on the device; one launch per
//! projection runs every expert (`moe_linear`: the gate-up projection with the gated
//! activation in its epilogue; `moe_down`: the down projection, and each token's experts'
//! outputs summed times its routing weights, in the same launch at decode). Nothing comes back
//! to the host, so MoE decode steps replay CUDA graphs like dense ones.
//!
//! The styles differ only in data: `Sparse` experts (qwen3_moe, mixtral) read the pre-FFN
//! normed input through the router and replace the dense MLP, with Qwen3-Next's shared expert
//! beside them (a gated MLP whose output joins theirs times the sigmoid of its gate's logit); Gemma 4's run beside it, with
//! the router reading the residual unit-RMSNormed times a learned scale (one norm launch),
//! per-expert scales on the routing weights (a vector the routing kernel multiplies by), their
//! own input norm, and the normed dense and expert outputs summed.

use ferrite_runtime::cuda::ops::{
    self, ExpertMatrix, ExpertProduct, ExpertSum, GatedActivation, Matrix, MoeRoute, MOE_MAX_EXPERTS, MOE_MAX_TOP_K,
};
use ferrite_runtime::cuda::{CudaSlice, Gpu};
use ferrite_runtime::{DType, Result as RtResult, Tensor};
use half::bf16;

use super::decoder_weights::{stack_fp8, MlpWeights};
use crate::error::{LoadError, Result};
use crate::moe::{ExpertLayout, ExpertRows, MoeShape, Projection};
use crate::plan::{DecoderPlan, ExpertNames, MlpNames, MoePlan, MoeStyle};
use crate::weights::Weights;

/// Gemma 4's extras around its experts.
pub struct Gemma4Moe {
    /// The router input's norm weight: its learned scale times `hidden^-1/2`.
    pub router_norm: CudaSlice<f32>,
    /// Each expert's scale of its routing weight.
    pub per_expert_scale: CudaSlice<f32>,
    /// Norms the dense MLP's output, the experts' input and the experts' output.
    pub post_mlp_norm: CudaSlice<f32>,
    pub pre_norm: CudaSlice<f32>,
    pub post_norm: CudaSlice<f32>,
}

/// A shared expert every token runs through beside the routed ones (Qwen3-Next): a gated MLP
/// and its optional gate (`[1, hidden]`), whose sigmoid scales its output per token.
pub struct SharedWeights {
    pub mlp: MlpWeights,
    pub gate: Option<Matrix>,
}

/// A layer's experts on the device.
pub struct MoeWeights {
    /// `[experts, hidden]`.
    pub router: Matrix,
    /// `[experts, 2 × inter, hidden]`: each expert's gate rows, then its up rows.
    pub gate_up: ExpertMatrix,
    /// `[experts, hidden, inter]`.
    pub down: ExpertMatrix,
    pub gemma4: Option<Gemma4Moe>,
    pub shared: Option<SharedWeights>,
}

impl MoeWeights {
    /// Device bytes of the weights.
    pub fn bytes(&self) -> usize {
        let extras = self.gemma4.as_ref().map_or(0, |g| {
            4 * [&g.router_norm, &g.per_expert_scale, &g.post_mlp_norm, &g.pre_norm, &g.post_norm]
                .iter()
                .map(|v| v.len())
                .sum::<usize>()
        });
        let shared = self.shared.as_ref().map_or(0, |s| s.mlp.bytes() + s.gate.as_ref().map_or(0, Matrix::bytes));
        self.router.bytes() + self.gate_up.bytes() + self.down.bytes() + extras + shared
    }
}

/// A layer's experts (`names`, of `shape`, `hidden` wide) from the weights, in whichever
/// layout they are stored (`ExpertLayout`): the gate-up matrix (each expert's gate rows, then
/// its up rows) and the down matrix, each one allocation.
pub fn stack_experts(
    w: &Weights,
    gpu: &Gpu,
    names: &ExpertNames,
    shape: MoeShape,
    hidden: usize,
) -> Result<[ExpertMatrix; 2]> {
    let layout = ExpertLayout::find(w, names, shape, hidden)?;
    let (e, inter) = (shape.num_experts, shape.intermediate);
    let gate_up: Vec<ExpertRows> =
        (0..e).flat_map(|x| [layout.rows(x, Projection::Gate), layout.rows(x, Projection::Up)]).collect();
    let down: Vec<ExpertRows> = (0..e).map(|x| layout.rows(x, Projection::Down)).collect();
    Ok([stack(w, gpu, &gate_up, (e, 2 * inter, hidden))?, stack(w, gpu, &down, (e, hidden, inter))?])
}

/// `pieces`, in order, as one `[experts, rows, cols]` matrix: FP8 rows when every piece is FP8
/// (`stack_fp8_experts`), the stored bytes when every piece is in one type the experts' kernels
/// read (bf16, a GGUF block type), else the values in bf16 (f32 or f16 files, or a file that
/// quantized the pieces differently).
fn stack(w: &Weights, gpu: &Gpu, pieces: &[ExpertRows], shape: (usize, usize, usize)) -> Result<ExpertMatrix> {
    if let Some(m) = stack_fp8_experts(w, gpu, pieces, shape)? {
        return Ok(m);
    }
    let mut tensors: std::collections::HashMap<&str, Tensor> = std::collections::HashMap::new();
    for p in pieces {
        if !tensors.contains_key(p.name.as_str()) {
            tensors.insert(&p.name, w.get(&p.name, &p.shape)?);
        }
    }
    let bad = |name: &str, e: String| LoadError::Other(format!("{name}: {e}"));
    let tensor = |name: &str| tensors.get(name).ok_or_else(|| bad(name, "not loaded".into()));
    let first = pieces.first().map(|p| tensor(&p.name)).transpose()?.map(Tensor::dtype);
    let one = first.filter(|&d| pieces.iter().all(|p| tensors.get(p.name.as_str()).is_some_and(|t| t.dtype() == d)));
    let mut bytes = Vec::new();
    let dtype = match one.filter(|&d| ExpertMatrix::supports(d)) {
        Some(dtype) => {
            for p in pieces {
                bytes.extend_from_slice(tensor(&p.name)?.row_range_bytes(p.rows.clone()));
            }
            dtype
        }
        None => {
            let mut row = vec![0f32; shape.2];
            for p in pieces {
                let t = tensor(&p.name)?;
                for r in p.rows.clone() {
                    t.dequantize_rows(r..r + 1, &mut row).map_err(|e| bad(&p.name, e.to_string()))?;
                    bytes.extend(row.iter().flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes()));
                }
            }
            DType::BF16
        }
    };
    let name = pieces.first().map_or("experts", |p| p.name.as_str());
    ExpertMatrix::upload(gpu, dtype, shape, &bytes).map_err(|e| bad(name, e.to_string()))
}

/// `pieces` as FP8 expert rows, when the checkpoint stores every piece as FP8 (one tensor per
/// expert and projection) with scale runs that stack and rows the kernels take (multiples of
/// 16 values); `None` otherwise (the caller reads them dequantized).
fn stack_fp8_experts(
    w: &Weights,
    gpu: &Gpu,
    pieces: &[ExpertRows],
    shape: (usize, usize, usize),
) -> Result<Option<ExpertMatrix>> {
    let mut parts = Vec::with_capacity(pieces.len());
    for p in pieces {
        let &[total, cols] = p.shape.as_slice() else { return Ok(None) };
        match w.fp8(&p.name, total, cols)? {
            Some(f) if p.rows == (0..total) => parts.push(f),
            Some(f) => parts.push(f.slice_rows(p.rows.clone())),
            None => return Ok(None),
        }
    }
    let Some(all) = stack_fp8(parts).filter(|f| f.cols.is_multiple_of(16) && f.col_block.is_multiple_of(16)) else {
        return Ok(None);
    };
    let name = pieces.first().map_or("experts", |p| p.name.as_str());
    let m = ExpertMatrix::upload_fp8(gpu, shape, &all.codes, &all.scales, all.col_block)
        .map_err(|e| LoadError::Other(format!("{name}: {e}")))?;
    Ok(Some(m))
}

/// Why the CUDA experts cannot run `plan`'s MoE layers, if they cannot: the routing kernels'
/// limits, one (experts, experts per token) for all layers (they share the step's routing
/// buffers), and expert rows of whole 16-byte loads.
pub fn unsupported(plan: &DecoderPlan) -> Option<String> {
    let mut shape = None;
    for (i, l) in plan.layers.iter().enumerate() {
        let Some(m) = &l.ffn.moe else { continue };
        let s = m.shape;
        if s.num_experts > MOE_MAX_EXPERTS || s.top_k > MOE_MAX_TOP_K {
            return Some(format!(
                "layer {i}: {} of {} experts a token (the CUDA routing takes up to {MOE_MAX_TOP_K} of up to \
                 {MOE_MAX_EXPERTS})",
                s.top_k, s.num_experts
            ));
        }
        if *shape.get_or_insert((s.num_experts, s.top_k)) != (s.num_experts, s.top_k) {
            return Some(format!("layer {i}: MoE layers of different expert counts have no CUDA path"));
        }
        if !s.intermediate.is_multiple_of(8) {
            return Some(format!("layer {i}: experts {} wide (the CUDA experts need a multiple of 8)", s.intermediate));
        }
        if m.shared.as_ref().is_some_and(|sh| matches!(sh.mlp, MlpNames::Plain { .. })) {
            return Some(format!("layer {i}: an ungated shared expert has no CUDA path"));
        }
    }
    None
}

/// The activations of a step's MoE layers, for steps of up to `tokens` tokens.
pub struct MoeBuffers {
    /// Router logits `[tokens, experts]`.
    logits: CudaSlice<f32>,
    experts: ExpertBuffers,
    /// Each token's weighted sum of its experts' outputs.
    sum: CudaSlice<bf16>,
    /// Gemma 4: normed residual rows (router input, then expert input) and the mixed output.
    gemma4: Option<(CudaSlice<bf16>, CudaSlice<bf16>)>,
    shared: Option<SharedBuffers>,
}

/// A shared expert's activations: its gate-up rows `[tokens, 2 × inter]` (when the gated
/// activation does not fuse into the GEMM), the gated activation `[tokens, inter]`, its output
/// `[tokens, hidden]` and its gate's logits.
struct SharedBuffers {
    gate_up: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    logits: CudaSlice<f32>,
}

/// The routing and the per-pair rows (grouped by expert): the gated activation `[pairs,
/// inter]` and the expert's output `[pairs, hidden]`, and the sum's counters.
struct ExpertBuffers {
    route: MoeRoute,
    act: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    sum: ExpertSum,
}

impl MoeBuffers {
    /// Buffers for `plan`'s MoE layers (none without any), `hidden` wide.
    pub fn new(gpu: &Gpu, plan: &DecoderPlan, hidden: usize, tokens: usize) -> RtResult<Option<MoeBuffers>> {
        let moes: Vec<&MoePlan> = plan.layers.iter().filter_map(|l| l.ffn.moe.as_ref()).collect();
        let Some(first) = moes.first() else { return Ok(None) };
        let (e, k) = (first.shape.num_experts, first.shape.top_k);
        let inter = moes.iter().map(|m| m.shape.intermediate).max().unwrap_or(0);
        let pairs = tokens * k;
        let bf = |n: usize| gpu.alloc::<bf16>(n);
        let gemma4 = moes.iter().any(|m| m.style == MoeStyle::Gemma4);
        Ok(Some(MoeBuffers {
            logits: gpu.alloc(tokens * e)?,
            experts: ExpertBuffers {
                route: MoeRoute::new(gpu, tokens, e, k)?,
                act: bf(pairs * inter)?,
                out: bf(pairs * hidden)?,
                sum: ExpertSum::new(gpu, hidden)?,
            },
            sum: bf(tokens * hidden)?,
            gemma4: if gemma4 { Some((bf(tokens * hidden)?, bf(tokens * hidden)?)) } else { None },
            shared: match moes.iter().filter_map(|m| m.shared.as_ref()).map(|s| s.intermediate).max() {
                Some(inter) => Some(SharedBuffers {
                    gate_up: bf(tokens * 2 * inter)?,
                    act: bf(tokens * inter)?,
                    out: bf(tokens * hidden)?,
                    logits: gpu.alloc(tokens)?,
                }),
                None => None,
            },
        }))
    }
}

/// The shapes of a MoE layer's step.
#[derive(Debug, Clone, Copy)]
pub struct MoeStep {
    pub tokens: usize,
    pub hidden: usize,
    pub eps: f32,
    pub act: GatedActivation,
}

/// `dest = Σ weight · expert(x)` over each token's routed experts (`b.route` already filled):
/// the gate-up projection with its activation, the down projection, the weighted sum.
fn run_experts(
    gpu: &Gpu,
    plan: &MoePlan,
    w: &MoeWeights,
    b: &mut ExpertBuffers,
    x: &CudaSlice<bf16>,
    dest: &mut CudaSlice<bf16>,
    s: MoeStep,
) -> RtResult<()> {
    let t = s.tokens;
    ops::moe_linear(gpu, ExpertProduct::Gated(s.act), x, true, &w.gate_up, &b.route, t, &mut b.act)?;
    let act = b.act.slice(..t * plan.shape.top_k * plan.shape.intermediate);
    Ok(ops::moe_down(gpu, &act, &w.down, &b.route, t, &mut b.out, &mut b.sum, dest)?)
}

/// `out += sigmoid(gate · x) · shared(x)` per token (the gate's factor 1 without a gate):
/// the gate-up GEMM with its activation, the down GEMM, the gate's logits and the scaled add.
#[allow(clippy::too_many_arguments)]
fn add_shared(
    gpu: &Gpu,
    w: &SharedWeights,
    inter: usize,
    b: &mut SharedBuffers,
    x: &CudaSlice<bf16>,
    out: &mut CudaSlice<bf16>,
    s: MoeStep,
    dequant: &mut Option<CudaSlice<bf16>>,
) -> RtResult<()> {
    let (t, d) = (s.tokens, s.hidden);
    w.mlp.gate_up.linear_gated(gpu, s.act, x, &mut b.gate_up, &mut b.act, (t, inter, d), dequant.as_mut())?;
    w.mlp.down.linear(gpu, &b.act, None, &mut b.out, (t, d, inter), dequant.as_mut())?;
    match &w.gate {
        Some(gate) => {
            gate.linear::<f32>(gpu, x, None, &mut b.logits, (t, 1, d), None)?;
            ops::add_sigmoid_scaled(gpu, out, &b.out, &b.logits, (t, d))?;
        }
        None => ops::residual_add(gpu, &b.out, out, t * d, 1.0)?,
    }
    Ok(())
}

/// Queue a MoE layer of `plan` over `s.tokens` tokens. Sparse: `out = experts(input)` (`input`
/// is the pre-FFN normed rows), plus a shared expert's share. Gemma 4: `out` holds the dense MLP's output and becomes
/// `post_mlp_norm(out) + post_norm(experts(pre_norm(residual)))`, routed by the residual.
#[allow(clippy::too_many_arguments)]
pub fn queue_moe(
    gpu: &Gpu,
    plan: &MoePlan,
    w: &MoeWeights,
    m: &mut MoeBuffers,
    input: &CudaSlice<bf16>,
    residual: &CudaSlice<bf16>,
    out: &mut CudaSlice<bf16>,
    s: MoeStep,
    dequant: &mut Option<CudaSlice<bf16>>,
) -> RtResult<()> {
    let (t, d, eps) = (s.tokens, s.hidden, s.eps);
    let e = plan.shape.num_experts;
    let (Some(g), Some((normed, mixed))) = (&w.gemma4, m.gemma4.as_mut()) else {
        w.router.linear::<f32>(gpu, input, None, &mut m.logits, (t, e, d), None)?;
        ops::moe_route(gpu, &m.logits, t, plan.renormalize, None, &mut m.experts.route)?;
        run_experts(gpu, plan, w, &mut m.experts, input, out, s)?;
        if let (Some(sw), Some(sb), Some(sp)) = (&w.shared, m.shared.as_mut(), &plan.shared) {
            add_shared(gpu, sw, sp.intermediate, sb, input, out, s, dequant)?;
        }
        return Ok(());
    };
    ops::rms_norm(gpu, &*out, None, &g.post_mlp_norm, (t, d), eps, 0.0, mixed)?;
    ops::rms_norm(gpu, residual, None, &g.router_norm, (t, d), eps, 0.0, normed)?;
    w.router.linear::<f32>(gpu, &*normed, None, &mut m.logits, (t, e, d), None)?;
    ops::moe_route(gpu, &m.logits, t, plan.renormalize, Some(&g.per_expert_scale), &mut m.experts.route)?;
    ops::rms_norm(gpu, residual, None, &g.pre_norm, (t, d), eps, 0.0, normed)?;
    run_experts(gpu, plan, w, &mut m.experts, normed, &mut m.sum, s)?;
    ops::rms_norm_add(gpu, &m.sum, &g.post_norm, mixed, (t, d), eps, 1.0)?;
    ops::copy(gpu, &mixed.slice(..t * d), &mut out.slice_mut(..t * d))?;
    Ok(())
}
