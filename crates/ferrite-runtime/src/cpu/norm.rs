//! RMSNorm over rows: `x / sqrt(mean(x²) + eps) * (offset + w)` (offset 1 for Gemma's norm).

use rayon::prelude::*;

pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, weight_offset: f32, out: &mut [f32]) {
    let d = weight.len();
    assert!(x.len() == out.len() && x.len() % d == 0, "rms_norm shapes");
    out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(o, x)| {
        let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((o, x), w) in o.iter_mut().zip(x).zip(weight) {
            *o = x * inv * (weight_offset + w);
        }
    });
}
