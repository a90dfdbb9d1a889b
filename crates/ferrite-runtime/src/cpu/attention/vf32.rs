//! The f32 vector primitives of the attention kernels (dot product, axpy, exponentials), as a
//! trait with a portable and an AVX2+FMA implementation. Kernels are generic over it and
//! instantiated inside `#[target_feature]` entry points, like the quantized kernels.

/// f32 primitives over raw slices of equal length.
pub(super) trait Vf32 {
    /// `Σ a[i] * b[i]`.
    fn dot(a: &[f32], b: &[f32]) -> f32;
    /// `y[i] += alpha * x[i]`.
    fn axpy(y: &mut [f32], alpha: f32, x: &[f32]);
    /// `x[i] = exp(x[i] - max)` in place; returns the sum of the new values.
    fn exp_sum(x: &mut [f32], max: f32) -> f32;
}

pub(super) struct Scalar;

impl Vf32 for Scalar {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        crate::cpu::matmul::dot(a, b)
    }
    #[inline(always)]
    fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
        y.iter_mut().zip(x).for_each(|(y, x)| *y += alpha * x);
    }
    #[inline(always)]
    fn exp_sum(x: &mut [f32], max: f32) -> f32 {
        let mut sum = 0.0;
        for v in x.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        sum
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::Avx2;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Vf32;
    use crate::cpu::qmatmul::isa::hsum_ps;

    /// AVX2 + FMA. Only used inside functions compiled with those features.
    pub(in super::super) struct Avx2;

    /// `e^x` for 8 lanes with `x ≤ 88`: `x = n·ln2 + r` with `|r| ≤ ln2 / 2` (ln2 split in
    /// two for an exact reduction), `e^r` by its degree-6 Taylor polynomial (relative error
    /// < 2e-7), times `2^n` built in the exponent bits. Inputs are clamped at -87, so the
    /// smallest result is `e^-87 ≈ 1.6e-38` rather than a denormal or 0.
    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        const LN2_HI: f32 = 0.693_145_75;
        const LN2_LO: f32 = 1.428_606_8e-6;
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        _mm256_mul_ps(p, _mm256_castsi256_ps(scale))
    }

    impl Vf32 for Avx2 {
        #[inline(always)]
        fn dot(a: &[f32], b: &[f32]) -> f32 {
            let n = a.len().min(b.len());
            // SAFETY: callers are compiled with AVX2/FMA (see the type's docs); every load
            // reads 8 values below `n`.
            unsafe {
                let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut i = 0;
                while i + 16 <= n {
                    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i)), s0);
                    s1 = _mm256_fmadd_ps(
                        _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                        _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                        s1,
                    );
                    i += 16;
                }
                if i + 8 <= n {
                    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i)), s0);
                    i += 8;
                }
                let tail: f32 = a[i..n].iter().zip(&b[i..n]).map(|(x, y)| x * y).sum();
                hsum_ps(_mm256_add_ps(s0, s1)) + tail
            }
        }

        #[inline(always)]
        fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
            let n = y.len().min(x.len());
            // SAFETY: as in `dot`.
            unsafe {
                let a = _mm256_set1_ps(alpha);
                let mut i = 0;
                while i + 8 <= n {
                    let p = y.as_mut_ptr().add(i);
                    _mm256_storeu_ps(p, _mm256_fmadd_ps(a, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(p)));
                    i += 8;
                }
                y[i..n].iter_mut().zip(&x[i..n]).for_each(|(y, x)| *y += alpha * x);
            }
        }

        #[inline(always)]
        fn exp_sum(x: &mut [f32], max: f32) -> f32 {
            // SAFETY: as in `dot`.
            unsafe {
                let m = _mm256_set1_ps(max);
                let mut acc = _mm256_setzero_ps();
                let mut i = 0;
                while i + 8 <= x.len() {
                    let p = x.as_mut_ptr().add(i);
                    let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p), m));
                    _mm256_storeu_ps(p, e);
                    acc = _mm256_add_ps(acc, e);
                    i += 8;
                }
                let mut sum = hsum_ps(acc);
                if i < x.len() {
                    let mut tail = [f32::NEG_INFINITY; 8];
                    tail[..x.len() - i].copy_from_slice(&x[i..]);
                    let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(tail.as_ptr()), m));
                    _mm256_storeu_ps(tail.as_mut_ptr(), e);
                    let rest = x.len() - i;
                    x[i..].copy_from_slice(&tail[..rest]);
                    sum += tail[..rest].iter().sum::<f32>();
                }
                sum
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_exp_is_accurate() {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn run(x: &mut [f32]) -> f32 {
                Avx2::exp_sum(x, 0.0)
            }
            let inputs: Vec<f32> = (0..2001).map(|i| -90.0 + i as f32 * 0.0475).collect();
            let mut got = inputs.clone();
            // SAFETY: AVX2 and FMA were detected above.
            let sum = unsafe { run(&mut got) };
            let mut want_sum = 0f64;
            for (x, g) in inputs.iter().zip(&got) {
                let want = f64::from(*x).exp();
                want_sum += want;
                let tol = 4e-7 * want + 1e-37;
                assert!((f64::from(*g) - want).abs() <= tol, "exp({x}) = {g}, want {want}");
            }
            assert!((f64::from(sum) - want_sum).abs() <= 1e-5 * want_sum);
        }
    }
}
