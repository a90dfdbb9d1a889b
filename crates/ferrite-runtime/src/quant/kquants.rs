//! The 256-value ggml "K" super-blocks: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K.
//!
//! A super-block holds an f16 scale `d` (and for Q2_K/Q4_K/Q5_K a min scale `dmin`) plus small
//! per-sub-block scales. Q2_K, Q3_K and Q6_K use 16 sub-blocks of 16 values whose low quant
//! bits sit in 2-bit planes (see `Group`); Q4_K and Q5_K use 8 sub-blocks of 32 values with
//! 6-bit packed scales and mins. Values are `(d * sc) * q - dmin * m` as in ggml's
//! `dequantize_row_*`; the products are exact in f32, so results are bit-exact.

use super::f16_le;

/// Values per super-block.
pub(crate) const QK_K: usize = 256;

/// Where the 16 values of group `g` (values `16g..16g + 16`) sit in the plane layout shared by
/// Q2_K, Q3_K and Q6_K. Each 128-value `half` reads 32 bytes of 2-bit fields; value
/// `128 * half + 32 * plane + l` (`l < 32`) is bits `2 * plane..2 * plane + 2` of byte `l`, so
/// group `g` covers `lane..lane + 16` of those bytes.
struct Group {
    half: usize,
    plane: usize,
    lane: usize,
}

impl Group {
    fn of(g: usize) -> Group {
        Group { half: g / 8, plane: (g % 8) / 2, lane: 16 * (g % 2) }
    }

    /// The 16 bytes of a 32-bytes-per-half 2-bit field array that hold this group.
    fn bytes<'a>(&self, field: &'a [u8]) -> &'a [u8] {
        let start = 32 * self.half + self.lane;
        &field[start..start + 16]
    }

    /// The right shift that brings this group's 2-bit field down to bit 0.
    fn shift(&self) -> usize {
        2 * self.plane
    }
}

/// Q2_K, 84 bytes: `scales: [u8; 16] | qs: [u8; 64] | d: f16 | dmin: f16`.
///
/// Group `g` has scale `scales[g] & 0xF` and min `scales[g] >> 4`;
/// value = `(d * scale) * q2 - dmin * min`.
pub(super) fn dequantize_q2_k(b: &[u8; 84], y: &mut [f32; QK_K]) {
    let scales = &b[..16];
    let qs = &b[16..80];
    let d = f16_le(b[80], b[81]);
    let dmin = f16_le(b[82], b[83]);
    for (g, (out, &sc)) in y.chunks_exact_mut(16).zip(scales).enumerate() {
        let dl = d * f32::from(sc & 0xF);
        let ml = dmin * f32::from(sc >> 4);
        let group = Group::of(g);
        let shift = group.shift();
        for (y, &q) in out.iter_mut().zip(group.bytes(qs)) {
            *y = dl * f32::from((q >> shift) & 3) - ml;
        }
    }
}

/// The 16 signed 6-bit group scales of Q3_K, unpacked from 12 bytes: the low 4 bits of scale
/// `i` are nibble `i / 8` of byte `i % 8`, the high 2 bits are bits `2 * (i / 4)..` of byte
/// `8 + i % 4`; the stored value is offset by 32.
fn q3_k_scales(packed: &[u8]) -> [i32; 16] {
    let mut scales = [0i32; 16];
    for (i, scale) in scales.iter_mut().enumerate() {
        let low = (packed[i % 8] >> (4 * (i / 8))) & 0x0F;
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 0x03;
        *scale = i32::from(low | (high << 4)) - 32;
    }
    scales
}

/// Q3_K, 110 bytes: `hmask: [u8; 32] | qs: [u8; 64] | scales: [u8; 12] | d: f16`.
///
/// The low two bits of a value come from `qs` (plane layout), the third from `hmask`: value
/// `128 * half + 32 * plane + l` uses bit `4 * half + plane` of `hmask[l]`, and a *clear* bit
/// subtracts 4. value = `(d * scale) * q3`.
pub(super) fn dequantize_q3_k(b: &[u8; 110], y: &mut [f32; QK_K]) {
    let hmask = &b[..32];
    let qs = &b[32..96];
    let scales = q3_k_scales(&b[96..108]);
    let d = f16_le(b[108], b[109]);
    for (g, (out, &sc)) in y.chunks_exact_mut(16).zip(&scales).enumerate() {
        let dl = d * sc as f32;
        let group = Group::of(g);
        let shift = group.shift();
        let hbit = 4 * group.half + group.plane;
        let high = &hmask[group.lane..group.lane + 16];
        for ((y, &q), &h) in out.iter_mut().zip(group.bytes(qs)).zip(high) {
            let low = i32::from((q >> shift) & 3);
            let minus = if (h >> hbit) & 1 == 1 { 0 } else { 4 };
            *y = dl * (low - minus) as f32;
        }
    }
}

/// Scale and min of 32-value sub-block `j` in the 12-byte Q4_K/Q5_K packing: 6 bits each,
/// sub-blocks 0..4 in the low bits of bytes `j` and `j + 4`, sub-blocks 4..8 split between the
/// nibbles of byte `j + 4` and the top two bits of bytes `j - 4` and `j`.
pub(crate) fn scale_min_k4(j: usize, packed: &[u8]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        let scale = (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4);
        let min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
        (scale, min)
    }
}

/// The 256 unsigned 5-bit codes of a Q5_K super-block (4-bit for Q4_K, whose `qh` is all
/// zero): sub-block `s` (values `32s..32s + 32`) reads nibble `s % 2` of
/// `qs[32 * (s / 2)..][..32]` and bit `s` of `qh`.
pub(crate) fn k4_k5_codes(qh: &[u8], qs: &[u8]) -> [u8; QK_K] {
    let mut codes = [0u8; QK_K];
    for (s, out) in codes.chunks_exact_mut(32).enumerate() {
        let nibble_shift = 4 * (s % 2);
        let low = &qs[32 * (s / 2)..32 * (s / 2) + 32];
        for ((c, &ql), &h) in out.iter_mut().zip(low).zip(qh) {
            *c = ((ql >> nibble_shift) & 0x0F) | (((h >> s) & 1) << 4);
        }
    }
    codes
}

/// Q4_K and Q5_K share everything but the fifth quant bit (`k4_k5_codes`).
/// value = `(d * scale) * q - dmin * min`.
fn dequantize_k4_k5(d: f32, dmin: f32, packed: &[u8], qh: &[u8], qs: &[u8], y: &mut [f32; QK_K]) {
    let codes = k4_k5_codes(qh, qs);
    for (s, (out, q)) in y.chunks_exact_mut(32).zip(codes.chunks_exact(32)).enumerate() {
        let (sc, m) = scale_min_k4(s, packed);
        let dl = d * f32::from(sc);
        let ml = dmin * f32::from(m);
        for (y, &q) in out.iter_mut().zip(q) {
            *y = dl * f32::from(q) - ml;
        }
    }
}

/// Q4_K has no fifth bit.
const NO_HIGH_BITS: [u8; 32] = [0; 32];

/// Q4_K, 144 bytes: `d: f16 | dmin: f16 | scales: [u8; 12] | qs: [u8; 128]`.
pub(super) fn dequantize_q4_k(b: &[u8; 144], y: &mut [f32; QK_K]) {
    let d = f16_le(b[0], b[1]);
    let dmin = f16_le(b[2], b[3]);
    dequantize_k4_k5(d, dmin, &b[4..16], &NO_HIGH_BITS, &b[16..], y);
}

/// Q5_K, 176 bytes: `d: f16 | dmin: f16 | scales: [u8; 12] | qh: [u8; 32] | qs: [u8; 128]`.
pub(super) fn dequantize_q5_k(b: &[u8; 176], y: &mut [f32; QK_K]) {
    let d = f16_le(b[0], b[1]);
    let dmin = f16_le(b[2], b[3]);
    dequantize_k4_k5(d, dmin, &b[4..16], &b[16..48], &b[48..], y);
}

/// The 256 unsigned 6-bit codes of a Q6_K super-block (value = `code - 32` times scale).
///
/// In each 128-value half, plane `p` takes its low 4 bits from nibble `p / 2` of
/// `ql[64 * half + 32 * (p % 2)..][..32]` and its high 2 bits from `qh` (plane layout).
pub(crate) fn q6_k_codes(ql: &[u8], qh: &[u8]) -> [u8; QK_K] {
    let mut codes = [0u8; QK_K];
    for (g, out) in codes.chunks_exact_mut(16).enumerate() {
        let group = Group::of(g);
        let start = 64 * group.half + 32 * (group.plane % 2) + group.lane;
        let low = &ql[start..start + 16];
        let nibble_shift = 4 * (group.plane / 2);
        let shift = group.shift();
        for ((c, &l), &h) in out.iter_mut().zip(low).zip(group.bytes(qh)) {
            *c = ((l >> nibble_shift) & 0x0F) | (((h >> shift) & 3) << 4);
        }
    }
    codes
}

/// Q6_K, 210 bytes: `ql: [u8; 128] | qh: [u8; 64] | scales: [i8; 16] | d: f16`;
/// value = `(d * scale) * (q6 - 32)` with `q6` from `q6_k_codes`.
pub(super) fn dequantize_q6_k(b: &[u8; 210], y: &mut [f32; QK_K]) {
    let codes = q6_k_codes(&b[..128], &b[128..192]);
    let scales = &b[192..208];
    let d = f16_le(b[208], b[209]);
    for ((out, q), &sc) in y.chunks_exact_mut(16).zip(codes.chunks_exact(16)).zip(scales) {
        let dl = d * f32::from(sc as i8);
        for (y, &q) in out.iter_mut().zip(q) {
            *y = dl * (i32::from(q) - 32) as f32;
        }
    }
}

/// Q8_K, 292 bytes: `d: f32 | qs: [i8; 256] | bsums: [i16; 16]`; value = `d * q`.
///
/// `bsums` (sums of 16 quants) only serve dot products.
pub(super) fn dequantize_q8_k(b: &[u8; 292], y: &mut [f32; QK_K]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (y, &q) in y.iter_mut().zip(&b[4..260]) {
        *y = d * f32::from(q as i8);
    }
}
