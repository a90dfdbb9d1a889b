//! Gated activations, in place on the gate: SwiGLU (`silu(gate) * up`) and GeGLU with the
//! tanh GELU.

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

fn apply(gate: &mut [f32], up: &[f32], f: impl Fn(f32) -> f32 + Sync) {
    assert!(gate.len() == up.len(), "gated activation lengths differ");
    let body = |(g, u): (&mut f32, &f32)| *g = f(*g) * *u;
    if gate.len() >= PAR_MIN {
        gate.par_iter_mut().zip(up.par_iter()).for_each(body);
    } else {
        gate.iter_mut().zip(up.iter()).for_each(body);
    }
}
