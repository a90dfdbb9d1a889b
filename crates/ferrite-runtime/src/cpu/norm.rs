//! RMSNorm over rows: `x / sqrt(mean(x²) + eps) * (offset + w)` (offset 1 for Gemma's norm).

use rayon::prelude::*;

#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ss + eps).sqrt()
}

/// Normalize each `weight.len()`-wide row of `x` into `out`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, weight_offset: f32, out: &mut [f32]) {
    let d = weight.len();
    assert!(x.len() == out.len() && x.len().is_multiple_of(d), "rms_norm shapes");
    out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(o, x)| {
        let inv = inv_rms(x, eps);
        for ((o, x), w) in o.iter_mut().zip(x).zip(weight) {
            *o = x * inv * (weight_offset + w);
        }
    });
}

/// Normalize each `weight.len()`-wide row of `x` in place (e.g. per-head q/k norm).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32, weight_offset: f32) {
    let d = weight.len();
    assert!(x.len().is_multiple_of(d), "rms_norm shapes");
    x.par_chunks_mut(d).for_each(|x| {
        let inv = inv_rms(x, eps);
        for (x, w) in x.iter_mut().zip(weight) {
            *x *= inv * (weight_offset + w);
        }
    });
}
