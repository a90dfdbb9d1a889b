//! SIMD dequantization of weight rows for the panel path, bit-identical to the reference
//! `quant::dequantize_row`.
//!
//! The values come from the same register helpers as the row kernels; each is then the
//! reference's own arithmetic in one rounding: products of a code and a scale are exact in f32
//! (see `quant`), so `fma(code, d, m)` equals the reference's `code * d + m`, and Q6_K's
//! `(d * scale) * (code - 32)` is the very same multiply.

use super::float;
use super::isa::Level;
use crate::dtype::DType;
use crate::error::Result;

/// Dequantize `dst.len()` values of `dtype` from `src` (whole blocks), with SIMD where `level`
/// and `dtype` allow, else with the reference.
pub(crate) fn dequantize_row(dtype: DType, src: &[u8], dst: &mut [f32], level: Level) -> Result<()> {
    if level != Level::Scalar && src.len() >= dtype.row_bytes(dst.len())? {
        if float::widen_row(dtype, src, dst, level) {
            return Ok(());
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: every non-scalar level has AVX2/FMA/F16C; `src` holds the blocks of `dst`.
        if unsafe { x86::dequantize(dtype, src, dst) } {
            return Ok(());
        }
    }
    crate::quant::dequantize_row(dtype, src, dst)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::isa::f16x2;
    use super::super::kquants::{k4k5_high, k4k5_scales_mins, k4k5_values, q6k_d, q6k_values};
    use super::super::legacy::{Legacy, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
    use crate::dtype::DType;

    /// `false` when `dtype` has no SIMD dequantizer here.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `src` holds the whole blocks of `dst.len()` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) -> bool {
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let n = dst.len();
        match dtype {
            DType::Q4_0 => legacy::<Q4_0>(s, d, n),
            DType::Q4_1 => legacy::<Q4_1>(s, d, n),
            DType::Q5_0 => legacy::<Q5_0>(s, d, n),
            DType::Q5_1 => legacy::<Q5_1>(s, d, n),
            DType::Q8_0 => legacy::<Q8_0>(s, d, n),
            DType::Q4K => k4k5::<false>(s, d, n),
            DType::Q5K => k4k5::<true>(s, d, n),
            DType::Q6K => q6k(s, d, n),
            _ => return false,
        }
        true
    }

    /// Store 16 i16 values at `dst` as `f(value as f32)`.
    #[inline(always)]
    unsafe fn store16(v: __m256i, dst: *mut f32, f: impl Fn(__m256) -> __m256) {
        let lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(v));
        let hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(v));
        _mm256_storeu_ps(dst, f(_mm256_cvtepi32_ps(lo)));
        _mm256_storeu_ps(dst.add(8), f(_mm256_cvtepi32_ps(hi)));
    }

    #[inline(always)]
    unsafe fn legacy<F: Legacy>(src: *const u8, dst: *mut f32, n: usize) {
        for b in 0..n / 32 {
            let blk = src.add(b * F::BYTES);
            let out = dst.add(32 * b);
            let (d, m) = f16x2(blk);
            let (vd, vm) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
            let (lo, hi) = F::values_simd(blk);
            for (i, v) in [lo, hi].into_iter().enumerate() {
                if F::AFFINE {
                    store16(v, out.add(16 * i), |c| _mm256_fmadd_ps(c, vd, vm));
                } else {
                    store16(v, out.add(16 * i), |c| _mm256_mul_ps(c, vd));
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn k4k5<const Q5: bool>(src: *const u8, dst: *mut f32, n: usize) {
        let bytes = if Q5 { 176 } else { 144 };
        for b in 0..n / 256 {
            let blk = src.add(b * bytes);
            let (d, dmin) = f16x2(blk);
            let (sc, mn) = k4k5_scales_mins(blk);
            let mut high = k4k5_high::<Q5>(blk);
            for g in 0..4 {
                let v = k4k5_values::<Q5>(blk, g, &mut high);
                for (i, v) in v.into_iter().enumerate() {
                    let s = 2 * g + i / 2;
                    let dl = _mm256_set1_ps(d * f32::from(sc[s]));
                    let ml = _mm256_set1_ps(dmin * f32::from(mn[s]));
                    store16(v, dst.add(256 * b + 32 * s + 16 * (i % 2)), |c| _mm256_fmsub_ps(dl, c, ml));
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn q6k(src: *const u8, dst: *mut f32, n: usize) {
        for b in 0..n / 256 {
            let blk = src.add(b * 210);
            let d = q6k_d(blk);
            for h in 0..2 {
                for (p, halves) in q6k_values(blk, h).into_iter().enumerate() {
                    for (i, v) in halves.into_iter().enumerate() {
                        let g = 8 * h + 2 * p + i;
                        let dl = _mm256_set1_ps(d * f32::from(*blk.add(192 + g) as i8));
                        store16(v, dst.add(256 * b + 16 * g), |c| _mm256_mul_ps(dl, c));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Bit-for-bit the reference, for random bytes (any code, any finite or infinite scale).
    #[test]
    fn simd_dequantization_is_bit_exact() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::rng().random());
        let dtypes =
            [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q4K, DType::Q5K, DType::Q6K];
        for dtype in dtypes {
            let n = 3 * dtype.block_elems();
            let src: Vec<u8> = (0..dtype.row_bytes(n).unwrap()).map(|_| rng.random()).collect();
            let mut want = vec![0f32; n];
            crate::quant::dequantize_row(dtype, &src, &mut want).unwrap();
            for level in Level::ALL.into_iter().filter(|l| l.available()) {
                let mut got = vec![f32::NAN; n];
                dequantize_row(dtype, &src, &mut got, level).unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "{dtype} {level:?} value {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
