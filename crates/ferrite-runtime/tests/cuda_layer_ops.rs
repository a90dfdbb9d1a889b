//! The CUDA ops the roster families added (phi3, olmo2, granite, starcoder2) against the CPU
//! ops, on fresh random bf16 inputs, outputs NaN-poisoned: LayerNorm alone and fused with a
//! (scaled) residual add, the scaled RMSNorm add, a sublayer's own norm added to the residual
//! (RMS and Layer, with the residual multiplier and a scale), the plain residual add, plain
//! activations, the logits' scale and softcap, q/k RMSNorm over a whole projection, and RoPE
//! with a frequency table per token. Gated on `FERRITE_TEST_CUDA=1`.
//!
//! As in `cuda_ops`, inputs are bf16-exact and the GPU's systematic error is the final bf16
//! rounding (2^-9 relative): rtol 2^-8. Where a sum can cancel (residual adds), the bound also
//! has an absolute part: f32 noise of the addends, far below a bf16 ulp of them.

mod cuda_common;

use cuda_common::{compare, gpu, poisoned_bf16, rand_bf16, rng, to_f32};
use ferrite_runtime::cpu;
use ferrite_runtime::cuda::ops::{self, GatedActivation, NormWeights, QkvHeads, RopeShape};
use ferrite_runtime::cuda::{DevicePtr, DevicePtrMut};
use half::bf16;
use rand::Rng;

const RTOL: f32 = 1.0 / 256.0;

fn round(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// `norm` with LayerNorm and RMSNorm weights, alone and after a residual add scaled by 1 or
/// 1.4 (granite's multiplier): the stored sum is `s·x + r` rounded once (exactly the CPU's
/// bf16 sum at s = 1), and the output the CPU norm of the stored sum. d = 9000 takes the
/// kernel's wide-row path.
#[test]
fn cuda_norms_with_scaled_residual_match_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_norms_with_scaled_residual_match_cpu") else { return };
    let mut rng = rng("norms");
    for (rows, d) in [(1, 64), (7, 896), (3, 4095), (2, 9000)] {
        for layer in [false, true] {
            for residual in [None, Some(1.0f32), Some(1.4)] {
                let (xh, xf) = rand_bf16(&mut rng, rows * d, 2.0);
                let (_, rf) = rand_bf16(&mut rng, rows * d, 2.0);
                // An offset mean, so LayerNorm's centring matters.
                let rf: Vec<f32> = rf.iter().map(|v| round(v + 0.75)).collect();
                let rh: Vec<bf16> = rf.iter().map(|&v| bf16::from_f32(v)).collect();
                let w: Vec<f32> = (0..d).map(|_| rng.random_range(-1.5..1.5)).collect();
                let b: Vec<f32> = (0..d).map(|_| rng.random_range(-0.5..0.5)).collect();
                let eps = 1e-5;
                let (x_d, w_d, b_d) = (gpu.upload(&xh).unwrap(), gpu.upload(&w).unwrap(), gpu.upload(&b).unwrap());
                let mut res_d = gpu.upload(&rh).unwrap();
                let mut out = poisoned_bf16(gpu, rows * d);
                let bias = layer.then_some(&b_d as &dyn DevicePtr<f32>);
                let n = NormWeights::new(&w_d, bias, eps);
                let res = residual.map(|s| (&mut res_d as &mut dyn DevicePtrMut<bf16>, s));
                ops::norm(gpu, &x_d, res, n, (rows, d), &mut out).unwrap();
                let case = format!("[{rows},{d}] layer={layer} residual={residual:?}");
                let input = match residual {
                    Some(s) => {
                        let stored = to_f32(&gpu.download(&res_d).unwrap());
                        let sum: Vec<f32> = xf.iter().zip(&rf).map(|(x, r)| x * s + r).collect();
                        // At s = 1 the f32 sum of two bf16 values is exact: one rounding, the
                        // CPU's. Otherwise a fused multiply-add may differ from it by an f32 ulp.
                        let (want, rtol) =
                            if s == 1.0 { (sum.iter().map(|&v| round(v)).collect(), 0.0) } else { (sum, RTOL) };
                        compare("norm", &format!("{case} stored sum"), &stored, &want, 0.0, rtol);
                        stored
                    }
                    None => xf.clone(),
                };
                let mut want = vec![0f32; rows * d];
                if layer {
                    cpu::layer_norm(&input, &w, &b, eps, &mut want);
                } else {
                    cpu::rms_norm(&input, &w, eps, 0.0, &mut want);
                }
                compare("norm", &case, &to_f32(&gpu.download(&out).unwrap()), &want, 1e-5, RTOL);
            }
        }
    }
}

/// `x = (x + ys·norm(y))·scale` (post-norm and sandwich blocks) for RMSNorm and LayerNorm.
#[test]
fn cuda_norm_add_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_norm_add_matches_cpu") else { return };
    let mut rng = rng("norm_add");
    for (rows, d) in [(1, 64), (5, 896), (9, 2560)] {
        for layer in [false, true] {
            for (ys, scale) in [(1.0f32, 1.0f32), (1.4, 1.0), (1.0, 0.6), (0.7, 1.3)] {
                let (yh, yf) = rand_bf16(&mut rng, rows * d, 3.0);
                let (xh, xf) = rand_bf16(&mut rng, rows * d, 2.0);
                let w: Vec<f32> = (0..d).map(|_| rng.random_range(-1.5..1.5)).collect();
                let b: Vec<f32> = (0..d).map(|_| rng.random_range(-0.5..0.5)).collect();
                let eps = 1e-6;
                let mut normed = vec![0f32; rows * d];
                if layer {
                    cpu::layer_norm(&yf, &w, &b, eps, &mut normed);
                } else {
                    cpu::rms_norm(&yf, &w, eps, 0.0, &mut normed);
                }
                let want: Vec<f32> = xf.iter().zip(&normed).map(|(x, n)| (x + ys * n) * scale).collect();
                let (y_d, w_d, b_d) = (gpu.upload(&yh).unwrap(), gpu.upload(&w).unwrap(), gpu.upload(&b).unwrap());
                let mut x_d = gpu.upload(&xh).unwrap();
                let bias = layer.then_some(&b_d as &dyn DevicePtr<f32>);
                ops::norm_add(gpu, &y_d, NormWeights::new(&w_d, bias, eps), &mut x_d, (rows, d), ys, scale).unwrap();
                // The addends' f32 noise (~1e-6 of them) where they cancel, then the rounding.
                let atol = 1e-5 * (max_abs(&xf) + ys * max_abs(&normed)) * scale;
                let case = format!("[{rows},{d}] layer={layer} ys={ys} scale={scale}");
                compare("norm_add", &case, &to_f32(&gpu.download(&x_d).unwrap()), &want, atol, RTOL);
            }
        }
    }
}

/// `x += s·y`, rounded once.
#[test]
fn cuda_residual_add_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_residual_add_matches_cpu") else { return };
    let mut rng = rng("residual_add");
    for n in [1usize, 1000, 1 << 20] {
        for s in [1.0f32, 1.4] {
            let (xh, xf) = rand_bf16(&mut rng, n, 2.0);
            let (yh, yf) = rand_bf16(&mut rng, n, 2.0);
            let want: Vec<f32> = xf.iter().zip(&yf).map(|(x, y)| x + s * y).collect();
            let mut x_d = gpu.upload(&xh).unwrap();
            ops::residual_add(gpu, &gpu.upload(&yh).unwrap(), &mut x_d, n, s).unwrap();
            // The f32 sum is exact to ~1e-7 of the addends (they may cancel); then one rounding.
            let got = to_f32(&gpu.download(&x_d).unwrap());
            compare("residual_add", &format!("n={n} s={s}"), &got, &want, 1e-6, RTOL);
        }
    }
}

/// A plain MLP's activation in place, over a prefix of the buffer (the rest untouched).
#[test]
fn cuda_plain_activations_match_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_plain_activations_match_cpu") else { return };
    let mut rng = rng("plain_activation");
    for n in [1usize, 4871, 300_001] {
        for act in [GatedActivation::Silu, GatedActivation::GeluTanh] {
            let (xh, xf) = rand_bf16(&mut rng, n + 7, 6.0);
            let mut want = xf.clone();
            match act {
                GatedActivation::Silu => cpu::activation::silu(&mut want[..n]),
                GatedActivation::GeluTanh => cpu::activation::gelu_tanh(&mut want[..n]),
            }
            let mut x_d = gpu.upload(&xh).unwrap();
            ops::activation(gpu, act, &mut x_d, n).unwrap();
            let got = to_f32(&gpu.download(&x_d).unwrap());
            // expf/tanhf differ from Rust's by a few f32 ulps; the rest is the bf16 rounding.
            compare("activation", &format!("{act:?} n={n}"), &got[..n], &want[..n], 1e-6, RTOL);
            compare("activation", &format!("{act:?} n={n} tail untouched"), &got[n..], &want[n..], 0.0, 0.0);
        }
    }
}

/// The logits' epilogue: the scale (granite), the softcap (Gemma), both, in that order.
#[test]
fn cuda_logit_scale_and_softcap_match_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_logit_scale_and_softcap_match_cpu") else { return };
    let mut rng = rng("logit_epilogue");
    let n = 3 * 32_001;
    let logits: Vec<f32> = (0..n).map(|_| rng.random_range(-60.0..60.0)).collect();
    for (scale, cap) in [(0.8f32, None), (1.0, Some(30.0f32)), (0.8, Some(30.0))] {
        let mut want: Vec<f32> = logits.iter().map(|v| v * scale).collect();
        if let Some(c) = cap {
            cpu::activation::softcap(&mut want, c);
        }
        let mut x_d = gpu.upload(&logits).unwrap();
        ops::scale_softcap(gpu, &mut x_d, n, scale, cap).unwrap();
        // f32 throughout: tanhf vs Rust's tanh, a few ulps of the cap.
        let case = format!("scale={scale} cap={cap:?}");
        compare("logit epilogue", &case, &gpu.download(&x_d).unwrap(), &want, 1e-5 * cap.unwrap_or(1.0), 1e-6);
    }
    assert!(ops::scale_softcap(gpu, &mut gpu.upload(&logits).unwrap(), n, 1.0, Some(0.0)).is_err());
}

/// OLMo 2's q/k norm: one RMSNorm over each token's whole q projection and one over its whole
/// k projection (a "head" as wide as each, the k one at its offset in the fused QKV row); the
/// v heads stay as they were.
#[test]
fn cuda_whole_projection_qk_norm_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_whole_projection_qk_norm_matches_cpu") else { return };
    let mut rng = rng("qk_norm_whole");
    for (tokens, nq, nkv, hd) in [(1, 4, 2, 16), (9, 32, 8, 128), (33, 40, 8, 128)] {
        let (qw, kw) = (nq * hd, nkv * hd);
        let width = qw + 2 * kw;
        let (qkv_h, qkv_f) = rand_bf16(&mut rng, tokens * width, 2.0);
        let wq: Vec<f32> = (0..qw).map(|_| rng.random_range(0.5..1.5)).collect();
        let wk: Vec<f32> = (0..kw).map(|_| rng.random_range(0.5..1.5)).collect();
        let eps = 1e-6;
        let part = |from: usize, len: usize| -> Vec<f32> {
            qkv_f.chunks(width).flat_map(|r| r[from..from + len].to_vec()).collect()
        };
        let (mut want_q, mut want_k) = (vec![0f32; tokens * qw], vec![0f32; tokens * kw]);
        cpu::rms_norm(&part(0, qw), &wq, eps, 0.0, &mut want_q);
        cpu::rms_norm(&part(qw, kw), &wk, eps, 0.0, &mut want_k);
        let mut qkv_d = gpu.upload(&qkv_h).unwrap();
        let (wq_d, wk_d) = (gpu.upload(&wq).unwrap(), gpu.upload(&wk).unwrap());
        let whole = |w: usize| QkvHeads { tokens, stride: width, head_dim: w, n_q: 1, n_k: 0, n_v: 0 };
        ops::qkv_norm(gpu, &mut qkv_d, whole(qw), Some(&wq_d as &dyn DevicePtr<f32>), None, eps).unwrap();
        let wk_dyn = Some(&wk_d as &dyn DevicePtr<f32>);
        ops::qkv_norm(gpu, &mut qkv_d.slice_mut(qw..), whole(kw), wk_dyn, None, eps).unwrap();
        let got = to_f32(&gpu.download(&qkv_d).unwrap());
        let got_part = |from: usize, len: usize| -> Vec<f32> {
            got.chunks(width).flat_map(|r| r[from..from + len].to_vec()).collect()
        };
        let case = format!("t={tokens} {nq}/{nkv}x{hd}");
        compare("qk_norm_whole", &format!("{case} q"), &got_part(0, qw), &want_q, 1e-6, RTOL);
        compare("qk_norm_whole", &format!("{case} k"), &got_part(qw, kw), &want_k, 1e-6, RTOL);
        compare("qk_norm_whole", &format!("{case} v untouched"), &got_part(qw + kw, kw), &part(qw + kw, kw), 0.0, 0.0);
    }
}

/// RoPE with a frequency table per token (dynamic NTK, long RoPE): each token rotated by its
/// table as the CPU rotates it, partial rotary included; the v heads untouched.
#[test]
fn cuda_rope_per_token_tables_match_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_rope_per_token_tables_match_cpu") else { return };
    let mut rng = rng("rope_per_token");
    for (tokens, nq, nkv, hd, rotary, n_tables) in
        [(1, 4, 2, 16, 12, 1), (37, 8, 4, 128, 96, 3), (200, 24, 8, 128, 128, 2)]
    {
        let scaling = 1.183_216f32;
        let width = (nq + 2 * nkv) * hd;
        let half = rotary / 2;
        let (qkv_h, qkv_f) = rand_bf16(&mut rng, tokens * width, 1.0);
        let positions: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..40_000)).collect();
        let tables: Vec<Vec<f32>> = (0..n_tables)
            .map(|_| {
                (0..half)
                    .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / rotary as f32) / rng.random_range(1.0..20.0))
                    .collect()
            })
            .collect();
        let table_of: Vec<i32> = (0..tokens).map(|_| rng.random_range(0..tables.len()) as i32).collect();
        let mut want = qkv_f.clone();
        for (t, row) in want.chunks_mut(width).enumerate() {
            let r = cpu::Rope::new(tables[table_of[t] as usize].clone(), scaling);
            r.apply(&mut row[..(nq + nkv) * hd], &positions[t..t + 1], nq + nkv, hd);
        }
        let mut qkv_d = gpu.upload(&qkv_h).unwrap();
        let flat: Vec<f32> = tables.concat();
        let (pos_d, tab_d, of_d) =
            (gpu.upload(&positions).unwrap(), gpu.upload(&flat).unwrap(), gpu.upload(&table_of).unwrap());
        let shape = RopeShape { tokens, n_heads: nq + nkv, head_dim: hd, stride: width };
        ops::rope_per_token(gpu, &mut qkv_d, &pos_d, (&tab_d, half, &of_d), scaling, shape, None).unwrap();
        let got = to_f32(&gpu.download(&qkv_d).unwrap());
        // As `cuda_rope_matches_cpu`: relative to the inputs (|x| < 1) times the scaling.
        let case = format!("t={tokens} {nq}/{nkv}x{hd} rot={rotary} tables={n_tables}");
        compare("rope per token", &case, &got, &want, 4e-3 * scaling, RTOL);
    }
}
