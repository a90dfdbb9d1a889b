//! CUDA element-wise ops and GEMMs against the CPU ops, on fresh random bf16 inputs with odd
//! shapes, outputs NaN-poisoned before each run. Gated on `FERRITE_TEST_CUDA=1`.
//!
//! Inputs are bf16-exact, so the CPU (f32) and GPU (f32 math, bf16 out) see the same values;
//! the GPU's only systematic error is the final rounding to bf16, at most 2^-9 relative
//! (half an ulp of an 8-bit mantissa). Hence rtol = 2^-8 for row ops (the rounding plus f32
//! summation-order noise far below it) and exact equality where nothing is computed.

mod cuda_common;

use std::sync::Arc;

use cuda_common::{compare, gpu, poisoned_bf16, poisoned_f32, rand_bf16, rng, to_f32};
use ferrite_runtime::cpu;
use ferrite_runtime::cuda::ops::{self, GatedActivation, RopeShape};
use ferrite_runtime::cuda::DevicePtr;
use ferrite_runtime::{Buffer, DType, Tensor};
use half::bf16;
use rand::Rng;

const RTOL: f32 = 1.0 / 256.0;

fn bf16_tensor(rows: usize, cols: usize, v: &[bf16]) -> Tensor {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    Tensor::new(DType::BF16, vec![rows, cols], Buffer::Bytes(Arc::new(bytes))).expect("tensor")
}

#[test]
fn cuda_embedding_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_embedding_matches_cpu") else { return };
    let mut rng = rng("embedding");
    for (vocab, dim, tokens) in [(1000, 65, 1), (1003, 896, 37), (50, 2081, 300)] {
        let (th, tf) = rand_bf16(&mut rng, vocab * dim, 1.0);
        let ids: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..vocab as u32)).collect();
        let mut want = vec![0f32; tokens * dim];
        cpu::embedding(&bf16_tensor(vocab, dim, &th), &ids, &mut want).unwrap();
        let ids_d = gpu.upload(&ids).unwrap();
        for scale in [1.0f32, 3.7] {
            let want_s: Vec<f32> = want.iter().map(|v| v * scale).collect();
            // bf16 table: a gather (exact at scale 1) then one rounding.
            let mut out = poisoned_bf16(gpu, tokens * dim);
            ops::embedding(gpu, &gpu.upload(&th).unwrap(), (vocab, dim), &ids_d, tokens, scale, &mut out).unwrap();
            let rtol = if scale == 1.0 { 0.0 } else { RTOL };
            compare(
                "embedding",
                &format!("bf16 [{vocab},{dim}] t={tokens} s={scale}"),
                &to_f32(&gpu.download(&out).unwrap()),
                &want_s,
                0.0,
                rtol,
            );
            // f32 table: the rounding to bf16 activations.
            let mut out = poisoned_bf16(gpu, tokens * dim);
            ops::embedding(gpu, &gpu.upload(&tf).unwrap(), (vocab, dim), &ids_d, tokens, scale, &mut out).unwrap();
            compare(
                "embedding",
                &format!("f32 [{vocab},{dim}] t={tokens} s={scale}"),
                &to_f32(&gpu.download(&out).unwrap()),
                &want_s,
                0.0,
                RTOL,
            );
        }
    }
}

#[test]
fn cuda_rms_norm_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_rms_norm_matches_cpu") else { return };
    let mut rng = rng("rms_norm");
    for (rows, d) in [(1, 64), (7, 896), (33, 4095), (5, 8192)] {
        for (offset, with_residual) in [(0.0f32, false), (0.0, true), (1.0, true)] {
            let (xh, xf) = rand_bf16(&mut rng, rows * d, 2.0);
            let (rh, rf) = rand_bf16(&mut rng, rows * d, 2.0);
            let w: Vec<f32> = (0..d).map(|_| rng.random_range(-1.5..1.5)).collect();
            let eps = 1e-6;
            // The residual the kernel stores is bf16(x + r); that sum is what gets normalized.
            let summed: Vec<f32> = xf.iter().zip(&rf).map(|(a, b)| bf16::from_f32(a + b).to_f32()).collect();
            let input = if with_residual { &summed } else { &xf };
            let mut want = vec![0f32; rows * d];
            cpu::rms_norm(input, &w, eps, offset, &mut want);
            let (x_d, w_d) = (gpu.upload(&xh).unwrap(), gpu.upload(&w).unwrap());
            let mut res_d = gpu.upload(&rh).unwrap();
            let mut out = poisoned_bf16(gpu, rows * d);
            let residual: Option<&mut dyn ferrite_runtime::cuda::DevicePtrMut<bf16>> =
                if with_residual { Some(&mut res_d) } else { None };
            ops::rms_norm(gpu, &x_d, residual, &w_d, (rows, d), eps, offset, &mut out).unwrap();
            let case = format!("[{rows},{d}] offset={offset} residual={with_residual}");
            compare("rms_norm", &case, &to_f32(&gpu.download(&out).unwrap()), &want, 1e-6, RTOL);
            if with_residual {
                compare(
                    "rms_norm",
                    &format!("{case} stored sum"),
                    &to_f32(&gpu.download(&res_d).unwrap()),
                    &summed,
                    0.0,
                    0.0,
                );
            }
        }
    }
}

/// RoPE on the q and k heads of one fused QKV buffer (rows of (nq + 2 nkv) * hd values) in
/// one call; the v heads must come back untouched.
#[test]
fn cuda_rope_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_rope_matches_cpu") else { return };
    let mut rng = rng("rope");
    for (tokens, nq, nkv, hd, rotary) in
        [(1, 9, 3, 64, 64), (5, 32, 8, 128, 128), (37, 8, 4, 256, 64), (3, 9, 3, 128, 32)]
    {
        for scaling in [1.0f32, 1.2] {
            let width = (nq + 2 * nkv) * hd;
            let (qkv_h, qkv_f) = rand_bf16(&mut rng, tokens * width, 1.0);
            let positions: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..40_000)).collect();
            let inv_freq: Vec<f32> = (0..rotary / 2)
                .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / rotary as f32) * rng.random_range(0.5..1.0))
                .collect();
            let r = cpu::Rope::new(inv_freq.clone(), scaling);
            let mut q: Vec<f32> = qkv_f.chunks(width).flat_map(|t| t[..nq * hd].to_vec()).collect();
            let mut k: Vec<f32> = qkv_f.chunks(width).flat_map(|t| t[nq * hd..(nq + nkv) * hd].to_vec()).collect();
            r.apply(&mut q, &positions, nq, hd);
            r.apply(&mut k, &positions, nkv, hd);
            let mut qkv_d = gpu.upload(&qkv_h).unwrap();
            let (pos_d, f_d) = (gpu.upload(&positions).unwrap(), gpu.upload(&inv_freq).unwrap());
            let shape = RopeShape { tokens, n_heads: nq + nkv, head_dim: hd, stride: width };
            ops::rope(gpu, &mut qkv_d, &pos_d, &f_d, scaling, shape, None).unwrap();
            let got = to_f32(&gpu.download(&qkv_d).unwrap());
            let got_q: Vec<f32> = got.chunks(width).flat_map(|t| t[..nq * hd].to_vec()).collect();
            let got_k: Vec<f32> = got.chunks(width).flat_map(|t| t[nq * hd..(nq + nkv) * hd].to_vec()).collect();
            let got_v: Vec<f32> = got.chunks(width).flat_map(|t| t[(nq + nkv) * hd..].to_vec()).collect();
            let want_v: Vec<f32> = qkv_f.chunks(width).flat_map(|t| t[(nq + nkv) * hd..].to_vec()).collect();
            // a·cos − b·sin can cancel, so the bound is relative to the inputs (|x| < 1): half
            // a bf16 ulp of 1 plus the rounding of the result; sin/cos of the same f32 angle
            // agree to a few f32 ulps.
            let case = format!("t={tokens} {nq}/{nkv}x{hd} rot={rotary} s={scaling}");
            compare("rope", &format!("{case} q"), &got_q, &q, 4e-3 * scaling, RTOL);
            compare("rope", &format!("{case} k"), &got_k, &k, 4e-3 * scaling, RTOL);
            compare("rope", &format!("{case} v untouched"), &got_v, &want_v, 0.0, 0.0);
        }
    }
}

#[test]
fn cuda_gated_activations_match_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_gated_activations_match_cpu") else { return };
    let mut rng = rng("gated");
    for (tokens, inter) in [(1, 11), (3, 896), (17, 4871)] {
        for act in [GatedActivation::Silu, GatedActivation::GeluTanh] {
            // A fused gate_up buffer: rows of [gate | up].
            let (gu_h, gu_f) = rand_bf16(&mut rng, tokens * 2 * inter, 4.0);
            let mut gate: Vec<f32> = gu_f.chunks(2 * inter).flat_map(|r| r[..inter].to_vec()).collect();
            let up: Vec<f32> = gu_f.chunks(2 * inter).flat_map(|r| r[inter..].to_vec()).collect();
            match act {
                GatedActivation::Silu => cpu::silu_mul(&mut gate, &up),
                GatedActivation::GeluTanh => cpu::gelu_tanh_mul(&mut gate, &up),
            }
            let gu_d = gpu.upload(&gu_h).unwrap();
            let mut out = poisoned_bf16(gpu, tokens * inter);
            ops::gated_activation(
                gpu,
                act,
                &gu_d.slice(..),
                &gu_d.slice(inter..),
                (tokens, inter, 2 * inter),
                &mut out,
            )
            .unwrap();
            // expf/tanhf differ from Rust's by a few f32 ulps; the rest is the bf16 rounding.
            compare(
                "gated",
                &format!("{act:?} [{tokens},{inter}]"),
                &to_f32(&gpu.download(&out).unwrap()),
                &gate,
                1e-6,
                RTOL,
            );
        }
    }
}

/// The gated MLP's gate-up projection and activation in one op: against the CPU's linear
/// then activation (gate and up rounded to bf16, as the GPU stores them), and bit for bit
/// against the two GPU ops it replaces. m ≤ 8 takes the skinny GEMM with the activation as its
/// epilogue (n odd: a block's second output past the end); m = 13 falls back to the two ops.
#[test]
fn cuda_linear_gated_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_linear_gated_matches_cpu") else { return };
    let mut rng = rng("linear_gated");
    for (m, n, k) in [(1, 64, 64), (3, 1001, 968), (8, 130, 4096), (13, 96, 872), (2, 7, 16)] {
        for act in [GatedActivation::Silu, GatedActivation::GeluTanh] {
            let (xh, xf) = rand_bf16(&mut rng, m * k, 1.0);
            let (wh, _) = rand_bf16(&mut rng, 2 * n * k, 1.0);
            let mut gu = vec![0f32; m * 2 * n];
            cpu::linear(&xf, m, &bf16_tensor(2 * n, k, &wh), None, &mut gu).unwrap();
            let gu: Vec<f32> = gu.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
            let mut want: Vec<f32> = gu.chunks(2 * n).flat_map(|r| r[..n].to_vec()).collect();
            let up: Vec<f32> = gu.chunks(2 * n).flat_map(|r| r[n..].to_vec()).collect();
            match act {
                GatedActivation::Silu => cpu::silu_mul(&mut want, &up),
                GatedActivation::GeluTanh => cpu::gelu_tanh_mul(&mut want, &up),
            }
            let (x_d, w_d) = (gpu.upload(&xh).unwrap(), gpu.upload(&wh).unwrap());
            let mut scratch = poisoned_bf16(gpu, m * 2 * n);
            let mut y = poisoned_bf16(gpu, m * n);
            ops::linear_gated(gpu, act, &x_d, &w_d, &mut scratch, &mut y, (m, n, k)).unwrap();
            let got = to_f32(&gpu.download(&y).unwrap());
            // g and u may round to neighbouring bf16 values on the two sides (f32 sums in
            // different orders, ~1e-6·k apart): act(g)·u then moves by ≤ 2^-7 of |g|+|u|
            // (the activation's slope is ≤ 1.1), beyond the output's own rounding.
            let case = format!("{act:?} m={m} n={n} k={k}");
            let gmax = gu.iter().fold(0f32, |s, v| s.max(v.abs()));
            compare("linear_gated", &case, &got, &want, 1e-6 * k as f32 + gmax * gmax / 64.0, RTOL);
            let mut gu_d = poisoned_bf16(gpu, m * 2 * n);
            ops::linear::<bf16>(gpu, &x_d, &w_d, None, &mut gu_d, (m, 2 * n, k)).unwrap();
            let mut y2 = poisoned_bf16(gpu, m * n);
            ops::gated_activation(gpu, act, &gu_d.slice(..), &gu_d.slice(n..), (m, n, 2 * n), &mut y2).unwrap();
            compare(
                "linear_gated",
                &format!("{case} == two ops"),
                &got,
                &to_f32(&gpu.download(&y2).unwrap()),
                0.0,
                0.0,
            );
        }
    }
}

/// cuBLASLt `y = x·Wᵀ (+ b)` against the CPU's bf16-weight linear. Both accumulate in f32 in
/// different orders: the difference is bounded by a few f32 ulps of Σ|x·w|, plus the bf16
/// rounding of a bf16 output.
#[test]
fn cuda_linear_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_linear_matches_cpu") else { return };
    let mut rng = rng("linear");
    for (m, n, k) in [(1, 64, 64), (7, 1001, 968), (128, 896, 4096), (333, 4104, 896)] {
        let (xh, xf) = rand_bf16(&mut rng, m * k, 1.0);
        let (wh, _) = rand_bf16(&mut rng, n * k, 1.0);
        let (bh, bf) = rand_bf16(&mut rng, n, 1.0);
        let mut want = vec![0f32; m * n];
        cpu::linear(&xf, m, &bf16_tensor(n, k, &wh), Some(&bf), &mut want).unwrap();
        let (x_d, w_d) = (gpu.upload(&xh).unwrap(), gpu.upload(&wh).unwrap());
        // |y| ~ sqrt(k)/3 here; two f32 summation orders differ by ~sqrt(k) ulps of the
        // partial sums (~1e-4 at k = 4096): 1e-6·k leaves a 40x margin.
        let atol = 1e-6 * k as f32;
        // f32 output with an f32 bias.
        let b32 = gpu.upload(&bf).unwrap();
        let mut y = poisoned_f32(gpu, m * n);
        ops::linear(gpu, &x_d, &w_d, Some(&b32 as &dyn DevicePtr<f32>), &mut y, (m, n, k)).unwrap();
        compare("linear", &format!("m={m} n={n} k={k} f32+bias"), &gpu.download(&y).unwrap(), &want, atol, 1e-5);
        // The product without bias, for the no-bias case and the bias case's bound.
        let mut want_nb = vec![0f32; m * n];
        cpu::linear(&xf, m, &bf16_tensor(n, k, &wh), None, &mut want_nb).unwrap();
        // bf16 output with a bf16 bias. cuBLASLt's bias epilogue may round the product to bf16
        // before adding the bias: a second rounding, of up to 2^-9 of |x·w| (which the bias can
        // cancel), on top of the output's.
        let b16 = gpu.upload(&bh).unwrap();
        let mut y = poisoned_bf16(gpu, m * n);
        ops::linear(gpu, &x_d, &w_d, Some(&b16 as &dyn DevicePtr<bf16>), &mut y, (m, n, k)).unwrap();
        let got = to_f32(&gpu.download(&y).unwrap());
        let max_xw = want_nb.iter().fold(0f32, |a, v| a.max(v.abs()));
        compare("linear", &format!("m={m} n={n} k={k} bf16+bias"), &got, &want, atol + max_xw / 512.0, RTOL);
        // No bias.
        let mut y = poisoned_bf16(gpu, m * n);
        ops::linear::<bf16>(gpu, &x_d, &w_d, None, &mut y, (m, n, k)).unwrap();
        compare(
            "linear",
            &format!("m={m} n={n} k={k} bf16"),
            &to_f32(&gpu.download(&y).unwrap()),
            &want_nb,
            atol,
            RTOL,
        );
    }
}

#[test]
fn cuda_copy_and_argmax_are_exact() {
    let Some((gpu, _checks)) = gpu("cuda_copy_and_argmax_are_exact") else { return };
    let mut rng = rng("argmax");
    let src: Vec<f32> = (0..(1 << 20) + 4).map(|_| rng.random()).collect();
    let mut dst = poisoned_f32(gpu, src.len());
    ops::copy(gpu, &gpu.upload(&src).unwrap(), &mut dst).unwrap();
    compare("copy", &format!("{} f32", src.len()), &gpu.download(&dst).unwrap(), &src, 0.0, 0.0);
    for (rows, vocab) in [(1, 1000), (5, 32_001), (64, 151_936)] {
        let mut logits: Vec<f32> = (0..rows * vocab).map(|_| rng.random_range(-20.0..20.0)).collect();
        // Ties (first index wins), NaN (never wins), -inf, and an all-NaN row (index 0).
        for r in 0..rows {
            let row = &mut logits[r * vocab..(r + 1) * vocab];
            let (a, b) = (rng.random_range(0..vocab), rng.random_range(0..vocab));
            row[a] = 50.0;
            row[b] = 50.0;
            row[rng.random_range(0..vocab)] = f32::NAN;
            row[rng.random_range(0..vocab)] = f32::NEG_INFINITY;
        }
        if rows > 1 {
            logits[vocab..2 * vocab].fill(f32::NAN);
        }
        let want: Vec<f32> = logits.chunks(vocab).map(|r| cpu::argmax(r) as f32).collect();
        let mut out = gpu.upload(&vec![u32::MAX; rows]).unwrap();
        let mut scratch = ops::ArgmaxScratch::new(gpu, rows).unwrap();
        let logits = gpu.upload(&logits).unwrap();
        // Twice over one scratch: the kernel must leave it cleared.
        for call in 0..2 {
            ops::argmax(gpu, &logits, (rows, vocab, vocab), &mut scratch, &mut out).unwrap();
            let got: Vec<f32> = gpu.download(&out).unwrap().iter().map(|&i| i as f32).collect();
            compare("argmax", &format!("{rows}x{vocab} ties+NaN, call {call}"), &got, &want, 0.0, 0.0);
        }
    }
}
