//! An AVX-512 f32 GEMM for the panel path: `C[m, cols] = X[m, k] · Pᵀ` where `P` is a panel of
//! dequantized weight rows.
//!
//! `X` is packed once per product (`pack_rows`) into blocks of `MR = 12` rows laid out
//! `[k][12]`, and the panel per `KC`-deep slice into slivers of `NR = 32` weight rows laid out
//! `[k][32]` — dequantized straight into that layout, a row slice at a time, so a wide panel
//! needs no f32 copy. Per `k` step the micro-kernel then loads two 16-lane registers of weights and
//! broadcasts 12 consecutive activation values: 24 accumulators, 24 FMAs per 14 loads, no
//! address arithmetic. Partial tiles (`m % 12`, panel widths that are not a multiple of 32)
//! use the same kernel with fewer rows and masked stores. The `gemm` crate's AVX2 kernels serve
//! the levels without AVX-512.

use std::arch::x86_64::*;

use rayon::prelude::*;

use crate::error::Result;

/// Weight rows per sliver (two 16-lane registers).
const NR: usize = 32;
/// Activation rows per micro-tile.
pub(crate) const MR: usize = 12;
/// Depth of one packed slice.
const KC: usize = 256;

/// `x` (`[m, k]`, row-major) as blocks of `MR` rows laid out `[k][MR]`, zero-padded to whole
/// blocks: what `gemm` reads. Every element of `out` is written (it may be reused as is).
pub(crate) fn pack_rows(x: &[f32], m: usize, k: usize, out: &mut Vec<f32>) {
    out.resize(m.div_ceil(MR) * k * MR, 0.0);
    let pack = |(b, block): (usize, &mut [f32])| {
        for i in 0..MR {
            match x.chunks_exact(k).nth(b * MR + i) {
                Some(row) => row.iter().enumerate().for_each(|(kk, &v)| block[kk * MR + i] = v),
                None => (0..k).for_each(|kk| block[kk * MR + i] = 0.0),
            }
        }
    };
    if m * k >= 1 << 16 {
        out.par_chunks_exact_mut(k * MR).enumerate().for_each(pack);
    } else {
        out.chunks_exact_mut(k * MR).enumerate().for_each(pack);
    }
}

/// Reusable buffers of `gemm`.
#[derive(Default)]
pub(crate) struct Scratch {
    packed: Vec<f32>,
    row: Vec<f32>,
}

/// Writes columns `pc..pc + dst.len()` of panel row `j` into `dst`.
pub(crate) type PanelRows<'a> = &'a dyn Fn(usize, usize, &mut [f32]) -> Result<()>;

/// `c[i * ldc + j] = Σ_kk x[i][kk] * panel[j][kk]` for `i < m`, `j < cols`, with `xp` the
/// rows of `x` packed by `pack_rows` and the panel's rows produced slice by slice by `rows`
/// (so a quantized panel is dequantized straight into the packed layout).
///
/// # Safety
/// The CPU must have AVX-512 F; `xp` holds `m.div_ceil(MR) * k * MR` values and `c` reaches
/// `(m - 1) * ldc + cols` values.
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    xp: &[f32],
    m: usize,
    k: usize,
    cols: usize,
    rows: PanelRows<'_>,
    c: *mut f32,
    ldc: usize,
    scratch: &mut Scratch,
) -> Result<()> {
    debug_assert!(xp.len() >= m.div_ceil(MR) * k * MR);
    let slivers = cols.div_ceil(NR);
    scratch.packed.resize(slivers * KC * NR, 0.0);
    let mut pc = 0;
    while pc < k {
        let kc = KC.min(k - pc);
        pack(rows, cols, pc, kc, scratch)?;
        for s in 0..slivers {
            let nr = NR.min(cols - s * NR);
            let mask = if nr >= 32 { u32::MAX } else { (1u32 << nr) - 1 };
            let b = scratch.packed.as_ptr().add(s * KC * NR);
            for blk in 0..m.div_ceil(MR) {
                let i = blk * MR;
                let a = xp.as_ptr().add(blk * k * MR + pc * MR);
                let t = Tile { kc, a, b, c: c.add(i * ldc + s * NR), ldc, mask, accumulate: pc > 0 };
                match MR.min(m - i) {
                    12 => t.run::<12>(),
                    11 => t.run::<11>(),
                    10 => t.run::<10>(),
                    9 => t.run::<9>(),
                    8 => t.run::<8>(),
                    7 => t.run::<7>(),
                    6 => t.run::<6>(),
                    5 => t.run::<5>(),
                    4 => t.run::<4>(),
                    3 => t.run::<3>(),
                    2 => t.run::<2>(),
                    _ => t.run::<1>(),
                }
            }
        }
        pc += kc;
    }
    Ok(())
}

/// Fill `scratch.packed` with columns `pc..pc + kc` of the panel's rows as
/// `[sliver][kk][32]`, zero-filling rows past `cols`.
#[inline(always)]
fn pack(rows: PanelRows<'_>, cols: usize, pc: usize, kc: usize, scratch: &mut Scratch) -> Result<()> {
    scratch.row.resize(kc, 0.0);
    for (s, dst) in scratch.packed.chunks_exact_mut(KC * NR).enumerate() {
        for r in 0..NR {
            let j = s * NR + r;
            if j < cols {
                rows(j, pc, &mut scratch.row)?;
                for (kk, &v) in scratch.row.iter().enumerate() {
                    dst[kk * NR + r] = v;
                }
            } else {
                for kk in 0..kc {
                    dst[kk * NR + r] = 0.0;
                }
            }
        }
    }
    Ok(())
}

/// The `R` × 32 output tile at `c` (row stride `ldc`; `mask` marks its live columns) as
/// accumulators: its current values when `accumulate`, zeros otherwise.
#[inline(always)]
pub(crate) unsafe fn load_tile<const R: usize>(
    c: *mut f32,
    ldc: usize,
    mask: u32,
    accumulate: bool,
) -> [[__m512; 2]; R] {
    let (m0, m1) = ((mask & 0xFFFF) as u16, (mask >> 16) as u16);
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    if accumulate {
        for (i, a) in acc.iter_mut().enumerate() {
            let row = c.add(i * ldc);
            a[0] = _mm512_maskz_loadu_ps(m0, row);
            a[1] = _mm512_maskz_loadu_ps(m1, row.wrapping_add(16));
        }
    }
    acc
}

/// Store accumulators `acc` to the live columns of the output tile at `c` (see `load_tile`).
#[inline(always)]
pub(crate) unsafe fn store_tile<const R: usize>(acc: &[[__m512; 2]; R], c: *mut f32, ldc: usize, mask: u32) {
    let (m0, m1) = ((mask & 0xFFFF) as u16, (mask >> 16) as u16);
    for (i, a) in acc.iter().enumerate() {
        let row = c.add(i * ldc);
        _mm512_mask_storeu_ps(row, m0, a[0]);
        _mm512_mask_storeu_ps(row.wrapping_add(16), m1, a[1]);
    }
}

/// One micro-tile: `R ≤ MR` packed activation rows at `a` times one packed sliver at `b`, over
/// `kc` steps, into `c` (adding to it when `accumulate`; columns outside `mask` untouched).
struct Tile {
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    mask: u32,
    accumulate: bool,
}

impl Tile {
    #[inline(always)]
    unsafe fn run<const R: usize>(&self) {
        let mut acc = load_tile::<R>(self.c, self.ldc, self.mask, self.accumulate);
        let (mut ap, mut bp) = (self.a, self.b);
        for _ in 0..self.kc {
            let b0 = _mm512_loadu_ps(bp);
            let b1 = _mm512_loadu_ps(bp.add(16));
            for (i, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*ap.add(i));
                a[0] = _mm512_fmadd_ps(xv, b0, a[0]);
                a[1] = _mm512_fmadd_ps(xv, b1, a[1]);
            }
            ap = ap.add(MR);
            bp = bp.add(NR);
        }
        store_tile(&acc, self.c, self.ldc, self.mask);
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    /// Every tile shape: rows short of 8, columns short of 32 and spanning slivers, depths
    /// below, at and past one packed slice; the columns around the written ones stay intact.
    #[test]
    fn matches_f64_products() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::rng().random());
        let mut scratch = super::Scratch::default();
        for (m, cols, k) in [(1, 1, 1), (5, 31, 255), (12, 32, 256), (29, 70, 600), (3, 33, 513)] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let panel: Vec<f32> = (0..cols * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let ldc = cols + 3;
            let mut c = vec![7.0f32; m * ldc];
            let mut xp = Vec::new();
            super::pack_rows(&x, m, k, &mut xp);
            let rows = |j: usize, pc: usize, dst: &mut [f32]| {
                dst.copy_from_slice(&panel[j * k + pc..j * k + pc + dst.len()]);
                Ok(())
            };
            // SAFETY: AVX-512 F was detected; the buffers have the documented sizes.
            unsafe { super::gemm(&xp, m, k, cols, &rows, c.as_mut_ptr(), ldc, &mut scratch) }.unwrap();
            for i in 0..m {
                for j in 0..ldc {
                    let got = f64::from(c[i * ldc + j]);
                    let want = if j < cols {
                        (0..k).map(|kk| f64::from(x[i * k + kk]) * f64::from(panel[j * k + kk])).sum()
                    } else {
                        7.0
                    };
                    assert!((got - want).abs() < 1e-4, "m={m} cols={cols} k={k} ({i}, {j}): {got} vs {want}");
                }
            }
        }
    }
}
