//! The quantized CUDA kernels against the CPU's dequantization and matmul, on fresh random
//! GGUF blocks of every type the GPU reads, odd shapes, outputs NaN-poisoned before each run.
//! Gated on `FERRITE_TEST_CUDA=1`.
//!
//! The GPU's dequantization makes the same single rounding as the CPU's (`quant.cuh`), so the
//! dequantized rows and the embedding gather are compared exactly. The skinny GEMM's products
//! differ from the CPU's f32 `Σ w·x` only in summation order (it sums `a·Σq·x + b·Σx` per 8
//! values): within 1e-6·k·max|w| for |x| ≤ 1, plus the bf16 rounding of a bf16 output. The
//! many-row GEMM multiplies the weights dequantized to bf16 (its scratch), so its reference
//! rounds the weights to bf16 too (a dequantized Q4_0 value has up to 15 significant bits).

mod cuda_common;

use cuda_common::{compare, dequantized, gpu, poisoned_bf16, poisoned_f32, rand_bf16, random_blocks, rng, to_f32};
use ferrite_runtime::cpu;
use ferrite_runtime::cuda::ops::{self, GatedActivation, QuantMatrix};
use ferrite_runtime::cuda::{DevicePtr, Gpu};
use ferrite_runtime::{DType, Tensor};
use half::bf16;
use rand::Rng;

const RTOL: f32 = 1.0 / 256.0;

const TYPES: [DType; 7] = [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q8_0, DType::Q4K, DType::Q5K, DType::Q6K];

/// Row lengths for `dtype`: one block, an odd number of blocks, a Llama-sized row.
fn row_lengths(dtype: DType) -> [usize; 3] {
    if dtype.block_elems() == 256 {
        [256, 768, 4096]
    } else {
        [64, 992, 4096]
    }
}

/// What the GEMM path multiplies by: the dequantized weights rounded to bf16.
fn bf16_rounded(w: &[f32]) -> Vec<f32> {
    w.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// The CPU's `y = x·Wᵀ (+ b)` over the dequantized weights.
fn cpu_linear(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, bias: Option<&[f32]>) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    cpu::linear(x, m, &Tensor::from_f32(vec![n, k], w.to_vec()).unwrap(), bias, &mut y).unwrap();
    y
}

fn upload(gpu: &Gpu, k: usize, parts: &[(DType, usize, &[u8])]) -> QuantMatrix {
    QuantMatrix::upload(gpu, k, parts).unwrap()
}

/// The skinny GEMM (m ≤ 8), the dequantize + cuBLASLt GEMM (m > 8 with a scratch) and the
/// skinny GEMM over 8-row chunks (m > 8 without one), bf16 and f32 outputs, with and without
/// bias, for every block type.
#[test]
fn cuda_quant_linear_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_quant_linear_matches_cpu") else { return };
    let mut rng = rng("quant_linear");
    for dtype in TYPES {
        let [k1, k2, k3] = row_lengths(dtype);
        for (m, n, k) in [(1, 67, k1), (3, 1003, k2), (8, 130, k3), (13, 77, k2), (40, 33, k1), (1, 4104, k3)] {
            let w_bytes = random_blocks(&mut rng, dtype, n, k);
            let w = dequantized(dtype, &w_bytes, k);
            let (xh, xf) = rand_bf16(&mut rng, m * k, 1.0);
            let (bh, bf) = rand_bf16(&mut rng, n, 1.0);
            let q = upload(gpu, k, &[(dtype, n, &w_bytes)]);
            let x_d = gpu.upload(&xh).unwrap();
            let atol = 1e-6 * k as f32 * max_abs(&w);
            let scratches: &[bool] = if m > 8 { &[true, false] } else { &[false] };
            for &with_scratch in scratches {
                let w = if with_scratch { bf16_rounded(&w) } else { w.clone() };
                let want = cpu_linear(&xf, m, &w, n, k, None);
                let want_b = cpu_linear(&xf, m, &w, n, k, Some(&bf));
                let mut scratch = with_scratch.then(|| poisoned_bf16(gpu, n * k));
                let case = format!("{dtype} m={m} n={n} k={k}{}", if with_scratch { " gemm" } else { "" });
                let mut y = poisoned_bf16(gpu, m * n);
                ops::quant_linear::<bf16>(gpu, &x_d, &q, None, &mut y, m, scratch.as_mut()).unwrap();
                compare(
                    "quant_linear",
                    &format!("{case} bf16"),
                    &to_f32(&gpu.download(&y).unwrap()),
                    &want,
                    atol,
                    RTOL,
                );
                let b32 = gpu.upload(&bf).unwrap();
                let mut y = poisoned_f32(gpu, m * n);
                let bias = Some(&b32 as &dyn DevicePtr<f32>);
                ops::quant_linear(gpu, &x_d, &q, bias, &mut y, m, scratch.as_mut()).unwrap();
                compare("quant_linear", &format!("{case} f32+bias"), &gpu.download(&y).unwrap(), &want_b, atol, 1e-5);
                // cuBLASLt's bias epilogue may round the product to bf16 before adding the bias:
                // a second rounding, up to 2^-8 of |x·w| (half an ulp at the bottom of a binade).
                let b16 = gpu.upload(&bh).unwrap();
                let mut y = poisoned_bf16(gpu, m * n);
                let bias = Some(&b16 as &dyn DevicePtr<bf16>);
                ops::quant_linear(gpu, &x_d, &q, bias, &mut y, m, scratch.as_mut()).unwrap();
                let got = to_f32(&gpu.download(&y).unwrap());
                compare(
                    "quant_linear",
                    &format!("{case} bf16+bias"),
                    &got,
                    &want_b,
                    atol + max_abs(&want) / 256.0,
                    RTOL,
                );
            }
        }
    }
}

/// A fused projection whose pieces have different block types (Q4_K q/k over Q6_K v, as in
/// Q4_K_M files), through both paths.
#[test]
fn cuda_quant_linear_of_mixed_parts_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_quant_linear_of_mixed_parts_matches_cpu") else { return };
    let mut rng = rng("quant_mixed");
    let k = 512;
    let parts = [(DType::Q4K, 130), (DType::Q6K, 33), (DType::Q8_0, 65)];
    let bytes: Vec<Vec<u8>> = parts.iter().map(|&(t, rows)| random_blocks(&mut rng, t, rows, k)).collect();
    let w: Vec<f32> = parts.iter().zip(&bytes).flat_map(|(&(t, _), b)| dequantized(t, b, k)).collect();
    let spec: Vec<(DType, usize, &[u8])> = parts.iter().zip(&bytes).map(|(&(t, r), b)| (t, r, b.as_slice())).collect();
    let q = upload(gpu, k, &spec);
    let n = q.rows();
    assert_eq!((n, q.dtypes()), (228, vec![DType::Q4K, DType::Q6K, DType::Q8_0]));
    for m in [1, 5, 21] {
        let (xh, xf) = rand_bf16(&mut rng, m * k, 1.0);
        let want = cpu_linear(&xf, m, &if m > 8 { bf16_rounded(&w) } else { w.clone() }, n, k, None);
        let mut scratch = poisoned_bf16(gpu, n * k);
        let mut y = poisoned_bf16(gpu, m * n);
        ops::quant_linear::<bf16>(gpu, &gpu.upload(&xh).unwrap(), &q, None, &mut y, m, Some(&mut scratch)).unwrap();
        let atol = 1e-6 * k as f32 * max_abs(&w);
        compare("quant_linear", &format!("mixed m={m}"), &to_f32(&gpu.download(&y).unwrap()), &want, atol, RTOL);
    }
    // The whole matrix dequantized: each part at its rows, exactly.
    let mut out = poisoned_bf16(gpu, n * k);
    ops::dequantize(gpu, &q, &mut out).unwrap();
    let want = bf16_rounded(&w);
    compare("dequantize", "mixed parts", &to_f32(&gpu.download(&out).unwrap()), &want, 0.0, 0.0);
}

/// The gated MLP projection: against the CPU (gate and up rounded to bf16 as the GPU stores
/// them) and bit for bit against the quantized linear then the activation, which is also the
/// path m > 8 and multi-part matrices take.
#[test]
fn cuda_quant_linear_gated_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_quant_linear_gated_matches_cpu") else { return };
    let mut rng = rng("quant_gated");
    for dtype in TYPES {
        let [k1, k2, _] = row_lengths(dtype);
        for (m, n, k) in [(1, 65, k1), (4, 301, k2), (8, 18, k1), (11, 40, k2)] {
            let act = if rng.random() { GatedActivation::Silu } else { GatedActivation::GeluTanh };
            let w_bytes = random_blocks(&mut rng, dtype, 2 * n, k);
            let w = dequantized(dtype, &w_bytes, k);
            let (xh, xf) = rand_bf16(&mut rng, m * k, 1.0);
            let gu: Vec<f32> =
                cpu_linear(&xf, m, &w, 2 * n, k, None).iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
            let mut want: Vec<f32> = gu.chunks(2 * n).flat_map(|r| r[..n].to_vec()).collect();
            let up: Vec<f32> = gu.chunks(2 * n).flat_map(|r| r[n..].to_vec()).collect();
            match act {
                GatedActivation::Silu => cpu::silu_mul(&mut want, &up),
                GatedActivation::GeluTanh => cpu::gelu_tanh_mul(&mut want, &up),
            }
            let q = upload(gpu, k, &[(dtype, 2 * n, &w_bytes)]);
            let x_d = gpu.upload(&xh).unwrap();
            let mut gate_up = poisoned_bf16(gpu, m * 2 * n);
            let mut scratch = poisoned_bf16(gpu, 2 * n * k);
            let mut y = poisoned_bf16(gpu, m * n);
            ops::quant_linear_gated(gpu, act, &x_d, &q, &mut gate_up, &mut y, m, Some(&mut scratch)).unwrap();
            let got = to_f32(&gpu.download(&y).unwrap());
            let case = format!("{dtype} {act:?} m={m} n={n} k={k}");
            // As for the bf16 kernel: g and u may round to neighbouring bf16 values.
            let gmax = max_abs(&gu);
            let atol = 1e-6 * k as f32 * max_abs(&w) * gmax.max(1.0) + gmax * gmax / 64.0;
            compare("quant_linear_gated", &case, &got, &want, atol, RTOL);
            let mut gu_d = poisoned_bf16(gpu, m * 2 * n);
            ops::quant_linear::<bf16>(gpu, &x_d, &q, None, &mut gu_d, m, Some(&mut scratch)).unwrap();
            let mut y2 = poisoned_bf16(gpu, m * n);
            ops::gated_activation(gpu, act, &gu_d.slice(..), &gu_d.slice(n..), (m, n, 2 * n), &mut y2).unwrap();
            let two_ops = to_f32(&gpu.download(&y2).unwrap());
            compare("quant_linear_gated", &format!("{case} == two ops"), &got, &two_ops, 0.0, 0.0);
        }
    }
}

/// Dequantized rows (the GEMM path's scratch) and the embedding gather equal the CPU's
/// dequantization rounded to bf16, exactly; an id past the table gives a zero row.
#[test]
fn cuda_dequantize_and_embedding_are_exact() {
    let Some((gpu, _checks)) = gpu("cuda_dequantize_and_embedding_are_exact") else { return };
    let mut rng = rng("dequantize");
    for dtype in TYPES {
        let (rows, k) = (37, row_lengths(dtype)[1]);
        let bytes = random_blocks(&mut rng, dtype, rows, k);
        let w = dequantized(dtype, &bytes, k);
        let q = upload(gpu, k, &[(dtype, rows, &bytes)]);
        let mut out = poisoned_bf16(gpu, rows * k);
        ops::dequantize(gpu, &q, &mut out).unwrap();
        let want = bf16_rounded(&w);
        compare("dequantize", &format!("{dtype} [{rows},{k}]"), &to_f32(&gpu.download(&out).unwrap()), &want, 0.0, 0.0);
        let mut ids: Vec<u32> = (0..20).map(|_| rng.random_range(0..rows as u32)).collect();
        ids[7] = rows as u32;
        for scale in [1.0f32, 3.7] {
            let mut want = vec![0f32; ids.len() * k];
            for (t, &id) in ids.iter().enumerate().filter(|(_, &id)| (id as usize) < rows) {
                for (o, &v) in want[t * k..(t + 1) * k].iter_mut().zip(&w[id as usize * k..]) {
                    *o = bf16::from_f32(v * scale).to_f32();
                }
            }
            let mut out = poisoned_bf16(gpu, ids.len() * k);
            ops::quant_embedding(gpu, &q, &gpu.upload(&ids).unwrap(), ids.len(), scale, &mut out).unwrap();
            let got = to_f32(&gpu.download(&out).unwrap());
            compare("quant_embedding", &format!("{dtype} [{rows},{k}] s={scale}"), &got, &want, 0.0, 0.0);
        }
    }
}

/// Synthetic weights: random blocks made on the device are finite and lie in about
/// [-amp, amp] (at most 2·amp for the K types, whose mins shift the range), and differ by seed.
#[test]
fn cuda_random_blocks_are_sane() {
    let Some((gpu, _checks)) = gpu("cuda_random_blocks_are_sane") else { return };
    let amp = 0.05f32;
    for dtype in TYPES {
        let (rows, k) = (300, 512);
        let mut first = Vec::new();
        for seed in [1u64, 2] {
            let q = QuantMatrix::random(gpu, dtype, rows, k, seed, amp).unwrap();
            let mut out = poisoned_bf16(gpu, rows * k);
            ops::dequantize(gpu, &q, &mut out).unwrap();
            let v = to_f32(&gpu.download(&out).unwrap());
            let (max, mean) = (max_abs(&v), v.iter().map(|x| x.abs()).sum::<f32>() / v.len() as f32);
            let ok = v.iter().all(|x| x.is_finite()) && max <= 2.02 * amp && mean > amp / 20.0;
            println!(
                "TABLE|quant_random|{dtype} seed {seed}|max_abs={max:.3e}|mean_abs={mean:.3e}|{}",
                if ok { "ok" } else { "FAIL" }
            );
            assert!(ok, "{dtype} seed {seed}: max |w| {max}, mean |w| {mean} for amp {amp}");
            if seed == 1 {
                first = v;
            } else {
                assert_ne!(first, v, "{dtype}: seeds 1 and 2 gave the same weights");
            }
        }
    }
}
