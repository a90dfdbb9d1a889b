//! Row dot products of the 256-value K-quant super-blocks (Q4_K, Q5_K, Q6_K) with 15-bit
//! activation blocks (one f32 scale per 256 values, integer sums per 32).
//!
//! A super-block's sub-block scales are small integers, so its dot product is integer
//! arithmetic converted to float once:
//! - Q4_K / Q5_K: `d * da * Σ_s sc_s · Σ c·a  -  dmin * da * Σ_s m_s · (Σ a over s)`;
//! - Q6_K:        `d * da * Σ_g sc_g · Σ (c - 32)·a`,
//!
//! with `c` the unsigned codes (`quant::k4_k5_codes`, `quant::q6_k_codes`). The SIMD kernels
//! widen the codes to i16, multiply them by their sub-block scale (`vpmullw`; |c·sc| ≤ 4096)
//! and dot them with the activations (`vpmaddwd` / `vpdpwssd`); each i32 lane then sums at
//! most 16 products of ≤ 4096 · 16383, safely inside 32 bits. The scalar kernels sum a whole
//! super-block in i64.

use super::acts::ActRow;
use super::isa::{by_level, Level};
use super::RowDot;
use crate::dtype::DType;
use crate::quant::{f16_le, k4_k5_codes, q6_k_codes, scale_min_k4};

const Q4K_BYTES: usize = 144;
const Q5K_BYTES: usize = 176;
const Q6K_BYTES: usize = 210;

/// Scalar Q4_K (`Q5 = false`) and Q5_K (`Q5 = true`).
pub(crate) fn dot_k4k5_scalar<const Q5: bool>(w: &[u8], a: ActRow<'_>) -> f32 {
    let bytes = if Q5 { Q5K_BYTES } else { Q4K_BYTES };
    let mut sum = 0f32;
    let blocks = w.chunks_exact(bytes).zip(a.qs.chunks_exact(256)).zip(a.scales).zip(a.sums.chunks_exact(8));
    for (((blk, qa), &da), sums) in blocks {
        let (d, dmin) = (f16_le(blk[0], blk[1]), f16_le(blk[2], blk[3]));
        let packed = &blk[4..16];
        let codes = if Q5 { k4_k5_codes(&blk[16..48], &blk[48..176]) } else { k4_k5_codes(&[0; 32], &blk[16..144]) };
        let (mut isum, mut msum) = (0i64, 0i64);
        for (s, ((c, q), &asum)) in codes.chunks_exact(32).zip(qa.chunks_exact(32)).zip(sums).enumerate() {
            let (sc, m) = scale_min_k4(s, packed);
            let dot: i64 = c.iter().zip(q).map(|(&c, &q)| i64::from(c) * i64::from(q)).sum();
            isum += i64::from(sc) * dot;
            msum += i64::from(m) * i64::from(asum);
        }
        sum += d * da * isum as f32 - dmin * da * msum as f32;
    }
    sum
}

/// Scalar Q6_K.
pub(crate) fn dot_q6k_scalar(w: &[u8], a: ActRow<'_>) -> f32 {
    let mut sum = 0f32;
    for ((blk, qa), &da) in w.chunks_exact(Q6K_BYTES).zip(a.qs.chunks_exact(256)).zip(a.scales) {
        let codes = q6_k_codes(&blk[..128], &blk[128..192]);
        let mut isum = 0i64;
        for ((c, q), &sc) in codes.chunks_exact(16).zip(qa.chunks_exact(16)).zip(&blk[192..208]) {
            let dot: i64 = c.iter().zip(q).map(|(&c, &q)| (i64::from(c) - 32) * i64::from(q)).sum();
            isum += i64::from(sc as i8) * dot;
        }
        sum += f16_le(blk[208], blk[209]) * da * isum as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
use x86::{dot_k4k5_simd, dot_q6k_simd};
#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{k4k5_high, k4k5_scales_mins, k4k5_values, q6k_d, q6k_values};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::isa::{f16x2, hsum_ps, load_i16x16, prefetch, read_u32, Simd, PREFETCH_AHEAD};
    use super::{ActRow, Q4K_BYTES, Q5K_BYTES, Q6K_BYTES};

    /// The eight 6-bit sub-block scales and mins of a Q4_K/Q5_K super-block (see
    /// `quant::scale_min_k4`), as 8 bytes each.
    #[inline(always)]
    pub(crate) unsafe fn k4k5_scales_mins(blk: *const u8) -> ([u8; 8], [u8; 8]) {
        let (w0, w1, w2) = (read_u32(blk.add(4)), read_u32(blk.add(8)), read_u32(blk.add(12)));
        let sc_hi = (w2 & 0x0F0F_0F0F) | (((w0 >> 6) & 0x0303_0303) << 4);
        let mn_hi = ((w2 >> 4) & 0x0F0F_0F0F) | (((w1 >> 6) & 0x0303_0303) << 4);
        let bytes = |lo: u32, hi: u32| (u64::from(lo) | (u64::from(hi) << 32)).to_le_bytes();
        (bytes(w0 & 0x3F3F_3F3F, sc_hi), bytes(w1 & 0x3F3F_3F3F, mn_hi))
    }

    /// The initial fifth-bit state of `k4k5_values`: Q5_K's 32 `qh` bytes as i16 lanes.
    #[inline(always)]
    pub(crate) unsafe fn k4k5_high<const Q5: bool>(blk: *const u8) -> [__m256i; 2] {
        if Q5 {
            [
                _mm256_cvtepu8_epi16(_mm_loadu_si128(blk.add(16) as *const __m128i)),
                _mm256_cvtepu8_epi16(_mm_loadu_si128(blk.add(32) as *const __m128i)),
            ]
        } else {
            [_mm256_setzero_si256(); 2]
        }
    }

    /// The codes of sub-blocks `2g` and `2g + 1` of a Q4_K/Q5_K super-block as i16 lanes:
    /// `[2g: 0..16, 2g: 16..32, 2g+1: 0..16, 2g+1: 16..32]`. Q5_K's fifth bit of sub-block `s`
    /// is bit `s` of each `qh` byte: `high` is consumed one bit per sub-block, so call with
    /// `g = 0, 1, 2, 3` in order.
    #[inline(always)]
    pub(crate) unsafe fn k4k5_values<const Q5: bool>(
        blk: *const u8,
        g: usize,
        high: &mut [__m256i; 2],
    ) -> [__m256i; 4] {
        let low4 = _mm256_set1_epi16(0x0F);
        let qs = blk.add(if Q5 { 48 } else { 16 } + 32 * g);
        let x0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(qs as *const __m128i));
        let x1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(qs.add(16) as *const __m128i));
        let mut v = [
            _mm256_and_si256(x0, low4),
            _mm256_and_si256(x1, low4),
            _mm256_srli_epi16(x0, 4),
            _mm256_srli_epi16(x1, 4),
        ];
        if Q5 {
            let one = _mm256_set1_epi16(1);
            for pair in v.chunks_exact_mut(2) {
                for (v, h) in pair.iter_mut().zip(high.iter()) {
                    *v = _mm256_or_si256(*v, _mm256_slli_epi16(_mm256_and_si256(*h, one), 4));
                }
                *high = high.map(|h| _mm256_srli_epi16(h, 1));
            }
        }
        v
    }

    /// The 128 values of half `h` of a Q6_K super-block as `code - 32` in i16 lanes: plane `p`
    /// holds values `128h + 32p..+16` and `+16..+32` (groups `8h + 2p` and `8h + 2p + 1`).
    #[inline(always)]
    pub(crate) unsafe fn q6k_values(blk: *const u8, h: usize) -> [[__m256i; 2]; 4] {
        let widen = |p: *const u8| _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
        let (low4, bits45, off) = (_mm256_set1_epi16(0x0F), _mm256_set1_epi16(0x30), _mm256_set1_epi16(32));
        let ql = blk.add(64 * h);
        let qh = blk.add(128 + 32 * h);
        let x = [widen(ql), widen(ql.add(16)), widen(ql.add(32)), widen(ql.add(48))];
        let hb = [widen(qh), widen(qh.add(16))];
        let code =
            |low: __m256i, high: __m256i| _mm256_sub_epi16(_mm256_or_si256(low, _mm256_and_si256(high, bits45)), off);
        let plane = |i: usize, low: &dyn Fn(__m256i) -> __m256i, high: &dyn Fn(__m256i) -> __m256i| {
            [code(low(x[i]), high(hb[0])), code(low(x[i + 1]), high(hb[1]))]
        };
        let lo_nib = |v: __m256i| _mm256_and_si256(v, low4);
        let hi_nib = |v: __m256i| _mm256_srli_epi16(v, 4);
        [
            plane(0, &lo_nib, &|h| _mm256_slli_epi16(h, 4)),
            plane(2, &lo_nib, &|h| _mm256_slli_epi16(h, 2)),
            plane(0, &hi_nib, &|h| h),
            plane(2, &hi_nib, &|h| _mm256_srli_epi16(h, 2)),
        ]
    }

    /// The f16 `d` of a Q6_K super-block.
    #[inline(always)]
    pub(crate) unsafe fn q6k_d(blk: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(std::ptr::read_unaligned(blk.add(208) as *const u16)))))
    }

    /// Q4_K / Q5_K. `w` holds at least `a.qs.len() / 256` super-blocks.
    #[inline(always)]
    pub(crate) unsafe fn dot_k4k5_simd<const Q5: bool, S: Simd>(w: &[u8], a: ActRow<'_>) -> f32 {
        let bytes = if Q5 { Q5K_BYTES } else { Q4K_BYTES };
        let nb = a.qs.len() / 256;
        debug_assert!(w.len() >= nb * bytes && a.scales.len() >= nb && a.sums.len() >= 8 * nb);
        let mut acc = _mm256_setzero_ps();
        let mut mins = 0f32;
        for b in 0..nb {
            let blk = w.as_ptr().add(b * bytes);
            prefetch(blk.wrapping_add(PREFETCH_AHEAD), bytes);
            let qa = a.qs.as_ptr().add(256 * b);
            let da = *a.scales.get_unchecked(b);
            let (d, dmin) = f16x2(blk);
            let (sc, mn) = k4k5_scales_mins(blk);
            // Σ_s m_s · (activation code sum of sub-block s).
            let sums = _mm256_loadu_si256(a.sums.as_ptr().add(8 * b) as *const __m256i);
            let m32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(mn.as_ptr() as *const __m128i));
            let msum = _mm256_mullo_epi32(m32, sums);
            let msum = _mm_add_epi32(_mm256_castsi256_si128(msum), _mm256_extracti128_si256::<1>(msum));
            mins += dmin * da * super::super::isa::hsum_epi32_128(msum) as f32;
            let mut high = k4k5_high::<Q5>(blk);
            let (mut i0, mut i1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for g in 0..4 {
                let v = k4k5_values::<Q5>(blk, g, &mut high);
                let (s0, s1) = (_mm256_set1_epi16(i16::from(sc[2 * g])), _mm256_set1_epi16(i16::from(sc[2 * g + 1])));
                let act = |i: usize| load_i16x16(qa.add(64 * g + 16 * i));
                i0 = S::dot_i16(i0, _mm256_mullo_epi16(v[0], s0), act(0));
                i0 = S::dot_i16(i0, _mm256_mullo_epi16(v[1], s0), act(1));
                i1 = S::dot_i16(i1, _mm256_mullo_epi16(v[2], s1), act(2));
                i1 = S::dot_i16(i1, _mm256_mullo_epi16(v[3], s1), act(3));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), _mm256_set1_ps(d * da), acc);
        }
        hsum_ps(acc) - mins
    }

    /// Q6_K. `w` holds at least `a.qs.len() / 256` super-blocks.
    #[inline(always)]
    pub(crate) unsafe fn dot_q6k_simd<S: Simd>(w: &[u8], a: ActRow<'_>) -> f32 {
        let nb = a.qs.len() / 256;
        debug_assert!(w.len() >= nb * Q6K_BYTES && a.scales.len() >= nb);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let blk = w.as_ptr().add(b * Q6K_BYTES);
            prefetch(blk.wrapping_add(PREFETCH_AHEAD), Q6K_BYTES);
            let qa = a.qs.as_ptr().add(256 * b);
            let scale = |g: usize| _mm256_set1_epi16(i16::from(*blk.add(192 + g) as i8));
            // Two accumulators, each summing at most 16 products per lane.
            let (mut i0, mut i1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for h in 0..2 {
                for (p, [lo, hi]) in q6k_values(blk, h).into_iter().enumerate() {
                    let (g, at) = (8 * h + 2 * p, qa.add(128 * h + 32 * p));
                    let i = if p % 2 == 0 { &mut i0 } else { &mut i1 };
                    *i = S::dot_i16(*i, _mm256_mullo_epi16(lo, scale(g)), load_i16x16(at));
                    *i = S::dot_i16(*i, _mm256_mullo_epi16(hi, scale(g + 1)), load_i16x16(at.add(16)));
                }
            }
            let ds = _mm256_set1_ps(q6k_d(blk) * *a.scales.get_unchecked(b));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), ds, acc);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), ds, acc);
        }
        hsum_ps(acc)
    }
}

#[cfg(target_arch = "x86_64")]
mod entries {
    use super::super::isa::simd_entry;
    use super::*;
    simd_entry!(q4_k, dot_k4k5_simd<false>, (w: &[u8], a: ActRow<'_>) -> f32);
    simd_entry!(q5_k, dot_k4k5_simd<true>, (w: &[u8], a: ActRow<'_>) -> f32);
    simd_entry!(q6_k, dot_q6k_simd, (w: &[u8], a: ActRow<'_>) -> f32);
}

/// The row kernel for `dtype` at `level`, if this module has one.
pub(crate) fn kernel(dtype: DType, level: Level) -> Option<RowDot> {
    Some(match dtype {
        DType::Q4K => by_level!(level, RowDot, dot_k4k5_scalar::<false>, entries::q4_k),
        DType::Q5K => by_level!(level, RowDot, dot_k4k5_scalar::<true>, entries::q5_k),
        DType::Q6K => by_level!(level, RowDot, dot_q6k_scalar, entries::q6_k),
        _ => return None,
    })
}
