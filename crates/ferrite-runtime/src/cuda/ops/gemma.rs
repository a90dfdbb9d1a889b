//! The q/k norms and Gemma 4's blocks (kernels in `gemma.cu`): RMSNorm of the q/k/v heads of a
//! fused QKV buffer (per head, or over a whole projection) and Gemma 4's per-layer inputs.

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use crate::cuda::context::{cfg, Gpu};
use crate::cuda::error::{CudaError, CudaResult};

fn check(ok: bool, what: impl FnOnce() -> String) -> CudaResult<()> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape(what()))
    }
}

/// Threads for a block over rows of `d` values (a multiple of 32, at most 256).
fn threads(d: usize) -> u32 {
    d.next_multiple_of(32).clamp(32, 256) as u32
}

/// The heads of a fused QKV buffer a `qkv_norm` normalizes: `n_q` with `wq`, then `n_k`
/// with `wk`, then `n_v` without a learned scale.
#[derive(Debug, Clone, Copy)]
pub struct QkvHeads {
    pub tokens: usize,
    pub stride: usize,
    pub head_dim: usize,
    pub n_q: usize,
    pub n_k: usize,
    pub n_v: usize,
}

/// RMSNorm each head of `x` (rows of `h.stride` values) in place over `head_dim` values:
/// the q heads times `wq`, the k heads times `wk` (each `head_dim` values; None: unit), the
/// v heads unscaled.
pub fn qkv_norm(
    gpu: &Gpu,
    x: &mut impl DevicePtrMut<bf16>,
    h: QkvHeads,
    wq: Option<&dyn DevicePtr<f32>>,
    wk: Option<&dyn DevicePtr<f32>>,
    eps: f32,
) -> CudaResult<()> {
    let heads = h.n_q + h.n_k + h.n_v;
    let need = if h.tokens == 0 { 0 } else { (h.tokens - 1) * h.stride + heads * h.head_dim };
    let w_ok = |w: Option<&dyn DevicePtr<f32>>| w.is_none_or(|w| w.len() >= h.head_dim);
    check(x.len() >= need && h.stride >= heads * h.head_dim && w_ok(wq) && w_ok(wk), || {
        format!("qkv_norm {h:?}: x {}", x.len())
    })?;
    if h.tokens == 0 || heads == 0 {
        return Ok(());
    }
    let (wq, wk) = (wq.map_or(0, |w| gpu.ptr(w)), wk.map_or(0, |w| gpu.ptr(w)));
    let xp = gpu.ptr_mut(x);
    let [st, nq, nk, hd] = [h.stride, h.n_q, h.n_k, h.head_dim].map(|v| v as i32);
    gpu.launch(
        &gpu.fns.qkv_norm,
        cfg((h.tokens as u32, heads as u32, 1), threads(h.head_dim), 0),
        &[&xp, &st, &nq, &nk, &hd, &wq, &wk, &eps],
    )
}

/// Shapes and scales of Gemma 4's per-layer inputs.
#[derive(Debug, Clone, Copy)]
pub struct PerLayerShape {
    pub tokens: usize,
    pub layers: usize,
    pub width: usize,
    pub vocab: usize,
    pub proj_scale: f32,
    pub emb_scale: f32,
    pub eps: f32,
}

/// Gemma 4's per-layer inputs, layer-major (`out` is `[layers][tokens][width]`):
/// `(rmsnorm(proj * proj_scale) * w + table[ids] * emb_scale) / sqrt(2)`, where `proj` is
/// `[tokens, layers * width]` and `table` `[vocab, layers * width]`.
#[allow(clippy::too_many_arguments)]
pub fn per_layer_inputs(
    gpu: &Gpu,
    proj: &impl DevicePtr<bf16>,
    table: &impl DevicePtr<bf16>,
    ids: &impl DevicePtr<u32>,
    w: &impl DevicePtr<f32>,
    s: PerLayerShape,
    out: &mut impl DevicePtrMut<bf16>,
) -> CudaResult<()> {
    let n = s.tokens * s.layers * s.width;
    check(
        proj.len() >= n
            && out.len() >= n
            && ids.len() >= s.tokens
            && w.len() >= s.width
            && table.len() >= s.vocab * s.layers * s.width,
        || format!("per_layer_inputs {s:?}: proj {}, table {}, out {}", proj.len(), table.len(), out.len()),
    )?;
    if n == 0 {
        return Ok(());
    }
    let (pp, tp, ip, wp, op) = (gpu.ptr(proj), gpu.ptr(table), gpu.ptr(ids), gpu.ptr(w), gpu.ptr_mut(out));
    let [t, width, vocab] = [s.tokens, s.width, s.vocab].map(|v| v as i32);
    gpu.launch(
        &gpu.fns.per_layer_inputs,
        cfg((s.tokens as u32, s.layers as u32, 1), threads(s.width), 0),
        &[&pp, &tp, &ip, &wp, &op, &t, &width, &vocab, &s.proj_scale, &s.emb_scale, &s.eps],
    )
}
