//! An AVX-512 f32 GEMM for the panel path: `C[m, cols] = X[m, k] · Pᵀ` where `P` is a panel of
//! dequantized weight rows.
//!
//! The panel is repacked per `KC`-deep slice into slivers of `NR = 32` weight rows laid out
//! `[k][32]`, so the micro-kernel loads two 16-lane registers of weights per `k` step and
//! multiplies them by `MR = 8` activation values broadcast from the rows of `X` (16
//! accumulators, 16 FMAs per 10 loads). Partial tiles (`m % 8`, panel widths that are not a
//! multiple of 32) use the same kernel with fewer rows and masked stores. The `gemm` crate's
//! AVX2 kernels serve the levels without AVX-512.

use std::arch::x86_64::*;

/// Weight rows per sliver (two 16-lane registers).
const NR: usize = 32;
/// Activation rows per micro-tile.
const MR: usize = 8;
/// Depth of one packed slice.
const KC: usize = 256;

/// `c[i * ldc + j] = Σ_kk x[i * k + kk] * panel[j * k + kk]` for `i < m`, `j < cols`.
/// `packed` is scratch.
///
/// # Safety
/// The CPU must have AVX-512 F; `x` holds `m * k` values, `panel` `cols * k`, and `c` reaches
/// `(m - 1) * ldc + cols` values.
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    x: &[f32],
    m: usize,
    k: usize,
    panel: &[f32],
    cols: usize,
    c: *mut f32,
    ldc: usize,
    packed: &mut Vec<f32>,
) {
    debug_assert!(x.len() >= m * k && panel.len() >= cols * k);
    let slivers = cols.div_ceil(NR);
    packed.resize(slivers * KC * NR, 0.0);
    let mut pc = 0;
    while pc < k {
        let kc = KC.min(k - pc);
        pack(panel, k, cols, pc, kc, packed);
        for s in 0..slivers {
            let nr = NR.min(cols - s * NR);
            let mask = if nr >= 32 { u32::MAX } else { (1u32 << nr) - 1 };
            let b = packed.as_ptr().add(s * KC * NR);
            let mut i = 0;
            while i < m {
                let mr = MR.min(m - i);
                let xs = x.as_ptr().add(i * k + pc);
                let cs = c.add(i * ldc + s * NR);
                match mr {
                    8 => tile::<8>(kc, xs, k, b, cs, ldc, mask, pc > 0),
                    7 => tile::<7>(kc, xs, k, b, cs, ldc, mask, pc > 0),
                    6 => tile::<6>(kc, xs, k, b, cs, ldc, mask, pc > 0),
                    5 => tile::<5>(kc, xs, k, b, cs, ldc, mask, pc > 0),
                    4 => tile::<4>(kc, xs, k, b, cs, ldc, mask, pc > 0),
                    3 => tile::<3>(kc, xs, k, b, cs, ldc, mask, pc > 0),
                    2 => tile::<2>(kc, xs, k, b, cs, ldc, mask, pc > 0),
                    _ => tile::<1>(kc, xs, k, b, cs, ldc, mask, pc > 0),
                }
                i += mr;
            }
        }
        pc += kc;
    }
}

/// Repack columns `pc..pc + kc` of the panel's rows into `[sliver][kk][32]`, zero-filling
/// rows past `cols`.
#[inline(always)]
fn pack(panel: &[f32], k: usize, cols: usize, pc: usize, kc: usize, packed: &mut [f32]) {
    for (s, dst) in packed.chunks_exact_mut(KC * NR).enumerate() {
        for r in 0..NR {
            let j = s * NR + r;
            if j < cols {
                let src = &panel[j * k + pc..j * k + pc + kc];
                for (kk, &v) in src.iter().enumerate() {
                    dst[kk * NR + r] = v;
                }
            } else {
                for kk in 0..kc {
                    dst[kk * NR + r] = 0.0;
                }
            }
        }
    }
}

/// One `R × 32` output tile over `kc` steps; adds to `c` when `accumulate`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const R: usize>(
    kc: usize,
    x: *const f32,
    ldx: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    mask: u32,
    accumulate: bool,
) {
    let (m0, m1) = ((mask & 0xFFFF) as u16, (mask >> 16) as u16);
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    if accumulate {
        for (i, a) in acc.iter_mut().enumerate() {
            a[0] = _mm512_maskz_loadu_ps(m0, c.add(i * ldc));
            a[1] = _mm512_maskz_loadu_ps(m1, c.add(i * ldc + 16));
        }
    }
    for kk in 0..kc {
        let b0 = _mm512_loadu_ps(b.add(kk * NR));
        let b1 = _mm512_loadu_ps(b.add(kk * NR + 16));
        for (i, a) in acc.iter_mut().enumerate() {
            let xv = _mm512_set1_ps(*x.add(i * ldx + kk));
            a[0] = _mm512_fmadd_ps(xv, b0, a[0]);
            a[1] = _mm512_fmadd_ps(xv, b1, a[1]);
        }
    }
    for (i, a) in acc.iter().enumerate() {
        _mm512_mask_storeu_ps(c.add(i * ldc), m0, a[0]);
        _mm512_mask_storeu_ps(c.add(i * ldc + 16), m1, a[1]);
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
        let mut packed = Vec::new();
        for (m, cols, k) in [(1, 1, 1), (5, 31, 255), (8, 32, 256), (17, 70, 600), (3, 33, 513)] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let panel: Vec<f32> = (0..cols * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let ldc = cols + 3;
            let mut c = vec![7.0f32; m * ldc];
            // SAFETY: AVX-512 F was detected; the buffers have the documented sizes.
            unsafe { super::gemm(&x, m, k, &panel, cols, c.as_mut_ptr(), ldc, &mut packed) };
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
