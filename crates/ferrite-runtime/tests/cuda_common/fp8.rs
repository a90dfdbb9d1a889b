//! FP8 weights on the host, as the device's kernels define them (`cuda_fp8`, `cuda_moe`):
//! random codes and scales, their dequantization, and the per-row quantization of
//! `fp8_quantize_rows` (scale max|x| / 448, codes rounded to nearest even).

use ferrite_runtime::quant::e4m3_to_f32;
use rand::rngs::StdRng;
use rand::Rng;

/// The e4m3 code nearest `v` (ties to the even code), saturating at ±448: the definition
/// the device's `cvt.rn.satfinite` implements, by search over the finite codes.
pub fn e4m3_code(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    let a = v.abs().min(448.0);
    let mut best = 0u8;
    for c in 0..=0x7eu8 {
        let (d, db) = ((e4m3_to_f32(c) - a).abs(), (e4m3_to_f32(best) - a).abs());
        if d < db || (d == db && c % 2 == 0 && best % 2 == 1) {
            best = c;
        }
    }
    best | sign
}

/// Random codes (no NaN) and scales for a `[rows, cols]` matrix, a scale per `col_block`
/// columns.
pub fn random_fp8(rng: &mut StdRng, rows: usize, cols: usize, col_block: usize) -> (Vec<u8>, Vec<f32>) {
    let codes =
        (0..rows * cols).map(|_| rng.random_range(0..=0xfeu8)).map(|c| if c & 0x7f == 0x7f { 0 } else { c }).collect();
    let scales = (0..rows * cols.div_ceil(col_block)).map(|_| rng.random_range(0.5f32..2.0) / 448.0).collect();
    (codes, scales)
}

pub fn dequantize(codes: &[u8], scales: &[f32], cols: usize, col_block: usize) -> Vec<f32> {
    let nb = cols.div_ceil(col_block);
    codes.iter().enumerate().map(|(i, &c)| e4m3_to_f32(c) * scales[(i / cols) * nb + (i % cols) / col_block]).collect()
}

/// The host's per-row quantization (scale max|x| / 448), dequantized again.
pub fn quantize_rows(x: &[f32], k: usize) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let (mut codes, mut scales, mut back) = (vec![], vec![], vec![]);
    for row in x.chunks_exact(k) {
        let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
        for &v in row {
            let c = e4m3_code(v / s);
            codes.push(c);
            back.push(e4m3_to_f32(c) * s);
        }
        scales.push(s);
    }
    (codes, scales, back)
}
