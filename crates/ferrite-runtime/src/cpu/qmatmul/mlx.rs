//! Row dot products of MLX affine blocks (`quant::mlx`) with 15-bit activation blocks of 32.
//!
//! A group of `G` values (32, 64 or 128) is `G / 32` activation blocks under one scale and
//! bias. Per activation block `b` of the group, with codes `a`, scale `da` and `s = da * Σa`,
//! the dot product adds `(scale * da) * Σ code·a` and `bias * s`: the codes are the unsigned
//! MLX codes themselves (0..16 or 0..256), `Σ code·a` exact in 32-bit integers
//! (32 · 255 · 16383 < 2³¹). This is the legacy affine formats' arithmetic (`legacy`) with
//! MLX's code order and group headers.
//!
//! These kernels serve the scalar level (from AVX2 on, the integer GEMMs read the packed copy
//! of bf16- and f16-scaled formats) and formats with f32 scales at every level.

use super::acts::ActRow;
use super::isa::Level;
use crate::dtype::MlxFormat;
use crate::quant::mlx::{code, scale_bias};

/// `w` (one row of blocks of `f`) dotted with the activation row `a`, at `level` (which the
/// CPU must have).
///
/// # Safety
/// `level` is available on this CPU; `w` holds the blocks of `a.qs.len()` values.
pub(crate) unsafe fn dot(f: MlxFormat, level: Level, w: &[u8], a: ActRow<'_>) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        use super::isa::Level::*;
        match (level, f.bits()) {
            (Avx2, 4) => return entries::four::avx2(f, w, a),
            (Avx2, _) => return entries::eight::avx2(f, w, a),
            (AvxVnni, 4) => return entries::four::avxvnni(f, w, a),
            (AvxVnni, _) => return entries::eight::avxvnni(f, w, a),
            (Avx512Vnni, 4) => return entries::four::avx512vnni(f, w, a),
            (Avx512Vnni, _) => return entries::eight::avx512vnni(f, w, a),
            (Scalar, _) => {}
        }
    }
    let _ = level;
    dot_scalar(f, w, a)
}

/// The scalar kernel: per activation block the exact integer dot, then the scales.
pub(crate) fn dot_scalar(f: MlxFormat, w: &[u8], a: ActRow<'_>) -> f32 {
    let (h, sub) = (f.header_bytes(), f.group() / 32);
    let mut sum = 0f32;
    let blocks = w.chunks_exact(h + f.code_bytes());
    for (g, (block, qa)) in blocks.zip(a.qs.chunks_exact(f.group())).enumerate() {
        let (scale, bias) = scale_bias(f, block);
        for (j, qa) in qa.chunks_exact(32).enumerate() {
            let b = g * sub + j;
            let isum: i32 = qa
                .iter()
                .enumerate()
                .map(|(i, &q)| i32::from(code(f.bits(), &block[h..], 32 * j + i)) * i32::from(q))
                .sum();
            sum += scale * a.scales[2 * b] * isum as f32;
            sum += bias * a.scales[2 * b + 1];
        }
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::isa::{hsum_ps, load_i16x16, prefetch, Simd, PREFETCH_AHEAD};
    use super::{scale_bias, ActRow, MlxFormat};

    /// A code width: how the 32 codes of one activation block widen to i16 lanes, in order.
    pub(crate) trait Codes {
        /// Bytes of 32 codes.
        const BYTES: usize;
        /// Codes `0..16` and `16..32` at `p`.
        unsafe fn load(p: *const u8) -> (__m256i, __m256i);
    }

    pub(crate) struct Four;
    pub(crate) struct Eight;

    impl Codes for Four {
        const BYTES: usize = 16;
        #[inline(always)]
        unsafe fn load(p: *const u8) -> (__m256i, __m256i) {
            // Byte i holds codes 2i (low nibble) and 2i + 1: split the nibbles and interleave
            // them back into value order.
            let x = _mm_loadu_si128(p as *const __m128i);
            let mask = _mm_set1_epi8(0x0F);
            let (lo, hi) = (_mm_and_si128(x, mask), _mm_and_si128(_mm_srli_epi16(x, 4), mask));
            (_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(lo, hi)), _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(lo, hi)))
        }
    }

    impl Codes for Eight {
        const BYTES: usize = 32;
        #[inline(always)]
        unsafe fn load(p: *const u8) -> (__m256i, __m256i) {
            let lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
            (lo, _mm256_cvtepu8_epi16(_mm_loadu_si128(p.add(16) as *const __m128i)))
        }
    }

    /// The SIMD kernel: per activation block the integer dot in 8 lanes, converted once and
    /// scaled into the f32 lanes; the bias terms summed on the side.
    #[inline(always)]
    pub(crate) unsafe fn dot_simd<C: Codes, S: Simd>(f: MlxFormat, w: &[u8], a: ActRow<'_>) -> f32 {
        let (h, block, sub) = (f.header_bytes(), f.header_bytes() + f.code_bytes(), f.group() / 32);
        let groups = a.qs.len() / f.group();
        debug_assert!(w.len() >= groups * block && a.scales.len() >= 2 * groups * sub);
        let (mut acc, mut bias_sum) = (_mm256_setzero_ps(), 0f32);
        for g in 0..groups {
            let blk = &w[g * block..(g + 1) * block];
            prefetch(blk.as_ptr().wrapping_add(PREFETCH_AHEAD), block);
            let (scale, bias) = scale_bias(f, blk);
            for j in 0..sub {
                let b = g * sub + j;
                let (lo, hi) = C::load(blk.as_ptr().add(h + j * C::BYTES));
                let qa = a.qs.as_ptr().add(32 * b);
                let dot =
                    S::dot_i16(S::dot_i16(_mm256_setzero_si256(), lo, load_i16x16(qa)), hi, load_i16x16(qa.add(16)));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale * a.scales[2 * b]), acc);
                bias_sum += bias * a.scales[2 * b + 1];
            }
        }
        hsum_ps(acc) + bias_sum
    }
}

#[cfg(target_arch = "x86_64")]
mod entries {
    use super::super::isa::simd_entry;
    use super::x86::{dot_simd, Eight, Four};
    use super::{ActRow, MlxFormat};
    simd_entry!(four, dot_simd<Four>, (f: MlxFormat, w: &[u8], a: ActRow<'_>) -> f32);
    simd_entry!(eight, dot_simd<Eight>, (f: MlxFormat, w: &[u8], a: ActRow<'_>) -> f32);
}
