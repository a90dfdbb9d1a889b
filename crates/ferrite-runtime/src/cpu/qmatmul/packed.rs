//! Interleaved weights for `igemm`: the 32-value block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
//! re-laid out once so that the integer GEMM reads each 16 output columns' codes already in
//! its register order, for every number of activation rows.
//!
//! `igemm`'s micro-kernel keeps the output columns in the lanes of a register and multiplies
//! one broadcast pair of activation codes by the pairs `(v[2p], v[2p + 1])` of 16 weight rows
//! (`vpdpwssd`). Read from the GGUF layout, every weight row has to be decoded and transposed
//! for that; in the packed layout one 16- to 32-byte load and two or three instructions give
//! the register. Per group of 16 weight rows and block of 32 columns of `k` it holds
//!
//! ```text
//! d[16]: f16, m[16]: f16 (affine formats),
//! 16 steps p of: the codes 2p and 2p + 1 of each of the 16 rows
//!   4-bit: one byte per row, code 2p in the low nibble       (16 bytes)
//!   5-bit: the 4-bit bytes, then two u16 masks of fifth bits (20 bytes)
//!   8-bit: two signed bytes per row                          (32 bytes)
//! ```
//!
//! exactly as many bytes as the 16 rows' GGUF blocks; rows past the weight's end are zero.
//! The codes are the blocks' own (`v + offset`), so the arithmetic is the GGUF one.

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::legacy::{Legacy, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use crate::dtype::DType;
use crate::tensor::Tensor;

/// Weight rows per group (lanes of one register).
pub(super) const GROUP: usize = 16;
/// Values per block.
const B: usize = 32;

/// A block format's packed encoding.
pub(super) trait Packing: Legacy {
    /// Bits per code: 4, 5 or 8.
    const BITS: u32;
    /// `v = code - OFFSET`.
    const OFFSET: i16;
    /// Bytes of one step (two codes of 16 rows).
    const STEP: usize = match Self::BITS {
        4 => 16,
        5 => 20,
        _ => 32,
    };
    /// Bytes of the headers of one packed block.
    const HEADER: usize = if Self::AFFINE { 64 } else { 32 };
    /// Bytes of one packed block (16 rows × 32 values).
    const PACKED: usize = Self::HEADER + 16 * Self::STEP;

    /// The pairs `(v[2p], v[2p + 1])` of the 16 rows at step `p` of a packed block's codes.
    #[inline(always)]
    unsafe fn pairs(codes: *const u8, p: usize) -> __m512i {
        let at = codes.add(p * Self::STEP);
        if Self::BITS == 8 {
            return _mm512_cvtepi8_epi16(_mm256_loadu_si256(at as *const __m256i));
        }
        // Byte j = lo | hi << 4 → lane j = lo | hi << 16: (x | x << 12) & 0x000F_000F.
        let x = _mm512_cvtepu8_epi32(_mm_loadu_si128(at as *const __m128i));
        let mut v = _mm512_ternarylogic_epi32::<0xA8>(x, _mm512_slli_epi32::<12>(x), _mm512_set1_epi32(0x000F_000F));
        if Self::BITS == 5 {
            let (lo, hi) = (
                std::ptr::read_unaligned(at.add(16) as *const u16),
                std::ptr::read_unaligned(at.add(18) as *const u16),
            );
            v = _mm512_mask_or_epi32(v, lo, v, _mm512_set1_epi32(0x10));
            v = _mm512_mask_or_epi32(v, hi, v, _mm512_set1_epi32(0x0010_0000));
        }
        if Self::OFFSET != 0 {
            v = _mm512_sub_epi16(v, _mm512_set1_epi16(Self::OFFSET));
        }
        v
    }
}

impl Packing for Q4_0 {
    const BITS: u32 = 4;
    const OFFSET: i16 = 8;
}
impl Packing for Q4_1 {
    const BITS: u32 = 4;
    const OFFSET: i16 = 0;
}
impl Packing for Q5_0 {
    const BITS: u32 = 5;
    const OFFSET: i16 = 16;
}
impl Packing for Q5_1 {
    const BITS: u32 = 5;
    const OFFSET: i16 = 0;
}
impl Packing for Q8_0 {
    const BITS: u32 = 8;
    const OFFSET: i16 = 0;
}

/// Whether `dtype`'s weights are packed for `igemm`.
pub(super) fn packs(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0)
}

/// `w`'s packed copy (built on first use and kept with the tensor); `w.dtype()` is one that
/// `packs` accepts.
pub(super) fn packed(w: &Tensor) -> &[u8] {
    w.derived(|| match w.dtype() {
        DType::Q4_0 => pack::<Q4_0>(w),
        DType::Q4_1 => pack::<Q4_1>(w),
        DType::Q5_0 => pack::<Q5_0>(w),
        DType::Q5_1 => pack::<Q5_1>(w),
        _ => pack::<Q8_0>(w),
    })
}

/// Bytes of one packed group of 16 rows of `k` values.
pub(super) fn group_bytes(dtype: DType, k: usize) -> usize {
    k / B * dtype.block_bytes() * GROUP
}

fn pack<F: Packing>(w: &Tensor) -> Vec<u8> {
    let (n, k, rb) = (w.rows(), w.row_len(), w.row_bytes());
    let (bytes, nb) = (w.bytes(), k / B);
    let mut out = vec![0u8; n.div_ceil(GROUP) * nb * F::PACKED];
    out.par_chunks_mut(nb * F::PACKED).enumerate().for_each(|(g, dst)| {
        for (j, row) in bytes.chunks_exact(rb).skip(g * GROUP).take(GROUP).enumerate() {
            for (src, dst) in row.chunks_exact(F::BYTES).zip(dst.chunks_exact_mut(F::PACKED)) {
                // `d` (and `m`) are the block's first f16s.
                dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
                if F::AFFINE {
                    dst[32 + 2 * j..32 + 2 * j + 2].copy_from_slice(&src[2..4]);
                }
                let codes = F::values(src).map(|v| (v + i32::from(F::OFFSET)) as u8);
                for (p, step) in dst[F::HEADER..].chunks_exact_mut(F::STEP).enumerate() {
                    let (c0, c1) = (codes[2 * p], codes[2 * p + 1]);
                    if F::BITS == 8 {
                        step[2 * j] = c0;
                        step[2 * j + 1] = c1;
                        continue;
                    }
                    step[j] = (c0 & 15) | (c1 & 15) << 4;
                    if F::BITS == 5 {
                        step[16 + j / 8] |= (c0 >> 4) << (j % 8);
                        step[18 + j / 8] |= (c1 >> 4) << (j % 8);
                    }
                }
            }
        }
    });
    out
}
