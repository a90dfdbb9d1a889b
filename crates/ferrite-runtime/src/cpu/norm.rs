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

/// One row `x` normalized into `out`.
#[inline]
fn norm_row(x: &[f32], weight: &[f32], eps: f32, weight_offset: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((o, x), w) in out.iter_mut().zip(x).zip(weight) {
        *o = x * inv * (weight_offset + w);
    }
}

/// Normalize each `weight.len()`-wide row of `x` into `out`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, weight_offset: f32, out: &mut [f32]) {
    let d = weight.len();
    assert!(x.len() == out.len() && x.len().is_multiple_of(d), "rms_norm shapes");
    let row = |(o, x): (&mut [f32], &[f32])| norm_row(x, weight, eps, weight_offset, o);
    if x.len() >= PAR_MIN {
        out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(row);
    } else {
        out.chunks_mut(d).zip(x.chunks(d)).for_each(row);
    }
}

/// `x += y`, then each row of the sum normalized into `out` as `rms_norm` does: a residual add
/// and the next norm in one pass over the rows (the add was a serial loop of its own, ~0.4 ms
/// a layer for a 1,024-token prompt), with the values of the two done apart.
pub fn add_rms_norm(x: &mut [f32], y: &[f32], weight: &[f32], eps: f32, weight_offset: f32, out: &mut [f32]) {
    let d = weight.len();
    assert!(x.len() == out.len() && y.len() == x.len() && x.len().is_multiple_of(d), "add_rms_norm shapes");
    let row = |((o, x), y): ((&mut [f32], &mut [f32]), &[f32])| {
        x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        norm_row(x, weight, eps, weight_offset, o);
    };
    if x.len() >= PAR_MIN {
        out.par_chunks_mut(d).zip(x.par_chunks_mut(d)).zip(y.par_chunks(d)).for_each(row);
    } else {
        out.chunks_mut(d).zip(x.chunks_mut(d)).zip(y.chunks(d)).for_each(row);
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

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    /// The fused add and norm gives the values of the add and the norm done apart, on the
    /// calling thread and in the parallel loop.
    #[test]
    fn add_rms_norm_equals_add_then_norm() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::rng().random());
        let d = 576;
        let weight: Vec<f32> = (0..d).map(|_| rng.random_range(-2.0..2.0)).collect();
        for rows in [1, 8, 64] {
            let x: Vec<f32> = (0..rows * d).map(|_| rng.random_range(-3.0..3.0)).collect();
            let y: Vec<f32> = (0..rows * d).map(|_| rng.random_range(-3.0..3.0)).collect();
            let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
            let mut want = vec![0f32; x.len()];
            rms_norm(&sum, &weight, 1e-5, 1.0, &mut want);
            let (mut fused, mut got) = (x.clone(), vec![0f32; x.len()]);
            add_rms_norm(&mut fused, &y, &weight, 1e-5, 1.0, &mut got);
            assert!(fused == sum && got == want, "{rows} rows: fused add and norm differ");
        }
    }
}
