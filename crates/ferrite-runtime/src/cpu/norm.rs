//! RMSNorm over rows: `x / sqrt(mean(x²) + eps) * (offset + w)` (offset 1 for Gemma's norm).

use rayon::prelude::*;

/// Below this many values a norm runs on the calling thread: a parallel loop costs more than
/// the work (microseconds, when called from outside the pool).
const PAR_MIN: usize = 1 << 14;

/// `1 / sqrt(mean(x²) + eps)`, the squares summed in 16 interleaved partial sums: one running
/// sum is a chain of dependent adds the compiler may not reorder (~4 µs for a decode batch's
/// eight 576-wide rows, serial in the step), whereas the partial sums vectorize.
#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    const LANES: usize = 16;
    let mut part = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        for (p, v) in part.iter_mut().zip(c) {
            *p += v * v;
        }
    }
    let ss = (part.iter().sum::<f32>() + tail) / x.len() as f32;
    1.0 / (ss + eps).sqrt()
}

/// Normalize each `weight.len()`-wide row of `x` into `out`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, weight_offset: f32, out: &mut [f32]) {
    let d = weight.len();
    assert!(x.len() == out.len() && x.len().is_multiple_of(d), "rms_norm shapes");
    let row = |(o, x): (&mut [f32], &[f32])| {
        let inv = inv_rms(x, eps);
        for ((o, x), w) in o.iter_mut().zip(x).zip(weight) {
            *o = x * inv * (weight_offset + w);
        }
    };
    if x.len() >= PAR_MIN {
        out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(row);
    } else {
        out.chunks_mut(d).zip(x.chunks(d)).for_each(row);
    }
}

/// Normalize each `weight.len()`-wide row of `x` in place (e.g. per-head q/k norm).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32, weight_offset: f32) {
    let d = weight.len();
    assert!(x.len().is_multiple_of(d), "rms_norm shapes");
    let row = |x: &mut [f32]| {
        let inv = inv_rms(x, eps);
        for (x, w) in x.iter_mut().zip(weight) {
            *x *= inv * (weight_offset + w);
        }
    };
    if x.len() >= PAR_MIN {
        x.par_chunks_mut(d).for_each(row);
    } else {
        x.chunks_mut(d).for_each(row);
    }
}
