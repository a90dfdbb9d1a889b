//! Row dot products of the 32-value weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with
//! 15-bit activation blocks.
//!
//! Every format is read as 32 small signed integers `v` per block — `code - offset` for the
//! symmetric formats (`value = v * d`), the code itself for the affine ones
//! (`value = v * d + m`). Per block `b` with activation codes `a`, scale `da` and
//! `s = da * Σa`, the dot product is `d * da * Σ v·a` (plus `m * s` for affine formats), with
//! `Σ v·a` exact in 32-bit integers (|v| ≤ 128, |a| ≤ 16383).
//!
//! The SIMD kernel widens the values to i16 and multiplies them with `vpmaddwd` (`vpdpwssd`
//! with VNNI), converting each block's sum to f32 once. Block headers are handled eight at a
//! time: one gather brings in eight `(d, m)` pairs, one multiply by the interleaved `(da, s)`
//! pairs yields the eight block scales (even lanes) and the eight `m * s` terms (odd lanes).

use super::acts::ActRow;
use super::isa::{by_level, Level};
use super::RowDot;
use crate::dtype::DType;
use crate::quant::{f16_le, unpack_nibbles};

/// One 32-value block format.
pub(crate) trait Legacy {
    const BYTES: usize;
    /// Whether the f16 after `d` is a min `m` (`value = v * d + m`).
    const AFFINE: bool;
    /// The 32 integer values of `block` (`BYTES` long).
    fn values(block: &[u8]) -> [i32; 32];
    /// The same values as i16 lanes: values `0..16` and `16..32`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn values_simd(block: *const u8) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i);
}

pub(crate) struct Q4_0;
pub(crate) struct Q4_1;
pub(crate) struct Q5_0;
pub(crate) struct Q5_1;
pub(crate) struct Q8_0;

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// 4- and 5-bit codes minus `offset`.
fn offset_codes(codes: [u8; 32], offset: i32) -> [i32; 32] {
    codes.map(|c| i32::from(c) - offset)
}

#[cfg(target_arch = "x86_64")]
mod simd_values {
    use std::arch::x86_64::*;

    use super::super::isa::{fifth_bits_i16, nibbles_i16, read_u32};

    /// 4-bit codes at `qs`, with the fifth bits of `qh` (if any), minus `offset`.
    #[inline(always)]
    pub(super) unsafe fn codes(qs: *const u8, qh: Option<*const u8>, offset: i16) -> (__m256i, __m256i) {
        let (mut lo, mut hi) = nibbles_i16(qs);
        if let Some(qh) = qh {
            let bits = read_u32(qh);
            lo = _mm256_or_si256(lo, fifth_bits_i16(bits as u16));
            hi = _mm256_or_si256(hi, fifth_bits_i16((bits >> 16) as u16));
        }
        if offset != 0 {
            let off = _mm256_set1_epi16(offset);
            (lo, hi) = (_mm256_sub_epi16(lo, off), _mm256_sub_epi16(hi, off));
        }
        (lo, hi)
    }

    /// 32 signed bytes as two i16 vectors.
    #[inline(always)]
    pub(super) unsafe fn signed_bytes(p: *const u8) -> (__m256i, __m256i) {
        let lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(p as *const __m128i));
        let hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(16) as *const __m128i));
        (lo, hi)
    }
}

impl Legacy for Q4_0 {
    const BYTES: usize = 18;
    const AFFINE: bool = false;
    fn values(b: &[u8]) -> [i32; 32] {
        offset_codes(unpack_nibbles(&b[2..18], 0), 8)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn values_simd(b: *const u8) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i) {
        simd_values::codes(b.add(2), None, 8)
    }
}

impl Legacy for Q4_1 {
    const BYTES: usize = 20;
    const AFFINE: bool = true;
    fn values(b: &[u8]) -> [i32; 32] {
        offset_codes(unpack_nibbles(&b[4..20], 0), 0)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn values_simd(b: *const u8) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i) {
        simd_values::codes(b.add(4), None, 0)
    }
}

impl Legacy for Q5_0 {
    const BYTES: usize = 22;
    const AFFINE: bool = false;
    fn values(b: &[u8]) -> [i32; 32] {
        offset_codes(unpack_nibbles(&b[6..22], le32(&b[2..6])), 16)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn values_simd(b: *const u8) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i) {
        simd_values::codes(b.add(6), Some(b.add(2)), 16)
    }
}

impl Legacy for Q5_1 {
    const BYTES: usize = 24;
    const AFFINE: bool = true;
    fn values(b: &[u8]) -> [i32; 32] {
        offset_codes(unpack_nibbles(&b[8..24], le32(&b[4..8])), 0)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn values_simd(b: *const u8) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i) {
        simd_values::codes(b.add(8), Some(b.add(4)), 0)
    }
}

impl Legacy for Q8_0 {
    const BYTES: usize = 34;
    const AFFINE: bool = false;
    fn values(b: &[u8]) -> [i32; 32] {
        let mut v = [0i32; 32];
        for (v, &q) in v.iter_mut().zip(&b[2..34]) {
            *v = i32::from(q as i8);
        }
        v
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn values_simd(b: *const u8) -> (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i) {
        simd_values::signed_bytes(b.add(2))
    }
}

/// The scalar kernel: per block the exact integer dot, then the scales.
pub(crate) fn dot_scalar<F: Legacy>(w: &[u8], a: ActRow<'_>) -> f32 {
    let mut sum = 0f32;
    for ((blk, qa), sc) in w.chunks_exact(F::BYTES).zip(a.qs.chunks_exact(32)).zip(a.scales.chunks_exact(2)) {
        let isum: i32 = F::values(blk).iter().zip(qa).map(|(&v, &q)| v * i32::from(q)).sum();
        sum += f16_le(blk[0], blk[1]) * sc[0] * isum as f32;
        if F::AFFINE {
            sum += f16_le(blk[2], blk[3]) * sc[1];
        }
    }
    sum
}

#[cfg(target_arch = "x86_64")]
use x86::dot_simd;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::isa::{hsum_ps, load_i16x16, prefetch, Simd, PREFETCH_AHEAD};
    use super::{ActRow, Legacy};

    /// `Σ v·a` of one block as 8 f32 lanes (exact integers).
    #[inline(always)]
    unsafe fn block_dot<F: Legacy, S: Simd>(blk: *const u8, qa: *const i16) -> __m256 {
        let (lo, hi) = F::values_simd(blk);
        let dot = S::dot_i16(_mm256_setzero_si256(), lo, load_i16x16(qa));
        _mm256_cvtepi32_ps(S::dot_i16(dot, hi, load_i16x16(qa.add(16))))
    }

    /// The SIMD kernel (see the module docs). `w` holds at least `a.qs.len() / 32` blocks.
    #[inline(always)]
    pub(crate) unsafe fn dot_simd<F: Legacy, S: Simd>(w: &[u8], a: ActRow<'_>) -> f32 {
        let nb = a.qs.len() / 32;
        debug_assert!(w.len() >= nb * F::BYTES && a.scales.len() >= 2 * nb);
        let (wp, qp, sp) = (w.as_ptr(), a.qs.as_ptr(), a.scales.as_ptr());
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let offsets = _mm256_mullo_epi32(lane, _mm256_set1_epi32(F::BYTES as i32));
        let (mut acc0, mut acc1, mut mins) = (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
        let mut scale = [0f32; 16];
        let mut b = 0;
        while b < nb {
            let cnt = (nb - b).min(8);
            let blk0 = wp.add(b * F::BYTES);
            prefetch(blk0.wrapping_add(PREFETCH_AHEAD), 8 * F::BYTES);
            // Eight headers: `d` in the low half, `m` (affine formats) in the high half.
            let live = _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt as i32), lane);
            let hdr = _mm256_mask_i32gather_epi32::<1>(_mm256_setzero_si256(), blk0 as *const i32, offsets, live);
            // Times the (da, s) pairs: even lanes the block scales, odd lanes the m·s terms.
            let two = _mm256_set1_epi32(2 * cnt as i32);
            let pairs = sp.add(2 * b);
            let lo = _mm256_maskload_ps(pairs, _mm256_cmpgt_epi32(two, lane));
            let hi = _mm256_maskload_ps(
                pairs.wrapping_add(8),
                _mm256_cmpgt_epi32(two, _mm256_add_epi32(lane, _mm256_set1_epi32(8))),
            );
            let p_lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(hdr)), lo);
            let p_hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256::<1>(hdr)), hi);
            if F::AFFINE {
                mins = _mm256_add_ps(mins, _mm256_add_ps(p_lo, p_hi));
            }
            _mm256_storeu_ps(scale.as_mut_ptr(), p_lo);
            _mm256_storeu_ps(scale.as_mut_ptr().add(8), p_hi);
            let blk = |i: usize| blk0.add(i * F::BYTES);
            let qa = |i: usize| qp.add((b + i) * 32);
            // Broadcast from memory: a load, not a shuffle.
            let sc = |i: usize| _mm256_broadcast_ss(&*scale.as_ptr().add(2 * i));
            if cnt == 8 {
                for i in (0..8).step_by(2) {
                    acc0 = _mm256_fmadd_ps(block_dot::<F, S>(blk(i), qa(i)), sc(i), acc0);
                    acc1 = _mm256_fmadd_ps(block_dot::<F, S>(blk(i + 1), qa(i + 1)), sc(i + 1), acc1);
                }
            } else {
                for i in 0..cnt {
                    acc0 = _mm256_fmadd_ps(block_dot::<F, S>(blk(i), qa(i)), sc(i), acc0);
                }
            }
            b += cnt;
        }
        let mut m = [0f32; 8];
        _mm256_storeu_ps(m.as_mut_ptr(), mins);
        hsum_ps(_mm256_add_ps(acc0, acc1)) + (m[1] + m[3] + m[5] + m[7])
    }
}

#[cfg(target_arch = "x86_64")]
mod entries {
    use super::super::isa::simd_entry;
    use super::*;
    simd_entry!(q4_0, dot_simd<Q4_0>, (w: &[u8], a: ActRow<'_>) -> f32);
    simd_entry!(q4_1, dot_simd<Q4_1>, (w: &[u8], a: ActRow<'_>) -> f32);
    simd_entry!(q5_0, dot_simd<Q5_0>, (w: &[u8], a: ActRow<'_>) -> f32);
    simd_entry!(q5_1, dot_simd<Q5_1>, (w: &[u8], a: ActRow<'_>) -> f32);
    simd_entry!(q8_0, dot_simd<Q8_0>, (w: &[u8], a: ActRow<'_>) -> f32);
}

/// The row kernel for `dtype` at `level`, if this module has one.
pub(crate) fn kernel(dtype: DType, level: Level) -> Option<RowDot> {
    Some(match dtype {
        DType::Q4_0 => by_level!(level, RowDot, dot_scalar::<Q4_0>, entries::q4_0),
        DType::Q4_1 => by_level!(level, RowDot, dot_scalar::<Q4_1>, entries::q4_1),
        DType::Q5_0 => by_level!(level, RowDot, dot_scalar::<Q5_0>, entries::q5_0),
        DType::Q5_1 => by_level!(level, RowDot, dot_scalar::<Q5_1>, entries::q5_1),
        DType::Q8_0 => by_level!(level, RowDot, dot_scalar::<Q8_0>, entries::q8_0),
        _ => return None,
    })
}
