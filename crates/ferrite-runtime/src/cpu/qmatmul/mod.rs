//! Fast linear layers over GGUF-quantized, f16 and bf16 weights.
//!
//! - **Quantized weights** take one kernel for every number of activation rows `m`, so a
//!   row's result never depends on the batch it runs in. For the dtypes `packed` lays out
//!   (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MLX) that is an integer GEMM (14-bit
//!   activations against 16-bit integer weight codes in a register-tiled kernel) reading a
//!   copy of the weights interleaved 16 rows at a time (`packed`, built once per tensor, the
//!   same size as the GGUF blocks): `igemm` with AVX-512 VNNI, `igemm_avx2` at the AVX2 and
//!   AVX-VNNI levels, the same arithmetic. The portable `Scalar` level uses the row kernels:
//!   the activations are quantized once per call to 15-bit integer blocks (`acts`) and each
//!   weight row is dotted with them straight from its GGUF blocks: `legacy` (Q4_0, Q4_1,
//!   Q5_0, Q5_1, Q8_0 against 32-blocks), `kquants` (Q4_K, Q5_K, Q6_K against 256-blocks) and
//!   `mlx` (MLX's affine groups against 32-blocks). MLX formats are block types like the GGUF
//!   ones (`quant::mlx`): the integer GEMMs pack those with 16-bit scales.
//! - **16-bit floats**: rows widened in registers and dotted with the f32 activations
//!   (`float`) for small `m`; from `PANEL_MIN_ROWS` rows, panels dequantized to f32 (`dequant`)
//!   and multiplied with an AVX-512 f32 GEMM (`gemm512`) or the `gemm` crate (`panel`). Panels
//!   also serve the dtypes without a kernel (Q2_K, Q3_K, Q8_1, ...).
//!
//! Work is split by output rows over the process-wide rayon pool. The kernels exist per
//! instruction-set `Level` (`isa`), picked at run time; `KernelMode` (`mode`) can force a level,
//! the portable scalar kernels, or the exact reference path.

mod acts;
mod dequant;
mod float;
#[cfg(target_arch = "x86_64")]
pub(crate) mod gemm512;
#[cfg(target_arch = "x86_64")]
mod igemm;
#[cfg(target_arch = "x86_64")]
mod igemm_avx2;
pub(crate) mod isa;
mod kquants;
mod legacy;
mod mlx;
mod mode;
#[cfg(target_arch = "x86_64")]
mod packed;
mod panel;
#[cfg(test)]
mod tests;

use rayon::prelude::*;

pub use isa::Level;
pub use mode::{kernel_mode, set_kernel_mode, KernelMode, KERNELS_ENV};

use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Tensor;
use acts::{ActRow, QuantizedActs};

/// One weight row (its GGUF bytes) dotted with one quantized activation row.
pub(crate) type RowDot = unsafe fn(&[u8], ActRow<'_>) -> f32;

/// From this many activation rows on, 16-bit float weights are widened panel by panel for an
/// f32 GEMM instead of being dotted row by row.
const PANEL_MIN_ROWS: usize = 8;

/// `out[m, n] = x[m, k] · W[n, k]ᵀ` for non-f32 weights, in the current `KernelMode`. The
/// caller has checked the shapes.
pub(crate) fn linear(x: &[f32], m: usize, w: &Tensor, out: &mut [f32]) -> Result<()> {
    match kernel_mode().level() {
        Some(level) => linear_at(x, m, w, out, level),
        None => panel::by_panels(x, m, w, out, &|src, dst| reference_dequant(w.dtype(), src, dst), false),
    }
}

/// Whether weights of `dtype` go to an integer GEMM at `level` (`None`: the reference path).
#[cfg(target_arch = "x86_64")]
fn takes_igemm(level: Option<Level>, dtype: DType) -> bool {
    level.is_some_and(|l| l >= Level::Avx2) && igemm::supports(dtype)
}

/// `linear_many` on the integer GEMM of `level`.
///
/// # Safety
/// `takes_igemm(Some(level), dtype)` holds for the weights' one dtype, `level` is available,
/// and the shapes are checked.
#[cfg(target_arch = "x86_64")]
unsafe fn igemm_many(x: &[f32], m: usize, ws: &[&Tensor], outs: &mut [&mut [f32]], level: Level) -> Result<()> {
    if level == Level::Avx512Vnni {
        igemm::linear_many(x, m, ws, outs)
    } else {
        igemm_avx2::linear_many(x, m, ws, outs, level)
    }
}

/// Build now what `linear` builds on its first call with `w` in the current `KernelMode`: the
/// packed copy the integer GEMM reads (`packed`). A model calls this at load, so its first
/// step does not pay for the re-layout and for faulting the file in (measured at load:
/// SmolLM2 +0.1 s, Qwen2.5-Coder-1.5B +1 s).
pub(crate) fn prepare(w: &Tensor) {
    #[cfg(target_arch = "x86_64")]
    if takes_igemm(kernel_mode().level(), w.dtype()) {
        packed::packed(w);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = w;
}

/// `linear` with the fast kernels at `level` (which the CPU must have).
///
/// Quantized weights take one kernel for every `m` (an integer GEMM from AVX2 on, the row
/// kernels at the scalar level), so a row's result never depends on the rows it is batched with.
/// 16-bit float weights switch to panels from `PANEL_MIN_ROWS` rows.
pub(crate) fn linear_at(x: &[f32], m: usize, w: &Tensor, out: &mut [f32], level: Level) -> Result<()> {
    let dtype = w.dtype();
    #[cfg(target_arch = "x86_64")]
    if takes_igemm(Some(level), dtype) {
        // SAFETY: the caller vouches for `level`; `linear` checked the shapes.
        return unsafe { igemm_many(x, m, &[w], &mut [out], level) };
    }
    let float = matches!(dtype, DType::F16 | DType::BF16);
    if (float && m >= PANEL_MIN_ROWS) || !rows(x, m, w, out, level) {
        let widen = |src: &[u8], dst: &mut [f32]| dequant::dequantize_row(dtype, src, dst, level);
        panel::by_panels(x, m, w, out, &widen, level == Level::Avx512Vnni)?;
    }
    Ok(())
}

/// `outs[i] = x · ws[i]ᵀ` for weights with the same row length (the caller has checked the
/// shapes): one quantization of `x` and one parallel loop when the integer GEMM takes them
/// all (one dtype), else one `linear` each. Either way each output equals its own `linear`.
pub(crate) fn linear_many(x: &[f32], m: usize, ws: &[&Tensor], outs: &mut [&mut [f32]]) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if let Some(first) = ws.first() {
        let one_dtype = ws.iter().all(|w| w.dtype() == first.dtype());
        if let Some(level) = kernel_mode().level().filter(|&l| one_dtype && takes_igemm(Some(l), first.dtype())) {
            // SAFETY: `kernel_mode` only picks available levels; the caller checked the shapes.
            return unsafe { igemm_many(x, m, ws, outs, level) };
        }
    }
    ws.iter().zip(outs.iter_mut()).try_for_each(|(w, out)| linear(x, m, w, out))
}

fn reference_dequant(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    crate::quant::dequantize_row(dtype, src, dst)
}

/// The row-kernel path at `level`, for any `m`; `false` when `w`'s dtype has no row kernel.
pub(crate) fn rows(x: &[f32], m: usize, w: &Tensor, out: &mut [f32], level: Level) -> bool {
    let (dtype, k, rb) = (w.dtype(), w.row_len(), w.row_bytes());
    let bytes = w.bytes();
    let row = |r: usize| &bytes[r * rb..(r + 1) * rb];
    if let DType::Mlx(f) = dtype {
        let acts = QuantizedActs::new(x, m, k, 32, level);
        let act_rows: Vec<ActRow<'_>> = (0..m).map(|i| acts.row(i)).collect();
        // SAFETY: as below; a weight row holds the `k / group` blocks of `f`.
        par_rows(w.rows(), m, out, |r, i| unsafe { mlx::dot(f, level, row(r), act_rows[i]) });
        return true;
    }
    let quantized =
        legacy::kernel(dtype, level).map(|f| (f, 32)).or_else(|| kquants::kernel(dtype, level).map(|f| (f, 256)));
    if let Some((kernel, block)) = quantized {
        let acts = QuantizedActs::new(x, m, k, block, level);
        let act_rows: Vec<ActRow<'_>> = (0..m).map(|i| acts.row(i)).collect();
        // SAFETY: `level` is available (the caller's contract); a weight row holds `k / block`
        // blocks of `dtype` and an activation row `k` codes, as the kernels require.
        par_rows(w.rows(), m, out, |r, i| unsafe { kernel(row(r), act_rows[i]) });
        return true;
    }
    if let Some(kernel) = float::kernel(dtype, level) {
        // SAFETY: as above; a 16-bit float row holds `k` values.
        par_rows(w.rows(), m, out, |r, i| unsafe { kernel(row(r), &x[i * k..(i + 1) * k]) });
        return true;
    }
    false
}

/// Fill `out[i * n + r] = f(r, i)` for `n` weight rows and `m` activation rows, splitting the
/// weight rows over the pool (each weight row is read once, for all `m` activation rows).
fn par_rows(n: usize, m: usize, out: &mut [f32], f: impl Fn(usize, usize) -> f32 + Sync) {
    let threads = rayon::current_num_threads().max(1);
    let chunk = n.div_ceil(4 * threads).max(4);
    if m == 1 {
        out.par_chunks_mut(chunk).enumerate().for_each(|(c, o)| {
            for (j, o) in o.iter_mut().enumerate() {
                *o = f(c * chunk + j, 0);
            }
        });
        return;
    }
    let mut transposed = vec![0f32; n * m];
    transposed.par_chunks_mut(chunk * m).enumerate().for_each(|(c, t)| {
        for (j, t) in t.chunks_exact_mut(m).enumerate() {
            for (i, t) in t.iter_mut().enumerate() {
                *t = f(c * chunk + j, i);
            }
        }
    });
    for (r, t) in transposed.chunks_exact(m).enumerate() {
        for (i, &v) in t.iter().enumerate() {
            out[i * n + r] = v;
        }
    }
}
