//! Interleaved weights for `igemm`: every GGUF block format it multiplies (Q4_0, Q4_1, Q5_0,
//! Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) re-laid out once, so that the integer GEMM reads the codes of
//! 16 output columns already in its register order, for every number of activation rows.
//!
//! `igemm`'s micro-kernel keeps the output columns in the lanes of a register and multiplies
//! one broadcast pair of activation codes by the pairs `(v[2p], v[2p + 1])` of 16 weight rows
//! (`vpdpwssd`). Read from the GGUF layout, every weight row would have to be decoded and
//! transposed for that; here one 16- to 32-byte load and a few instructions give the register.
//!
//! Rows are packed in groups of 16, super-block by super-block (32 values for the legacy
//! formats, 256 for the K-quants). A packed super-block holds the 16 rows' headers side by
//! side, then per 32-value block 16 steps `p`, each with the codes `2p` and `2p + 1` of the 16
//! rows:
//!
//! ```text
//! legacy  d[16] f16, m[16] f16 (affine formats only)
//! Q4_K/5_K d[16] f16, dmin[16] f16, sc[8][16] u8, mn[8][16] u8   (6-bit scales unpacked)
//! Q6_K    d[16] f16, sc[16][16] i8                                (one scale per 16 values)
//! step    4-bit: one byte per row, code 2p in the low nibble       16 bytes
//!         5-bit: those bytes, then u16 masks of bit 4 of codes 2p, 2p + 1   20 bytes
//!         6-bit: those bytes and masks, then masks of bit 5         24 bytes
//!         8-bit: two signed bytes per row                           32 bytes
//! ```
//!
//! — the GGUF size, 2–3 % more for Q4_K/Q5_K. The codes are the blocks' own, so the
//! arithmetic is the GGUF one; rows past the weight's end are zero.

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::legacy::{Legacy, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use crate::dtype::DType;
use crate::quant::{k4_k5_codes, q6_k_codes, scale_min_k4};
use crate::tensor::Tensor;

/// Weight rows per group (lanes of one register).
pub(super) const GROUP: usize = 16;
/// Values per block (one scale).
const B: usize = 32;
/// Steps (code pairs) per block.
const STEPS: usize = B / 2;

/// A block format's packed encoding.
pub(super) trait Packing {
    /// Values per super-block and GGUF bytes of one.
    const SB: usize;
    const GGUF_BYTES: usize;
    /// Whether blocks have an offset term `wm` (`value = ws * v + wm`).
    const WITH_MIN: bool;
    /// Bytes of the headers of one packed super-block.
    const HEADER: usize;
    /// Bytes of one step.
    const STEP: usize;
    /// Bytes of one packed super-block of 16 rows.
    const PACKED: usize = Self::HEADER + Self::SB / B * STEPS * Self::STEP;
    /// What the steps of one block need (its codes, and Q6_K's scales).
    type Block: Copy;

    /// Write GGUF super-block `src` of row `j` into packed super-block `dst`.
    fn pack(src: &[u8], j: usize, dst: &mut [u8]);
    /// `(ws, wm)` of block `s` of the packed super-block at `sb`, for the 16 rows.
    unsafe fn scales(sb: *const u8, s: usize) -> (__m512, __m512);
    unsafe fn block(sb: *const u8, s: usize) -> Self::Block;
    /// The pairs `(v[2p], v[2p + 1])` of the 16 rows at step `p` of a block.
    unsafe fn pairs(block: Self::Block, p: usize) -> __m512i;
}

/// Bytes of one step of `bits`-wide codes (the layout in the module docs).
const fn step_bytes(bits: u32) -> usize {
    match bits {
        4 => 16,
        5 => 20,
        6 => 24,
        _ => 32,
    }
}

/// Place codes `2p, 2p + 1` of row `j` in each step of `steps` (`bits` wide codes).
fn put_codes(codes: &[u8], j: usize, bits: u32, steps: &mut [u8]) {
    for (pair, step) in codes.chunks_exact(2).zip(steps.chunks_exact_mut(step_bytes(bits))) {
        let (c0, c1) = (pair[0], pair[1]);
        if bits == 8 {
            step[2 * j] = c0;
            step[2 * j + 1] = c1;
            continue;
        }
        step[j] = (c0 & 15) | (c1 & 15) << 4;
        // Masks: bit 4 of c0, of c1, then bit 5 of c0, of c1; bit j of each u16.
        for (m, bit) in [(c0 >> 4) & 1, (c1 >> 4) & 1, (c0 >> 5) & 1, (c1 >> 5) & 1].into_iter().enumerate() {
            if 16 + 2 * m < step.len() {
                step[16 + 2 * m + j / 8] |= bit << (j % 8);
            }
        }
    }
}

/// 16 rows' f16s at `at` as f32.
#[inline(always)]
unsafe fn f16x16(at: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(at as *const __m256i))
}

/// The 4-bit step at `at` (bytes `lo | hi << 4`) as pairs: lane j = lo | hi << 16.
#[inline(always)]
unsafe fn nibble_pairs(at: *const u8) -> __m512i {
    let x = _mm512_cvtepu8_epi32(_mm_loadu_si128(at as *const __m128i));
    // (x | x << 12) & 0x000F_000F
    _mm512_ternarylogic_epi32::<0xA8>(x, _mm512_slli_epi32::<12>(x), _mm512_set1_epi32(0x000F_000F))
}

/// `v` with `bit` set in the lanes of the u16 mask at `at` (low code) and at `at + 2` (high).
#[inline(always)]
unsafe fn high_bit(v: __m512i, at: *const u8, bit: i32) -> __m512i {
    let (lo, hi) = (std::ptr::read_unaligned(at as *const u16), std::ptr::read_unaligned(at.add(2) as *const u16));
    let v = _mm512_mask_or_epi32(v, lo, v, _mm512_set1_epi32(bit));
    _mm512_mask_or_epi32(v, hi, v, _mm512_set1_epi32(bit << 16))
}

/// A legacy 32-value block format's packing: `BITS`-wide codes `v + OFFSET`.
pub(super) trait LegacyCodes: Legacy {
    const BITS: u32;
    const OFFSET: i16;
}

impl LegacyCodes for Q4_0 {
    const BITS: u32 = 4;
    const OFFSET: i16 = 8;
}
impl LegacyCodes for Q4_1 {
    const BITS: u32 = 4;
    const OFFSET: i16 = 0;
}
impl LegacyCodes for Q5_0 {
    const BITS: u32 = 5;
    const OFFSET: i16 = 16;
}
impl LegacyCodes for Q5_1 {
    const BITS: u32 = 5;
    const OFFSET: i16 = 0;
}
impl LegacyCodes for Q8_0 {
    const BITS: u32 = 8;
    const OFFSET: i16 = 0;
}

impl<F: LegacyCodes> Packing for F {
    const SB: usize = B;
    const GGUF_BYTES: usize = <F as Legacy>::BYTES;
    const WITH_MIN: bool = <F as Legacy>::AFFINE;
    const HEADER: usize = if Self::WITH_MIN { 64 } else { 32 };
    const STEP: usize = step_bytes(F::BITS);
    type Block = *const u8;

    fn pack(src: &[u8], j: usize, dst: &mut [u8]) {
        // `d` (and `m`) are the block's first f16s.
        dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
        if Self::WITH_MIN {
            dst[32 + 2 * j..32 + 2 * j + 2].copy_from_slice(&src[2..4]);
        }
        let codes = F::values(src).map(|v| (v + i32::from(F::OFFSET)) as u8);
        put_codes(&codes, j, F::BITS, &mut dst[Self::HEADER..]);
    }

    #[inline(always)]
    unsafe fn scales(sb: *const u8, _: usize) -> (__m512, __m512) {
        (f16x16(sb), if Self::WITH_MIN { f16x16(sb.add(32)) } else { _mm512_setzero_ps() })
    }

    #[inline(always)]
    unsafe fn block(sb: *const u8, _: usize) -> *const u8 {
        sb.add(Self::HEADER)
    }

    #[inline(always)]
    unsafe fn pairs(codes: *const u8, p: usize) -> __m512i {
        let at = codes.add(p * Self::STEP);
        if F::BITS == 8 {
            return _mm512_cvtepi8_epi16(_mm256_loadu_si256(at as *const __m256i));
        }
        let mut v = nibble_pairs(at);
        if F::BITS == 5 {
            v = high_bit(v, at.add(16), 0x10);
        }
        if F::OFFSET != 0 {
            v = _mm512_sub_epi16(v, _mm512_set1_epi16(F::OFFSET));
        }
        v
    }
}

/// Q4_K (`Q5 = false`) and Q5_K: `ws = d * sc`, `wm = -dmin * mn` per 32-value block.
pub(super) struct K4K5<const Q5: bool>;

impl<const Q5: bool> Packing for K4K5<Q5> {
    const SB: usize = 256;
    const GGUF_BYTES: usize = if Q5 { 176 } else { 144 };
    const WITH_MIN: bool = true;
    const HEADER: usize = 64 + 2 * 128;
    const STEP: usize = step_bytes(if Q5 { 5 } else { 4 });
    type Block = *const u8;

    fn pack(src: &[u8], j: usize, dst: &mut [u8]) {
        dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
        dst[32 + 2 * j..32 + 2 * j + 2].copy_from_slice(&src[2..4]);
        for s in 0..8 {
            let (sc, mn) = scale_min_k4(s, &src[4..16]);
            dst[64 + 16 * s + j] = sc;
            dst[192 + 16 * s + j] = mn;
        }
        let codes = if Q5 { k4_k5_codes(&src[16..48], &src[48..176]) } else { k4_k5_codes(&[0; 32], &src[16..144]) };
        put_codes(&codes, j, if Q5 { 5 } else { 4 }, &mut dst[Self::HEADER..]);
    }

    #[inline(always)]
    unsafe fn scales(sb: *const u8, s: usize) -> (__m512, __m512) {
        let byte = |at: usize| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(sb.add(at) as *const __m128i)));
        let neg_dmin = _mm512_sub_ps(_mm512_setzero_ps(), f16x16(sb.add(32)));
        (_mm512_mul_ps(f16x16(sb), byte(64 + 16 * s)), _mm512_mul_ps(neg_dmin, byte(192 + 16 * s)))
    }

    #[inline(always)]
    unsafe fn block(sb: *const u8, s: usize) -> *const u8 {
        sb.add(Self::HEADER + s * STEPS * Self::STEP)
    }

    #[inline(always)]
    unsafe fn pairs(codes: *const u8, p: usize) -> __m512i {
        let at = codes.add(p * Self::STEP);
        let v = nibble_pairs(at);
        if Q5 {
            high_bit(v, at.add(16), 0x10)
        } else {
            v
        }
    }
}

/// Q6_K: `v = (code - 32) * sc` with one scale per 16 values (|v| ≤ 4096), `ws = d`.
pub(super) struct Q6K;

impl Packing for Q6K {
    const SB: usize = 256;
    const GGUF_BYTES: usize = 210;
    const WITH_MIN: bool = false;
    const HEADER: usize = 32 + 256;
    const STEP: usize = step_bytes(6);
    /// The codes, and the scales (as i16 pairs) of steps 0..8 and 8..16.
    type Block = (*const u8, __m512i, __m512i);

    fn pack(src: &[u8], j: usize, dst: &mut [u8]) {
        dst[2 * j..2 * j + 2].copy_from_slice(&src[208..210]);
        for g in 0..16 {
            dst[32 + 16 * g + j] = src[192 + g];
        }
        put_codes(&q6_k_codes(&src[..128], &src[128..192]), j, 6, &mut dst[Self::HEADER..]);
    }

    #[inline(always)]
    unsafe fn scales(sb: *const u8, _: usize) -> (__m512, __m512) {
        (f16x16(sb), _mm512_setzero_ps())
    }

    #[inline(always)]
    unsafe fn block(sb: *const u8, s: usize) -> Self::Block {
        // Lane j = sc | sc << 16 for row j's scale of group g.
        let scale = |g: usize| {
            let x = _mm512_cvtepi8_epi32(_mm_loadu_si128(sb.add(32 + 16 * g) as *const __m128i));
            _mm512_ternarylogic_epi32::<0xEC>(x, _mm512_slli_epi32::<16>(x), _mm512_set1_epi32(0xFFFF))
        };
        (sb.add(Self::HEADER + s * STEPS * Self::STEP), scale(2 * s), scale(2 * s + 1))
    }

    #[inline(always)]
    unsafe fn pairs((codes, lo, hi): Self::Block, p: usize) -> __m512i {
        let at = codes.add(p * Self::STEP);
        let v = high_bit(high_bit(nibble_pairs(at), at.add(16), 0x10), at.add(20), 0x20);
        let v = _mm512_sub_epi16(v, _mm512_set1_epi16(32));
        _mm512_mullo_epi16(v, if p < STEPS / 2 { lo } else { hi })
    }
}

/// Whether `igemm` multiplies `dtype` (packed).
pub(super) fn packs(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::Q4K | DType::Q5K | DType::Q6K
    )
}

/// `w`'s packed copy (built on first use and kept with the tensor); `w.dtype()` is one that
/// `packs` accepts.
pub(super) fn packed(w: &Tensor) -> &[u8] {
    w.derived(|| match w.dtype() {
        DType::Q4_0 => pack::<Q4_0>(w),
        DType::Q4_1 => pack::<Q4_1>(w),
        DType::Q5_0 => pack::<Q5_0>(w),
        DType::Q5_1 => pack::<Q5_1>(w),
        DType::Q8_0 => pack::<Q8_0>(w),
        DType::Q4K => pack::<K4K5<false>>(w),
        DType::Q5K => pack::<K4K5<true>>(w),
        _ => pack::<Q6K>(w),
    })
}

/// Bytes of one packed group of 16 rows of `k` values.
pub(super) fn group_bytes<F: Packing>(k: usize) -> usize {
    k / F::SB * F::PACKED
}

fn pack<F: Packing>(w: &Tensor) -> Vec<u8> {
    let (n, k, rb) = (w.rows(), w.row_len(), w.row_bytes());
    let bytes = w.bytes();
    let mut out = vec![0u8; n.div_ceil(GROUP) * group_bytes::<F>(k)];
    out.par_chunks_mut(group_bytes::<F>(k)).enumerate().for_each(|(g, dst)| {
        for (j, row) in bytes.chunks_exact(rb).skip(g * GROUP).take(GROUP).enumerate() {
            for (src, dst) in row.chunks_exact(F::GGUF_BYTES).zip(dst.chunks_exact_mut(F::PACKED)) {
                F::pack(src, j, dst);
            }
        }
    });
    out
}
