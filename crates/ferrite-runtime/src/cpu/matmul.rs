//! Linear layers: `out[m, n] = x[m, k] · W[n, k]ᵀ (+ bias)` for weights of any dtype.
//!
//! f32 weights go straight to the `gemm` crate. Other dtypes are the reference path: output
//! rows are split into chunks across the pool; each worker dequantizes its chunk of weight
//! rows into a scratch buffer and multiplies it (a dot product per row when `m == 1`, a small
//! GEMM otherwise). The weights stay in their dtype in memory.

use gemm::Parallelism;
use rayon::prelude::*;

use super::SharedMut;
use crate::dtype::DType;
use crate::error::{Result, RuntimeError};
use crate::tensor::Tensor;

pub fn linear(x: &[f32], m: usize, w: &Tensor, bias: Option<&[f32]>, out: &mut [f32]) -> Result<()> {
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
    match (w.dtype(), w.as_f32()) {
        (DType::F32, Some(wf)) => gemm_f32(x, m, wf, n, k, out, n, Parallelism::Rayon(rayon::current_num_threads())),
        _ => chunked(x, m, w, n, k, out)?,
    }
    if let Some(b) = bias {
        out.par_chunks_mut(n).for_each(|row| row.iter_mut().zip(b).for_each(|(o, b)| *o += b));
    }
    Ok(())
}

/// `dst[m, n] (row stride dst_rs) = x[m, k] · w[n, k]ᵀ`.
#[allow(clippy::too_many_arguments)]
fn gemm_f32(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, dst: &mut [f32], dst_rs: usize, par: Parallelism) {
    debug_assert!(dst.len() >= (m - 1) * dst_rs + n);
    // SAFETY: the slices cover every element the strides address (checked by the callers'
    // shape checks above), and dst does not overlap x or w.
    unsafe {
        gemm::gemm(
            m, n, k,
            dst.as_mut_ptr(), 1, dst_rs as isize,
            false,
            x.as_ptr(), 1, k as isize,
            w.as_ptr(), k as isize, 1,
            0.0, 1.0,
            false, false, false,
            par,
        );
    }
}

fn chunked(x: &[f32], m: usize, w: &Tensor, n: usize, k: usize, out: &mut [f32]) -> Result<()> {
    let threads = rayon::current_num_threads().max(1);
    let rows_per_chunk = (n / (threads * 8)).clamp(8, 256);
    let chunks = n.div_ceil(rows_per_chunk);
    let dst = SharedMut(out.as_mut_ptr());
    (0..chunks).into_par_iter().try_for_each_init(Vec::new, |scratch: &mut Vec<f32>, c| {
        let r0 = c * rows_per_chunk;
        let r1 = (r0 + rows_per_chunk).min(n);
        let rows = r1 - r0;
        scratch.resize(rows * k, 0.0);
        w.dequantize_rows(r0..r1, scratch)?;
        let base = dst;
        if m == 1 {
            for (i, wr) in scratch.chunks_exact(k).enumerate() {
                // SAFETY: column r0 + i of row 0 belongs to this chunk only.
                unsafe { *base.ptr().add(r0 + i) = dot(x, wr) };
            }
        } else {
            // SAFETY: this chunk writes columns r0..r1 of every row, which no other chunk
            // touches; the region lies inside `out` (m * n values).
            let region = unsafe { std::slice::from_raw_parts_mut(base.ptr().add(r0), (m - 1) * n + rows) };
            gemm_f32(x, m, scratch, rows, k, region, n, Parallelism::None);
        }
        Ok::<(), RuntimeError>(())
    })
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
