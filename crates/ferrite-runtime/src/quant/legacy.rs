//! The 32-value ggml blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q8_1.
//!
//! Each block is one or two f16 fields followed by packed quants. The 4- and 5-bit formats
//! share one packing: value `j < 16` is the low nibble of `qs[j]`, value `j + 16` its high
//! nibble, and for the 5-bit formats bit `j` of the little-endian u32 `qh` is the fifth bit of
//! value `j`. "_0" formats are symmetric (`(q - offset) * d`), "_1" formats affine
//! (`q * d + m`), as in ggml's `dequantize_row_*`.

use super::f16_le;

/// Values per block.
pub(super) const QK: usize = 32;

/// The 32 unsigned quants of a 4- or 5-bit block: nibbles of `qs` plus, as bit 4, the bits of
/// `qh` (0 for the 4-bit formats).
pub(crate) fn unpack_nibbles(qs: &[u8], qh: u32) -> [u8; QK] {
    let mut q = [0u8; QK];
    let (lo, hi) = q.split_at_mut(QK / 2);
    for (j, ((&byte, lo), hi)) in qs.iter().zip(lo).zip(hi).enumerate() {
        let high_lo = ((qh >> j) & 1) as u8;
        let high_hi = ((qh >> (j + QK / 2)) & 1) as u8;
        *lo = (byte & 0x0F) | (high_lo << 4);
        *hi = (byte >> 4) | (high_hi << 4);
    }
    q
}

/// `(q - offset) * d` for every value.
fn symmetric(q: &[u8; QK], offset: i32, d: f32, y: &mut [f32; QK]) {
    for (y, &q) in y.iter_mut().zip(q) {
        *y = (i32::from(q) - offset) as f32 * d;
    }
}

/// `q * d + m` for every value (`q * d` is exact; the add rounds once).
fn affine(q: &[u8; QK], d: f32, m: f32, y: &mut [f32; QK]) {
    for (y, &q) in y.iter_mut().zip(q) {
        *y = f32::from(q) * d + m;
    }
}

/// Q4_0, 18 bytes: `d: f16 | qs: [u8; 16]`; value = `(nibble - 8) * d`.
pub(super) fn dequantize_q4_0(b: &[u8; 18], y: &mut [f32; QK]) {
    let d = f16_le(b[0], b[1]);
    symmetric(&unpack_nibbles(&b[2..], 0), 8, d, y);
}

/// Q4_1, 20 bytes: `d: f16 | m: f16 | qs: [u8; 16]`; value = `nibble * d + m`.
pub(super) fn dequantize_q4_1(b: &[u8; 20], y: &mut [f32; QK]) {
    let d = f16_le(b[0], b[1]);
    let m = f16_le(b[2], b[3]);
    affine(&unpack_nibbles(&b[4..], 0), d, m, y);
}

/// Q5_0, 22 bytes: `d: f16 | qh: u32 | qs: [u8; 16]`; value = `(q5 - 16) * d`.
pub(super) fn dequantize_q5_0(b: &[u8; 22], y: &mut [f32; QK]) {
    let d = f16_le(b[0], b[1]);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    symmetric(&unpack_nibbles(&b[6..], qh), 16, d, y);
}

/// Q5_1, 24 bytes: `d: f16 | m: f16 | qh: u32 | qs: [u8; 16]`; value = `q5 * d + m`.
pub(super) fn dequantize_q5_1(b: &[u8; 24], y: &mut [f32; QK]) {
    let d = f16_le(b[0], b[1]);
    let m = f16_le(b[2], b[3]);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    affine(&unpack_nibbles(&b[8..], qh), d, m, y);
}

/// `q * d` over signed 8-bit quants.
fn scale_i8(qs: &[u8], d: f32, y: &mut [f32; QK]) {
    for (y, &q) in y.iter_mut().zip(qs) {
        *y = f32::from(q as i8) * d;
    }
}

/// Q8_0, 34 bytes: `d: f16 | qs: [i8; 32]`; value = `q * d`.
pub(super) fn dequantize_q8_0(b: &[u8; 34], y: &mut [f32; QK]) {
    scale_i8(&b[2..], f16_le(b[0], b[1]), y);
}

/// Q8_1, 36 bytes: `d: f16 | s: f16 | qs: [i8; 32]`; value = `q * d`.
///
/// `s` (`d * sum(qs)`) only serves dot products. ggml defines no `dequantize_row_q8_1`; this
/// is the only reading of the block consistent with its quantizer, and matches Q8_0.
pub(super) fn dequantize_q8_1(b: &[u8; 36], y: &mut [f32; QK]) {
    scale_i8(&b[4..], f16_le(b[0], b[1]), y);
}
