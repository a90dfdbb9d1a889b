//! The panel path: `out = x · Wᵀ` by panels of weight rows widened to f32 and multiplied with
//! the `gemm` crate.
//!
//! It serves prompt processing (many activation rows: each panel is dequantized once and
//! reused by every row, so the products run at f32 GEMM speed on exact weights), the
//! dtypes without a fast kernel (Q2_K, Q3_K, Q8_1, ...), and the exact reference mode. Output
//! rows are split into panels across the pool; each worker dequantizes its panel into a
//! scratch buffer and multiplies it (a dot product per row when `m == 1`, a small GEMM
//! otherwise) — or, with AVX-512, hands wide panels to `gemm512`, which dequantizes them
//! slice by slice into its packed layout. The weights stay in their dtype in memory.

use gemm::Parallelism;
use rayon::prelude::*;

use crate::cpu::matmul::{dot, gemm_f32};
use crate::cpu::SharedMut;
use crate::error::{Result, RuntimeError};
use crate::tensor::Tensor;

/// Widens one weight row (its bytes) into f32 values.
pub(crate) type RowDequant<'a> = &'a (dyn Fn(&[u8], &mut [f32]) -> Result<()> + Sync);

/// Weight rows per panel: about 8 panels per thread (whole 32-row slivers for GEMM), at most
/// 256 rows.
fn panel_rows(n: usize, m: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    if m == 1 {
        return (n / (threads * 8)).clamp(8, 256);
    }
    32 * (n / 32 / (threads * 8)).clamp(1, 8)
}

/// `out = x · Wᵀ` by panels widened with `dequant`; the products use this crate's AVX-512
/// kernel when `avx512` (the CPU must have AVX-512 F), else the `gemm` crate.
pub(crate) fn by_panels(
    x: &[f32],
    m: usize,
    w: &Tensor,
    out: &mut [f32],
    dequant: RowDequant<'_>,
    avx512: bool,
) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if avx512 && m > 1 {
        return wide_panels(x, m, w, out, dequant);
    }
    let _ = avx512;
    let (n, k) = (w.rows(), w.row_len());
    let rows_per_panel = panel_rows(n, m);
    let panels = n.div_ceil(rows_per_panel);
    let rb = w.row_bytes();
    let bytes = w.bytes();
    let dst = SharedMut(out.as_mut_ptr());
    (0..panels).into_par_iter().try_for_each_init(Vec::new, |scratch: &mut Vec<f32>, c| {
        let r0 = c * rows_per_panel;
        let r1 = (r0 + rows_per_panel).min(n);
        let rows = r1 - r0;
        scratch.resize(rows * k, 0.0);
        let src = bytes
            .get(r0 * rb..r1 * rb)
            .ok_or_else(|| RuntimeError::Shape(format!("rows {r0}..{r1} of {w:?}: short buffer")))?;
        for (row, values) in src.chunks_exact(rb).zip(scratch.chunks_exact_mut(k)) {
            dequant(row, values)?;
        }
        let base = dst;
        if m == 1 {
            for (i, wr) in scratch.chunks_exact(k).enumerate() {
                // SAFETY: column r0 + i of row 0 belongs to this panel only.
                unsafe { *base.ptr().add(r0 + i) = dot(x, wr) };
            }
        } else {
            // SAFETY: this panel writes columns r0..r1 of every row, which no other panel
            // touches; the region lies inside `out` (m * n values, checked by `linear`).
            let region = unsafe { std::slice::from_raw_parts_mut(base.ptr().add(r0), (m - 1) * n + rows) };
            gemm_f32(x, m, scratch, rows, k, region, n, Parallelism::None);
        }
        Ok::<(), RuntimeError>(())
    })
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The packed activations of the last `wide_panels` call on this thread, reused so a
    /// prefill does not page in a fresh buffer per layer.
    static PACKED_X: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The AVX-512 panel path: wide panels (about two per thread, up to 512 rows), each dequantized
/// slice by slice straight into the GEMM's packed layout, so the activations are streamed
/// through once per panel and no f32 copy of the panel exists.
#[cfg(target_arch = "x86_64")]
fn wide_panels(x: &[f32], m: usize, w: &Tensor, out: &mut [f32], dequant: RowDequant<'_>) -> Result<()> {
    use super::gemm512;
    let (n, k) = (w.rows(), w.row_len());
    let threads = rayon::current_num_threads().max(1);
    let rows_per_panel = 32 * (n.div_ceil(32) / (2 * threads)).clamp(1, 16);
    let panels = n.div_ceil(rows_per_panel);
    let (rb, bytes) = (w.row_bytes(), w.bytes());
    let (elems, block_bytes) = (w.dtype().block_elems(), w.dtype().block_bytes());
    let mut xp = PACKED_X.with(|c| c.take());
    gemm512::pack_rows(x, m, k, &mut xp);
    let dst = SharedMut(out.as_mut_ptr());
    let result = (0..panels).into_par_iter().try_for_each_init(gemm512::Scratch::default, |scratch, c| {
        let r0 = c * rows_per_panel;
        let r1 = (r0 + rows_per_panel).min(n);
        let src = bytes
            .get(r0 * rb..r1 * rb)
            .ok_or_else(|| RuntimeError::Shape(format!("rows {r0}..{r1} of {w:?}: short buffer")))?;
        // Columns pc.. of panel row j: whole blocks, since slices start at multiples of 256.
        let rows = |j: usize, pc: usize, values: &mut [f32]| dequant(&src[j * rb + pc / elems * block_bytes..], values);
        let base = dst;
        // SAFETY: the caller vouches for AVX-512 F; `xp` is packed for (m, k); this panel
        // writes columns r0..r1 of every row, which no other panel touches, inside `out`.
        unsafe { gemm512::gemm(&xp, m, k, r1 - r0, &rows, base.ptr().add(r0), n, scratch) }
    });
    PACKED_X.with(|c| *c.borrow_mut() = xp);
    result
}
