//! Reductions over a vector of logits: argmax (and its vector max), softmax, log-softmax.

#[cfg(target_arch = "x86_64")]
use super::qmatmul::{kernel_mode, Level};

/// Index of the largest value (the first one on ties, as torch does). NaN never wins.
pub fn argmax(x: &[f32]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if kernel_mode().level().is_some_and(|l| l >= Level::Avx2) {
        // SAFETY: every level from AVX2 up guarantees AVX2.
        return unsafe { argmax_avx2(x) };
    }
    argmax_scalar(x)
}

fn argmax_scalar(x: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best
}

/// The largest value of `x`, eight lanes at a time (NaNs ignored; -inf when empty): the
/// max of `argmax`'s first pass and of the attention softmax.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn max_avx2(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
    let mut chunks = x.chunks_exact(32);
    for c in &mut chunks {
        for (i, a) in acc.iter_mut().enumerate() {
            // `max_ps(v, a)` keeps `a` where `v` is NaN, like `f32::max`.
            *a = _mm256_max_ps(_mm256_loadu_ps(c.as_ptr().add(8 * i)), *a);
        }
    }
    let mut lanes = [0f32; 8];
    let m = _mm256_max_ps(_mm256_max_ps(acc[0], acc[1]), _mm256_max_ps(acc[2], acc[3]));
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    lanes.into_iter().chain(chunks.remainder().iter().copied()).fold(f32::NEG_INFINITY, f32::max)
}

/// `argmax` in two passes: the largest value eight lanes at a time (a 49,152-entry vocabulary
/// row took ~30 µs one value at a time), then the first index holding it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn argmax_avx2(x: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let max = max_avx2(x);
    // Nothing above -inf: the scalar rule keeps index 0.
    if max == f32::NEG_INFINITY {
        return 0;
    }
    let want = _mm256_set1_ps(max);
    let mut chunks = x.chunks_exact(8);
    for (i, c) in (&mut chunks).enumerate() {
        let hits = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_loadu_ps(c.as_ptr()), want));
        if hits != 0 {
            return 8 * i + hits.trailing_zeros() as usize;
        }
    }
    let rest = x.len() - chunks.remainder().len();
    rest + chunks.remainder().iter().position(|&v| v == max).unwrap_or(0)
}

pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

pub fn log_softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + x.iter().map(|v| (v - max).exp()).sum::<f32>().ln();
    x.iter().map(|v| v - lse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    /// The vector argmax agrees with the scalar one on random rows of odd lengths, with ties,
    /// NaNs and infinities placed at random, and on the degenerate rows.
    #[test]
    fn argmax_matches_the_scalar_rule() {
        let mut rng = rand::rng();
        for len in [1, 7, 8, 31, 32, 33, 100, 49_157] {
            for _ in 0..20 {
                let mut x: Vec<f32> = (0..len).map(|_| rng.random_range(-4.0..4.0)).collect();
                for _ in 0..rng.random_range(0..4) {
                    let (i, j) = (rng.random_range(0..len), rng.random_range(0..len));
                    x[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, x[j]][rng.random_range(0..4)];
                }
                assert_eq!(argmax(&x), argmax_scalar(&x), "{x:?}");
            }
        }
        for x in [vec![], vec![f32::NAN; 40], vec![f32::NEG_INFINITY; 40], vec![2.0; 40]] {
            assert_eq!(argmax(&x), argmax_scalar(&x), "{x:?}");
        }
    }
}
