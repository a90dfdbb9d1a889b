//! On-the-fly quantization of activation rows to 15-bit integers, done once per linear call.
//!
//! Each block of `block` values (32 for the legacy weight formats, 256 for the K-quants) gets
//! one f32 scale `d = amax / QMAX` and i16 codes `q = round_ties_even(x * QMAX / amax)` in
//! `-QMAX..=QMAX`, so `x ≈ q * d` with an error of at most `d / 2 = amax / 32766` per value.
//! Eight-bit codes (what llama.cpp uses) were measured too coarse: on SmolLM2 they move the
//! argmax at ~4 % of positions even with one scale per 4 values, while 15 bits are
//! indistinguishable from f32 (see `ferrite-models/tests/kernel_accuracy.rs`). 15 rather than 16
//! bits leave every kernel's 32-bit integer sums a factor of 2 of headroom.
//!
//! Alongside the codes, each block keeps the integer sum of its codes: 32-blocks as
//! `s = d * Σq` next to `d` (the affine formats multiply it by their block min `m`), 256-blocks
//! as one sum per 32 values (the K-quants' sub-block mins).
//!
//! The AVX2 quantizer produces exactly the scalar quantizer's codes (same multiply, same
//! round-half-even), so kernel tests can share one quantization.

use super::isa::Level;

/// Largest code magnitude.
pub(crate) const QMAX: f32 = 16383.0;

/// Activation rows quantized to i16 blocks.
pub(crate) struct QuantizedActs {
    block: usize,
    k: usize,
    qs: Vec<i16>,
    /// 32-blocks: `(d, d * Σq)` per block; 256-blocks: `d` per block.
    scales: Vec<f32>,
    /// 256-blocks: `Σq` over each 32 values; empty for 32-blocks.
    sums: Vec<i32>,
}

/// One quantized activation row, as the kernels read it.
#[derive(Clone, Copy)]
pub(crate) struct ActRow<'a> {
    pub qs: &'a [i16],
    pub scales: &'a [f32],
    pub sums: &'a [i32],
}

fn code_sum(q: &[i16]) -> i32 {
    q.iter().map(|&v| i32::from(v)).sum()
}

impl QuantizedActs {
    /// Quantize the `m` rows of `x` (`[m, k]`, `k` a multiple of `block`, 32 or 256).
    pub(crate) fn new(x: &[f32], m: usize, k: usize, block: usize, level: Level) -> QuantizedActs {
        debug_assert!(x.len() == m * k && k.is_multiple_of(block) && (block == 32 || block == 256));
        let nb = k / block;
        let mut qs = vec![0i16; m * k];
        let mut d = vec![0f32; m * nb];
        for ((x, q), d) in x.chunks_exact(k).zip(qs.chunks_exact_mut(k)).zip(d.chunks_exact_mut(nb)) {
            quantize_row(x, block, QMAX, q, d, level);
        }
        if block == 32 {
            let scales = d.iter().zip(qs.chunks_exact(32)).flat_map(|(&d, q)| [d, d * code_sum(q) as f32]).collect();
            QuantizedActs { block, k, qs, scales, sums: Vec::new() }
        } else {
            let sums = qs.chunks_exact(32).map(code_sum).collect();
            QuantizedActs { block, k, qs, scales: d, sums }
        }
    }

    /// Row `i`.
    pub(crate) fn row(&self, i: usize) -> ActRow<'_> {
        let nb = self.k / self.block;
        let qs = &self.qs[i * self.k..(i + 1) * self.k];
        if self.block == 32 {
            ActRow { qs, scales: &self.scales[2 * nb * i..2 * nb * (i + 1)], sums: &[] }
        } else {
            ActRow { qs, scales: &self.scales[nb * i..nb * (i + 1)], sums: &self.sums[8 * nb * i..8 * nb * (i + 1)] }
        }
    }

    /// The values the codes stand for (`q * d`), row-major; what the kernels effectively
    /// multiply the weights by. Tests compare against a reference over these.
    #[cfg(test)]
    pub(crate) fn dequantized(&self) -> Vec<f32> {
        let per_block = if self.block == 32 { 2 } else { 1 };
        self.qs
            .chunks_exact(self.block)
            .zip(self.scales.chunks_exact(per_block))
            .flat_map(|(q, s)| q.iter().map(move |&v| f32::from(v) * s[0]))
            .collect()
    }
}

/// Quantize one row into `q` (codes in `-qmax..=qmax`, `qmax < 32768`) and `d` (one scale per
/// `block` values, a multiple of 16).
pub(crate) fn quantize_row(x: &[f32], block: usize, qmax: f32, q: &mut [i16], d: &mut [f32], level: Level) {
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar {
        // SAFETY: every non-scalar level implies AVX2 (checked when the level was chosen), and
        // the slices have the lengths `quantize_row_avx2` indexes (k values, k / block scales).
        unsafe { quantize_row_avx2(x, block, qmax, q, d) };
        return;
    }
    let _ = level;
    for ((x, q), d) in x.chunks_exact(block).zip(q.chunks_exact_mut(block)).zip(d.iter_mut()) {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let id = if amax > 0.0 { qmax / amax } else { 0.0 };
        for (q, &v) in q.iter_mut().zip(x) {
            *q = (v * id).round_ties_even() as i16;
        }
        *d = amax / qmax;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_avx2(x: &[f32], block: usize, qmax: f32, q: &mut [i16], d: &mut [f32]) {
    use std::arch::x86_64::*;
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    for ((x, q), d) in x.chunks_exact(block).zip(q.chunks_exact_mut(block)).zip(d.iter_mut()) {
        let mut vmax = _mm256_setzero_ps();
        for c in x.chunks_exact(8) {
            vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(c.as_ptr()), abs_mask));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        let id = _mm256_set1_ps(if amax > 0.0 { qmax / amax } else { 0.0 });
        for (x, q) in x.chunks_exact(16).zip(q.chunks_exact_mut(16)) {
            let r = |i: usize| _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(8 * i)), id));
            // packs interleaves 128-bit lanes; vpermq puts the four 4-value runs back in order.
            let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(r(0), r(1)));
            _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, packed);
        }
        *d = amax / qmax;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    #[test]
    fn simd_quantizer_matches_scalar() {
        let mut rng = rand::rng();
        for block in [32, 256] {
            let k = 3 * block;
            let mut x: Vec<f32> = (0..2 * k).map(|_| rng.random_range(-3.0..3.0)).collect();
            x[block..2 * block].fill(0.0); // an all-zero block
            let scalar = QuantizedActs::new(&x, 2, k, block, Level::Scalar);
            let simd_level = Level::best();
            let simd = QuantizedActs::new(&x, 2, k, block, simd_level);
            assert_eq!(scalar.qs, simd.qs, "block {block} ({simd_level:?})");
            assert_eq!(scalar.scales, simd.scales);
            assert_eq!(scalar.sums, simd.sums);
            // Every value within half a step of its code (plus f32 rounding of x * id and q * d).
            for (i, (v, r)) in x.iter().zip(scalar.dequantized()).enumerate() {
                let d = scalar.scales[(i / block) * if block == 32 { 2 } else { 1 }];
                assert!((v - r).abs() <= 0.5 * d + 4.0 * f32::EPSILON * v.abs(), "value {i}: {v} vs {r}");
            }
        }
    }
}
