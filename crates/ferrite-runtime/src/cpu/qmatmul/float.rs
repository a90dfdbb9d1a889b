//! f16 and bf16 weights: row dot products with f32 activations, and rows widened to f32 for
//! the panel path. Values are widened 8 at a time in registers (F16C `vcvtph2ps`, or a 16-bit
//! shift for bf16), so no f32 copy of the weights ever exists.

use super::isa::Level;
use crate::dtype::DType;

/// `Σ w[i] * x[i]` for a row of 16-bit floats `w` (little-endian bytes) and f32 `x`.
pub(crate) type FloatDot = unsafe fn(&[u8], &[f32]) -> f32;

fn widen<const BF16: bool>(b: &[u8]) -> f32 {
    if BF16 {
        half::bf16::from_le_bytes([b[0], b[1]]).to_f32()
    } else {
        half::f16::from_le_bytes([b[0], b[1]]).to_f32()
    }
}

/// Portable kernel: the same products, summed in eight interleaved f32 accumulators as the
/// SIMD kernel does.
pub(crate) fn dot_scalar<const BF16: bool>(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut wc = w.chunks_exact(16);
    let mut xc = x.chunks_exact(8);
    for (w8, x8) in (&mut wc).zip(&mut xc) {
        for (i, (a, &x)) in acc.iter_mut().zip(x8).enumerate() {
            *a += widen::<BF16>(&w8[2 * i..]) * x;
        }
    }
    let tail: f32 = wc.remainder().chunks_exact(2).zip(xc.remainder()).map(|(b, &x)| widen::<BF16>(b) * x).sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::isa::hsum_ps;

    /// Eight 16-bit floats at `p` widened to f32.
    #[inline(always)]
    unsafe fn load8<const BF16: bool>(p: *const u8) -> __m256 {
        let v = _mm_loadu_si128(p as *const __m128i);
        if BF16 {
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16))
        } else {
            _mm256_cvtph_ps(v)
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C; `w` holds `x.len()` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_avx2<const BF16: bool>(w: &[u8], x: &[f32]) -> f32 {
        let k = x.len();
        debug_assert!(w.len() >= 2 * k);
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= k {
            for (j, a) in acc.iter_mut().enumerate() {
                let o = i + 8 * j;
                *a = _mm256_fmadd_ps(load8::<BF16>(wp.add(2 * o)), _mm256_loadu_ps(xp.add(o)), *a);
            }
            i += 32;
        }
        while i + 8 <= k {
            acc[0] = _mm256_fmadd_ps(load8::<BF16>(wp.add(2 * i)), _mm256_loadu_ps(xp.add(i)), acc[0]);
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        hsum_ps(sum) + super::dot_scalar::<BF16>(&w[2 * i..2 * k], &x[i..])
    }

    /// # Safety
    /// AVX2 and F16C; `src` holds `dst.len()` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn widen_avx2<const BF16: bool>(src: &[u8], dst: &mut [f32]) {
        let n = dst.len();
        debug_assert!(src.len() >= 2 * n);
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), load8::<BF16>(src.as_ptr().add(2 * i)));
            i += 8;
        }
        for (d, b) in dst[i..].iter_mut().zip(src[2 * i..].chunks_exact(2)) {
            *d = super::widen::<BF16>(b);
        }
    }
}

/// The row kernel for a 16-bit float `dtype` at `level`.
pub(crate) fn kernel(dtype: DType, level: Level) -> Option<FloatDot> {
    let bf16 = match dtype {
        DType::BF16 => true,
        DType::F16 => false,
        _ => return None,
    };
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar {
        return Some(if bf16 { x86::dot_avx2::<true> } else { x86::dot_avx2::<false> });
    }
    let _ = level;
    Some(if bf16 { dot_scalar::<true> } else { dot_scalar::<false> })
}

/// Widen a row of a 16-bit float `dtype` into `dst` with SIMD; `false` when `dtype` is not one
/// or `level` is scalar (the caller then uses the reference dequantizer).
pub(crate) fn widen_row(dtype: DType, src: &[u8], dst: &mut [f32], level: Level) -> bool {
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar && src.len() >= 2 * dst.len() {
        // SAFETY: a non-scalar level implies AVX2/FMA/F16C; lengths checked above.
        match dtype {
            DType::BF16 => unsafe { x86::widen_avx2::<true>(src, dst) },
            DType::F16 => unsafe { x86::widen_avx2::<false>(src, dst) },
            _ => return false,
        }
        return true;
    }
    let _ = (dtype, src, dst, level);
    false
}
