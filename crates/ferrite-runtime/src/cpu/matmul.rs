//! Linear layers: `out[m, n] = x[m, k] · W[n, k]ᵀ (+ bias)` for weights of any dtype.
//!
//! f32 weights go straight to the `gemm` crate; quantized, f16 and bf16 weights go to
//! `qmatmul` (fast kernels on the weights as stored, or the exact reference path, per
//! `KernelMode`).

use gemm::Parallelism;
use rayon::prelude::*;

use crate::dtype::DType;
use crate::error::{Result, RuntimeError};
use crate::tensor::Tensor;

/// `outs[i] = x · ws[i].0ᵀ (+ bias ws[i].1)` for weights that read the same input (a layer's
/// q/k/v or gate/up): quantized weights of one dtype share one quantization of `x` and one
/// parallel loop. Each output is exactly what `linear` gives it alone.
pub fn linear_many(x: &[f32], m: usize, ws: &[(&Tensor, Option<&[f32]>)], outs: &mut [&mut [f32]]) -> Result<()> {
    if ws.len() != outs.len() {
        return Err(RuntimeError::Shape(format!("linear_many: {} weights, {} outputs", ws.len(), outs.len())));
    }
    let k = ws.first().map_or(0, |(w, _)| w.row_len());
    if ws.iter().any(|(w, _)| w.dtype() == DType::F32 || w.row_len() != k) {
        return ws.iter().zip(outs.iter_mut()).try_for_each(|((w, b), out)| linear(x, m, w, *b, out));
    }
    for ((w, b), out) in ws.iter().zip(outs.iter()) {
        check_shapes(x, m, w, *b, out)?;
    }
    let weights: Vec<&Tensor> = ws.iter().map(|(w, _)| *w).collect();
    super::qmatmul::linear_many(x, m, &weights, outs)?;
    for ((w, b), out) in ws.iter().zip(outs.iter_mut()) {
        if let Some(b) = b {
            add_bias(out, w.rows(), b);
        }
    }
    Ok(())
}

fn check_shapes(x: &[f32], m: usize, w: &Tensor, bias: Option<&[f32]>, out: &[f32]) -> Result<()> {
    let (n, k) = (w.rows(), w.row_len());
    if w.shape().len() != 2 || x.len() != m * k || out.len() != m * n {
        return Err(RuntimeError::Shape(format!(
            "linear: x has {} values for m={m}, weight {w:?}, out has {}",
            x.len(),
            out.len()
        )));
    }
    if let Some(b) = bias {
        if b.len() != n {
            return Err(RuntimeError::Shape(format!("linear: bias of {} for {n} outputs", b.len())));
        }
    }
    Ok(())
}

fn add_bias(out: &mut [f32], n: usize, b: &[f32]) {
    let add = |row: &mut [f32]| row.iter_mut().zip(b).for_each(|(o, b)| *o += b);
    if out.len() >= 1 << 14 {
        out.par_chunks_mut(n).for_each(add);
    } else {
        out.chunks_mut(n).for_each(add);
    }
}

/// Prepare `w` for `linear` now (see `qmatmul::prepare`): call it when a model loads a weight
/// it will multiply by.
pub fn prepare_linear(w: &Tensor) {
    super::qmatmul::prepare(w)
}

pub fn linear(x: &[f32], m: usize, w: &Tensor, bias: Option<&[f32]>, out: &mut [f32]) -> Result<()> {
    check_shapes(x, m, w, bias, out)?;
    let (n, k) = (w.rows(), w.row_len());
    match (w.dtype(), w.as_f32()) {
        (DType::F32, Some(wf)) => gemm_f32(x, m, wf, n, k, out, n, Parallelism::Rayon(rayon::current_num_threads())),
        _ => super::qmatmul::linear(x, m, w, out)?,
    }
    if let Some(b) = bias {
        add_bias(out, n, b);
    }
    Ok(())
}

/// `dst[m, n] (row stride dst_rs) = x[m, k] · w[n, k]ᵀ`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_f32(
    x: &[f32],
    m: usize,
    w: &[f32],
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    par: Parallelism,
) {
    debug_assert!(dst.len() >= (m - 1) * dst_rs + n);
    // SAFETY: the slices cover every element the strides address (checked by the callers'
    // shape checks above), and dst does not overlap x or w.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// f32 dot product with independent accumulators so the compiler vectorizes it.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}
