//! Gated activations, in place on the gate: SwiGLU (`silu(gate) * up`) and GeGLU with the
//! tanh GELU; and Gemma's logit softcap.

use rayon::prelude::*;

const PAR_MIN: usize = 1 << 14;

/// `gate = silu(gate) * up`, element-wise.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    apply(gate, up, |g| g / (1.0 + (-g).exp()));
}

/// `gate = gelu_tanh(gate) * up`, the approximation `gelu_pytorch_tanh` uses.
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    apply(gate, up, |g| 0.5 * g * (1.0 + (SQRT_2_OVER_PI * (g + 0.044_715 * g * g * g)).tanh()));
}

/// `x = cap * tanh(x / cap)`, element-wise (Gemma's final-logit softcapping).
pub fn softcap(x: &mut [f32], cap: f32) {
    let body = |v: &mut f32| *v = cap * (*v / cap).tanh();
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
