//! Norms over rows: RMSNorm, `x / sqrt(mean(x²) + eps) * (offset + w)` (offset 1 for Gemma's
//! norm), and LayerNorm, `(x - mean(x)) / sqrt(var(x) + eps) * w + b` (starcoder2); each alone
//! or fused with the residual add before it.

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

/// One row `x` layer-normalized into `out`.
#[inline]
fn layer_norm_row(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    for (((o, x), w), b) in out.iter_mut().zip(x).zip(weight).zip(bias) {
        *o = (x - mean) * inv * w + b;
    }
}

/// `row(x_row, out_row)` over the `d`-wide rows, in parallel for many rows.
fn each_row(x: &[f32], d: usize, out: &mut [f32], row: impl Fn(&[f32], &mut [f32]) + Sync) {
    assert!(x.len() == out.len() && x.len().is_multiple_of(d), "norm shapes");
    let row = |(o, x): (&mut [f32], &[f32])| row(x, o);
    if x.len() >= PAR_MIN {
        out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(row);
    } else {
        out.chunks_mut(d).zip(x.chunks(d)).for_each(row);
    }
}

/// `x += y`, then `row(x_row, out_row)` over the `d`-wide rows of the sum: a residual add and
/// the next norm in one pass over the rows (the add was a serial loop of its own, ~0.4 ms a
/// layer for a 1,024-token prompt), with the values of the two done apart.
fn each_row_added(x: &mut [f32], y: &[f32], d: usize, out: &mut [f32], row: impl Fn(&[f32], &mut [f32]) + Sync) {
    assert!(x.len() == out.len() && y.len() == x.len() && x.len().is_multiple_of(d), "norm shapes");
    let row = |((o, x), y): ((&mut [f32], &mut [f32]), &[f32])| {
        x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        row(x, o);
    };
    if x.len() >= PAR_MIN {
        out.par_chunks_mut(d).zip(x.par_chunks_mut(d)).zip(y.par_chunks(d)).for_each(row);
    } else {
        out.chunks_mut(d).zip(x.chunks_mut(d)).zip(y.chunks(d)).for_each(row);
    }
}

/// RMS-normalize each `weight.len()`-wide row of `x` into `out`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, weight_offset: f32, out: &mut [f32]) {
    each_row(x, weight.len(), out, |x, o| norm_row(x, weight, eps, weight_offset, o));
}

/// `x += y`, then each row of the sum RMS-normalized into `out`, in one pass.
pub fn add_rms_norm(x: &mut [f32], y: &[f32], weight: &[f32], eps: f32, weight_offset: f32, out: &mut [f32]) {
    each_row_added(x, y, weight.len(), out, |x, o| norm_row(x, weight, eps, weight_offset, o));
}

/// Layer-normalize each `weight.len()`-wide row of `x` into `out`.
pub fn layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(weight.len(), bias.len(), "layer_norm weight and bias");
    each_row(x, weight.len(), out, |x, o| layer_norm_row(x, weight, bias, eps, o));
}

/// `x += y`, then each row of the sum layer-normalized into `out`, in one pass.
pub fn add_layer_norm(x: &mut [f32], y: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(weight.len(), bias.len(), "layer_norm weight and bias");
    each_row_added(x, y, weight.len(), out, |x, o| layer_norm_row(x, weight, bias, eps, o));
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

    /// LayerNorm against an f64 computation, alone and fused with the add.
    #[test]
    fn layer_norm_matches_f64() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::rng().random());
        let d = 96;
        let weight: Vec<f32> = (0..d).map(|_| rng.random_range(-2.0..2.0)).collect();
        let bias: Vec<f32> = (0..d).map(|_| rng.random_range(-1.0..1.0)).collect();
        let x: Vec<f32> = (0..3 * d).map(|_| rng.random_range(-3.0..3.0) + 5.0).collect();
        let mut got = vec![0f32; x.len()];
        layer_norm(&x, &weight, &bias, 1e-5, &mut got);
        for (row, out) in x.chunks(d).zip(got.chunks(d)) {
            let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / d as f64;
            let var = row.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / d as f64;
            for i in 0..d {
                let want = (f64::from(row[i]) - mean) / (var + 1e-5).sqrt() * f64::from(weight[i]) + f64::from(bias[i]);
                assert!((f64::from(out[i]) - want).abs() < 1e-4, "{} vs {want}", out[i]);
            }
        }
        let (mut fused, mut added) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        add_layer_norm(&mut fused, &x, &weight, &bias, 1e-5, &mut added);
        assert!(fused == x && added == got, "fused add and layer norm differ");
    }
}
