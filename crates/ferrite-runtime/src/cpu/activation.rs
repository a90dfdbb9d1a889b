//! Activations, in place: SwiGLU (`silu(gate) * up`), GeGLU with the tanh GELU or the exact
//! (erf) GELU, the same activations ungated (a plain MLP); and Gemma's logit softcap.
//!
//! SwiGLU runs eight lanes at a time with the attention kernels' `exp` (relative error
//! < 2e-7) where the kernel mode has AVX2: with libm's scalar `expf` it took ~1 ms of each
//! SmolLM2 step at 8 rows, serial code the other workers wait through.

use rayon::prelude::*;

use super::qmatmul::{kernel_mode, Level};

const PAR_MIN: usize = 1 << 14;

/// `gate = silu(gate) * up`, element-wise.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if kernel_mode().level().is_some_and(|l| l >= Level::Avx2) {
        assert!(gate.len() == up.len(), "gated activation lengths differ");
        // SAFETY: every level from AVX2 up guarantees AVX2 and FMA; the slices have equal
        // lengths.
        let body = |(g, u): (&mut [f32], &[f32])| unsafe { silu_mul_avx2(g, u) };
        if gate.len() >= PAR_MIN {
            gate.par_chunks_mut(PAR_MIN / 4).zip(up.par_chunks(PAR_MIN / 4)).for_each(body);
        } else {
            body((gate, up));
        }
        return;
    }
    apply(gate, up, |g| g / (1.0 + (-g).exp()));
}

/// `silu_mul` for equal-length slices, eight lanes at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate: &mut [f32], up: &[f32]) {
    use std::arch::x86_64::*;
    let n = gate.len() / 8 * 8;
    for i in (0..n).step_by(8) {
        let g = _mm256_loadu_ps(gate.as_ptr().add(i));
        // e^-g overflows past 88; there silu(g) is 0 to within 1e-36 either way.
        let e = super::qmatmul::isa::exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(88.0)));
        let s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e));
        _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(s, _mm256_loadu_ps(up.as_ptr().add(i))));
    }
    for (g, u) in gate[n..].iter_mut().zip(&up[n..]) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// The tanh approximation of GELU that `gelu_pytorch_tanh` uses.
fn gelu_tanh_of(g: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * g * (1.0 + (SQRT_2_OVER_PI * (g + 0.044_715 * g * g * g)).tanh())
}

/// `gate = gelu_tanh(gate) * up`.
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    apply(gate, up, gelu_tanh_of);
}

/// `x = gelu_tanh(x)` (a plain, ungated MLP).
pub fn gelu_tanh(x: &mut [f32]) {
    map(x, gelu_tanh_of);
}

/// Abramowitz & Stegun 7.1.26: for `z ≥ 0`, `erfc(z) ≈ t (a1 + a2 t + … + a5 t⁴) e^{−z²}` with
/// `t = 1 / (1 + p z)`, |error| ≤ 1.5e-7.
const ERF_P: f32 = 0.327_591_1;
const ERF_A: [f32; 5] = [0.254_829_6, -0.284_496_74, 1.421_413_8, -1.453_152, 1.061_405_4];

/// The exact GELU, `x Φ(x) = x (1 + erf(x / √2)) / 2` (HF's `gelu`, BERT's), with erf as
/// above: `2Φ(x)` is `erfc(|x| / √2)` below 0 and `2 − erfc(x / √2)` above, so no digits cancel
/// in the negative tail. Within 3e-7 · |x| of the true value.
fn gelu_of(g: f32) -> f32 {
    let z = g.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + ERF_P * z);
    let poly = ERF_A.iter().rev().fold(0.0, |acc, &a| acc * t + a) * t;
    let tail = poly * (-z * z).exp();
    0.5 * g * if g < 0.0 { tail } else { 2.0 - tail }
}

/// `gate = gelu(gate) * up` (exact GELU).
pub fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    apply(gate, up, gelu_of);
}

/// `x = gelu(x)`, the exact GELU (a plain, ungated MLP), eight lanes at a time where the
/// kernel mode has AVX2.
pub fn gelu(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if kernel_mode().level().is_some_and(|l| l >= Level::Avx2) {
        // SAFETY: every level from AVX2 up guarantees AVX2 and FMA.
        let body = |x: &mut [f32]| unsafe { gelu_avx2(x) };
        if x.len() >= PAR_MIN {
            x.par_chunks_mut(PAR_MIN / 4).for_each(body);
        } else {
            body(x);
        }
        return;
    }
    map(x, gelu_of);
}

/// `gelu` eight lanes at a time (`gelu_of`'s arithmetic with the attention kernels' `exp`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_avx2(x: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = x.len() / 8 * 8;
    let one = _mm256_set1_ps(1.0);
    for i in (0..n).step_by(8) {
        let g = _mm256_loadu_ps(x.as_ptr().add(i));
        let z =
            _mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0), g), _mm256_set1_ps(std::f32::consts::FRAC_1_SQRT_2));
        let t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(ERF_P), z, one));
        let mut poly = _mm256_set1_ps(ERF_A[4]);
        for a in ERF_A[..4].iter().rev() {
            poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(*a));
        }
        poly = _mm256_mul_ps(poly, t);
        let tail =
            _mm256_mul_ps(poly, super::qmatmul::isa::exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(z, z))));
        // The sign bit of g picks `tail` (below 0) over `2 − tail`.
        let two_phi = _mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(2.0), tail), tail, g);
        _mm256_storeu_ps(x.as_mut_ptr().add(i), _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5), g), two_phi));
    }
    for v in &mut x[n..] {
        *v = gelu_of(*v);
    }
}

/// `x = silu(x)` (a plain, ungated MLP).
pub fn silu(x: &mut [f32]) {
    map(x, |g| g / (1.0 + (-g).exp()));
}

/// `x = cap * tanh(x / cap)`, element-wise (Gemma's final-logit softcapping).
pub fn softcap(x: &mut [f32], cap: f32) {
    map(x, |v| cap * (v / cap).tanh());
}

fn map(x: &mut [f32], f: impl Fn(f32) -> f32 + Sync) {
    let body = |v: &mut f32| *v = f(*v);
    if x.len() >= PAR_MIN {
        x.par_iter_mut().for_each(body);
    } else {
        x.iter_mut().for_each(body);
    }
}

fn apply(gate: &mut [f32], up: &[f32], f: impl Fn(f32) -> f32 + Sync) {
    assert!(gate.len() == up.len(), "gated activation lengths differ");
    let body = |(g, u): (&mut f32, &f32)| *g = f(*g) * *u;
    if gate.len() >= PAR_MIN {
        gate.par_iter_mut().zip(up.par_iter()).for_each(body);
    } else {
        gate.iter_mut().zip(up.iter()).for_each(body);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SIMD SwiGLU against f64, over the range where its `exp` saturates and beyond.
    #[test]
    fn silu_mul_matches_f64() {
        let gate: Vec<f32> = (0..4003).map(|i| -120.0 + i as f32 * 0.06).collect();
        let up: Vec<f32> = (0..gate.len()).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
        let mut got = gate.clone();
        silu_mul(&mut got, &up);
        for ((g, u), r) in gate.iter().zip(&up).zip(&got) {
            let (g, u) = (f64::from(*g), f64::from(*u));
            let want = g / (1.0 + (-g).exp()) * u;
            assert!((f64::from(*r) - want).abs() <= 1e-6 * want.abs() + 1e-30, "silu({g}) * {u} = {r}, want {want}");
        }
    }

    /// The exact GELU (SIMD and scalar) against f64 `x Φ(x)` over the range activations reach
    /// and beyond, and apart from the tanh form.
    #[test]
    fn gelu_is_the_erf_form() {
        let xs: Vec<f32> = (0..4003).map(|i| -30.0 + i as f32 * 0.015).collect();
        let exact = |x: f32| {
            let x = f64::from(x);
            0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2))
        };
        let mut simd = xs.clone();
        gelu(&mut simd);
        for (x, got) in xs.iter().zip(&simd) {
            let (want, scalar) = (exact(*x), gelu_of(*x));
            for (what, v) in [("gelu", *got), ("gelu_of", scalar)] {
                let bound = 3e-7 * f64::from(x.abs()) + 1.2e-7 * want.abs() + 1e-30;
                assert!((f64::from(v) - want).abs() <= bound, "{what}({x}) = {v}, want {want}");
            }
        }
        let mut t = vec![1.0f32];
        gelu_tanh(&mut t);
        assert!((f64::from(t[0]) - exact(1.0)).abs() > 1e-5, "the tanh form differs from the exact one at 1");
        let (mut gate, up) = (vec![1.0f32, 3.0], vec![2.0f32, -1.0]);
        gelu_mul(&mut gate, &up);
        assert!((f64::from(gate[0]) - 2.0 * exact(1.0)).abs() < 1e-6 && (f64::from(gate[1]) + exact(3.0)).abs() < 1e-6);
    }

    #[test]
    fn softcap_bounds_and_keeps_small_values() {
        let mut x = vec![0.0, 1e-3, -1e-3, 30.0, -1e6];
        softcap(&mut x, 10.0);
        assert_eq!(x[0], 0.0);
        assert!((x[1] - 1e-3).abs() < 1e-9 && (x[2] + 1e-3).abs() < 1e-9);
        assert!((x[3] - 10.0 * 3f32.tanh()).abs() < 1e-6);
        assert_eq!(x[4], -10.0);
    }
}
