//! GGUF block formats: dequantization of every supported block type to f32.
//!
//! `dequantize_row` is the exact reference path: the CPU matmul and embedding ops call it a
//! block-row at a time, so quantized weights stay quantized in memory. Each format follows
//! ggml's `dequantize_row_*` layout and formula, and results match ggml (and the `gguf` Python
//! package) bit for bit; `tests/fixtures/quant` holds the goldens.
//!
//! Why bit-exact is the right bar: an f16 scale has an 11-bit significand and every quant and
//! sub-block scale is a small integer, so each product `scale * sub_scale * q` fits in f32's 24
//! bits and is exact. The only rounding is the final `- dmin * m` / `+ m` (or the single f32
//! multiply of Q8_K), so any evaluation order, FMA or not, gives the same bits.
//!
//! FP8 e4m3 codes (unscaled) widen exactly too (`e4m3_to_f32`).
//!
//! - `legacy`: the 32-value blocks Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1.
//! - `kquants`: the 256-value super-blocks Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K.
//! - `mlx`: MLX's affine groups (4 or 8 bits, groups of 32, 64 or 128), as blocks assembled
//!   at load from a checkpoint's packed words, scales and biases.
//! - `random`: random weights of a dtype for synthetic models.

mod kquants;
mod legacy;
pub mod mlx;
pub mod random;

pub(crate) use kquants::{k4_k5_codes, q6_k_codes, scale_min_k4};
pub(crate) use legacy::unpack_nibbles;

use crate::dtype::DType;
use crate::error::{Result, RuntimeError};

/// Dequantize `dst.len()` values stored as `dtype` in `src` (a whole number of blocks).
///
/// Only the first `dtype.row_bytes(dst.len())` bytes of `src` are read.
pub fn dequantize_row(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let need = dtype.row_bytes(dst.len())?;
    if src.len() < need {
        return Err(RuntimeError::ShortBuffer { what: format!("{dtype} row of {}", dst.len()), need, got: src.len() });
    }
    let src = &src[..need];
    match dtype {
        DType::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        DType::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::bf16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
        DType::F8E4M3 => {
            for (d, &b) in dst.iter_mut().zip(src) {
                *d = e4m3_to_f32(b);
            }
        }
        DType::Q4_0 => each_block(src, dst, legacy::dequantize_q4_0),
        DType::Q4_1 => each_block(src, dst, legacy::dequantize_q4_1),
        DType::Q5_0 => each_block(src, dst, legacy::dequantize_q5_0),
        DType::Q5_1 => each_block(src, dst, legacy::dequantize_q5_1),
        DType::Q8_0 => each_block(src, dst, legacy::dequantize_q8_0),
        DType::Q8_1 => each_block(src, dst, legacy::dequantize_q8_1),
        DType::Q2K => each_block(src, dst, kquants::dequantize_q2_k),
        DType::Q3K => each_block(src, dst, kquants::dequantize_q3_k),
        DType::Q4K => each_block(src, dst, kquants::dequantize_q4_k),
        DType::Q5K => each_block(src, dst, kquants::dequantize_q5_k),
        DType::Q6K => each_block(src, dst, kquants::dequantize_q6_k),
        DType::Q8K => each_block(src, dst, kquants::dequantize_q8_k),
        DType::Mlx(f) => mlx::dequantize_row(f, src, dst),
    }
    Ok(())
}

/// Apply a block decoder to each `B`-byte block of `src` and its `N` values in `dst`.
///
/// The caller has checked that `src` holds exactly `dst.len() / N` blocks; the `filter_map`s
/// never drop anything (every `chunks_exact` piece has the right length) and keep this free of
/// panicking conversions.
fn each_block<const B: usize, const N: usize>(src: &[u8], dst: &mut [f32], decode: fn(&[u8; B], &mut [f32; N])) {
    let blocks = src.chunks_exact(B).filter_map(|b| <&[u8; B]>::try_from(b).ok());
    let outs = dst.chunks_exact_mut(N).filter_map(|y| <&mut [f32; N]>::try_from(y).ok());
    for (block, out) in blocks.zip(outs) {
        decode(block, out);
    }
}

/// An e4m3 (`float8_e4m3fn`) code as f32, exactly: 1 sign, 4 exponent (bias 7) and 3
/// mantissa bits, subnormals at exponent 0, and NaN for the two all-ones codes (no infinities).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = (i32::from((b >> 3) & 0xf), f32::from(b & 7));
    sign * match (exp, b & 0x7f) {
        (_, 0x7f) => f32::NAN,
        (0, _) => man * (2f32).powi(-9),
        _ => (1.0 + man / 8.0) * (2f32).powi(exp - 7),
    }
}

/// A little-endian IEEE half read from two block bytes, widened exactly to f32.
pub(crate) fn f16_le(lo: u8, hi: u8) -> f32 {
    half::f16::from_le_bytes([lo, hi]).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    const QUANTIZED: [DType; 12] = [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q8_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        DType::Q8K,
    ];

    /// Every value of a multi-block row is written: a decoder whose block size disagreed with
    /// `DType::block_bytes`/`block_elems` would leave NaNs behind.
    #[test]
    fn every_value_is_written() {
        for dtype in QUANTIZED {
            let n = 3 * dtype.block_elems();
            let src = vec![0x11u8; dtype.row_bytes(n).unwrap()];
            let mut dst = vec![f32::NAN; n];
            dequantize_row(dtype, &src, &mut dst).unwrap();
            assert!(dst.iter().all(|v| v.is_finite()), "{dtype}: unwritten or non-finite values");
        }
    }

    /// Every e4m3 code against its definition's landmarks: ±448 the largest, 2^-9 the smallest
    /// subnormal, 2^-6 the smallest normal, NaN only for the all-ones codes.
    #[test]
    fn e4m3_codes_widen_as_defined() {
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        let nans: Vec<u8> = (0..=255u8).filter(|&b| e4m3_to_f32(b).is_nan()).collect();
        assert_eq!(nans, vec![0x7f, 0xff]);
        // Monotone over the positive codes.
        let pos: Vec<f32> = (0..0x7fu8).map(e4m3_to_f32).collect();
        assert!(pos.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn empty_row_is_fine() {
        for dtype in QUANTIZED {
            dequantize_row(dtype, &[], &mut []).unwrap();
        }
    }
}
