//! Gated activations: SwiGLU (`silu(gate) * up`) and GeGLU with the tanh GELU.

use rayon::prelude::*;

const PAR_MIN: usize = 1 << 14;

/// `out = silu(gate) * up`, element-wise. `out` may alias nothing; all three have one length.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    apply(gate, up, out, |g| g / (1.0 + (-g).exp()));
}

/// `out = gelu_tanh(gate) * up`, the approximation `gelu_pytorch_tanh` uses.
pub fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    apply(gate, up, out, |g| 0.5 * g * (1.0 + (SQRT_2_OVER_PI * (g + 0.044_715 * g * g * g)).tanh()));
}

fn apply(gate: &[f32], up: &[f32], out: &mut [f32], f: impl Fn(f32) -> f32 + Sync) {
    assert!(gate.len() == out.len() && up.len() == out.len(), "gated activation lengths differ");
    let body = |(o, (g, u)): (&mut f32, (&f32, &f32))| *o = f(*g) * *u;
    if out.len() >= PAR_MIN {
        out.par_iter_mut().zip(gate.par_iter().zip(up.par_iter())).for_each(body);
    } else {
        out.iter_mut().zip(gate.iter().zip(up.iter())).for_each(body);
    }
}
