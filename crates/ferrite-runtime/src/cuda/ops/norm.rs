//! Norms over rows of bf16 activations (kernels in `norm.cu`): RMSNorm and LayerNorm, each
//! alone or with the residual add before it fused in (a pre-norm block's input norm, the
//! sublayer output scaled by a residual multiplier), or normalizing a sublayer's output and
//! adding it to the residual stream (the output norm of a post-norm or sandwich block); and
//! the residual add with no norm after it.

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

/// Threads for a one-block-per-row norm over rows of `d` values.
fn row_threads(d: usize) -> u32 {
    (d / 4).clamp(32, 1024).next_multiple_of(32) as u32
}

/// A norm's learned parameters: RMSNorm (`x / rms(x) * (offset + weight)`) or, with a bias,
/// LayerNorm (`(x - mean) / std * weight + bias`), each `d` f32 values.
#[derive(Clone, Copy)]
pub struct NormWeights<'a> {
    pub weight: &'a dyn DevicePtr<f32>,
    pub bias: Option<&'a dyn DevicePtr<f32>>,
    /// RMSNorm's weight offset (Gemma's `1 + w`); unused by LayerNorm.
    pub offset: f32,
    pub eps: f32,
}

impl<'a> NormWeights<'a> {
    /// An RMSNorm of `weight` (offset 0) or a LayerNorm of `weight` and `bias`.
    pub fn new(weight: &'a dyn DevicePtr<f32>, bias: Option<&'a dyn DevicePtr<f32>>, eps: f32) -> NormWeights<'a> {
        NormWeights { weight, bias, offset: 0.0, eps }
    }

    fn fits(&self, d: usize) -> bool {
        self.weight.len() >= d && self.bias.is_none_or(|b| b.len() >= d)
    }
}

/// `out = norm(x)` over `rows` rows of `d` values. With `residual` `(r, s)`, first
/// `r += s · x` (the stored bf16 sum is what gets normalized): the fused residual add.
pub fn norm(
    gpu: &Gpu,
    x: &impl DevicePtr<bf16>,
    residual: Option<(&mut dyn DevicePtrMut<bf16>, f32)>,
    n: NormWeights,
    (rows, d): (usize, usize),
    out: &mut impl DevicePtrMut<bf16>,
) -> CudaResult<()> {
    let len = rows * d;
    let res_len = residual.as_ref().map(|(r, _)| r.len());
    check(x.len() >= len && n.fits(d) && out.len() >= len && res_len.is_none_or(|l| l >= len), || {
        format!("norm [{rows}, {d}]: x {}, w {}, out {}, residual {res_len:?}", x.len(), n.weight.len(), out.len())
    })?;
    if rows == 0 {
        return Ok(());
    }
    let (rp, scale): (u64, f32) = residual.map_or((0, 1.0), |(r, s)| (gpu.ptr_mut(r), s));
    let (xp, wp, op) = (gpu.ptr(x), gpu.ptr(n.weight), gpu.ptr_mut(out));
    let d_i = d as i32;
    let grid = cfg((rows as u32, 1, 1), row_threads(d), 0);
    match n.bias {
        None => gpu.launch(&gpu.fns.rms_norm, grid, &[&xp, &rp, &scale, &wp, &op, &d_i, &n.eps, &n.offset]),
        Some(b) => {
            let bp = gpu.ptr(b);
            gpu.launch(&gpu.fns.layer_norm, grid, &[&xp, &rp, &scale, &wp, &bp, &op, &d_i, &n.eps])
        }
    }
}

/// RMSNorm of `rows` rows of `d` values: `out = x / rms(x) * (offset + w)`. With `residual`,
/// first `residual += x` (the stored bf16 sum is what gets normalized): the fused residual add.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    gpu: &Gpu,
    x: &impl DevicePtr<bf16>,
    residual: Option<&mut dyn DevicePtrMut<bf16>>,
    w: &impl DevicePtr<f32>,
    shape: (usize, usize),
    eps: f32,
    offset: f32,
    out: &mut impl DevicePtrMut<bf16>,
) -> CudaResult<()> {
    let n = NormWeights { weight: w, bias: None, offset, eps };
    norm(gpu, x, residual.map(|r| (r, 1.0)), n, shape, out)
}

/// `x = (x + ys · norm(y)) · scale` over `rows` rows of `d` values: a sublayer's output `y`
/// normed by its own weights and added to the residual stream, `ys` the residual multiplier
/// (granite), `scale` a scale of the sum (Gemma 4's layer scalar).
#[allow(clippy::too_many_arguments)]
pub fn norm_add(
    gpu: &Gpu,
    y: &impl DevicePtr<bf16>,
    n: NormWeights,
    x: &mut impl DevicePtrMut<bf16>,
    (rows, d): (usize, usize),
    ys: f32,
    scale: f32,
) -> CudaResult<()> {
    check(y.len() >= rows * d && x.len() >= rows * d && n.fits(d), || {
        format!("norm_add [{rows}, {d}]: y {}, x {}, w {}", y.len(), x.len(), n.weight.len())
    })?;
    if rows * d == 0 {
        return Ok(());
    }
    let (yp, wp, xp) = (gpu.ptr(y), gpu.ptr(n.weight), gpu.ptr_mut(x));
    let d_i = d as i32;
    let grid = cfg((rows as u32, 1, 1), (d / 4).next_multiple_of(32).clamp(32, 256) as u32, 0);
    match n.bias {
        None => gpu.launch(&gpu.fns.rms_norm_add, grid, &[&yp, &wp, &xp, &d_i, &n.eps, &ys, &scale]),
        Some(b) => {
            let bp = gpu.ptr(b);
            gpu.launch(&gpu.fns.layer_norm_add, grid, &[&yp, &wp, &bp, &xp, &d_i, &n.eps, &ys, &scale])
        }
    }
}

/// `x = (x + rmsnorm(y) · w) · scale` (`norm_add` of an RMSNorm, no residual multiplier).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_add(
    gpu: &Gpu,
    y: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<f32>,
    x: &mut impl DevicePtrMut<bf16>,
    shape: (usize, usize),
    eps: f32,
    scale: f32,
) -> CudaResult<()> {
    norm_add(gpu, y, NormWeights::new(w, None, eps), x, shape, 1.0, scale)
}

/// `x += s · y` over the first `n` values: a sublayer output joining the residual stream with
/// no norm after it to fuse the add into.
pub fn residual_add(
    gpu: &Gpu,
    y: &impl DevicePtr<bf16>,
    x: &mut impl DevicePtrMut<bf16>,
    n: usize,
    s: f32,
) -> CudaResult<()> {
    check(y.len() >= n && x.len() >= n, || format!("residual_add of {n}: y {}, x {}", y.len(), x.len()))?;
    if n == 0 {
        return Ok(());
    }
    let (yp, xp) = (gpu.ptr(y), gpu.ptr_mut(x));
    let n64 = n as u64;
    gpu.launch(&gpu.fns.residual_add, cfg((gpu.grid_for(n, 256), 1, 1), 256, 0), &[&xp, &yp, &n64, &s])
}
