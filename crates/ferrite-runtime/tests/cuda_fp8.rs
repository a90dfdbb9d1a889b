//! The FP8 weight kernels (`ops::fp8`) against dequantize-then-multiply on the host, on fresh
//! random codes and scales, odd shapes, scales per channel and per 128- and 32-column runs,
//! outputs NaN-poisoned. Gated on `FERRITE_TEST_CUDA=1`.
//!
//! - The skinny GEMM (m ≤ 8) and the dequantize-then-bf16-GEMM path multiply the exact
//!   weights `e4m3 · scale` (the GEMM after rounding them to bf16): the CPU's f32 `Σ w·x` up to
//!   summation order, plus a bf16 output's rounding.
//! - The FP8 GEMM (m > 8, per-channel scales, n a multiple of 8) quantizes x per token as the kernel's definition
//!   says (scale max|x| / 448, codes e4m3(x / scale) rounded to nearest even), so the reference
//!   multiplies the host's quantization of x: the kernel's codes must be those, and cuBLASLt's
//!   accumulation is f32.
//! - `Fp8Matrix::quantize` against the host's per-channel quantization, code for code.

mod cuda_common;

use cuda_common::fp8::{dequantize, quantize_rows, random_fp8};
use cuda_common::{compare, gpu, poisoned_bf16, poisoned_f32, rand_bf16, rng, to_f32};
use ferrite_runtime::cuda::ops::{self, Fp8Matrix, GatedActivation};
use ferrite_runtime::cuda::DevicePtr;
use half::bf16;

const RTOL: f32 = 1.0 / 256.0;

fn linear(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, bias: Option<&[f32]>) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k).map(|c| f64::from(x[i * k + c]) * f64::from(w[j * k + c])).sum();
            y[i * n + j] = dot as f32 + bias.map_or(0.0, |b| b[j]);
        }
    }
    y
}

/// Whether `fp8_linear` of m rows takes cuBLASLt's FP8 GEMM (`Fp8Matrix::fp8_gemm`).
fn fp8_gemm(m: usize, n: usize, k: usize, col_block: usize) -> bool {
    m > 8 && col_block == k && n.is_multiple_of(8)
}

/// Whether the skinny FP8 GEMM reads the matrix (m ≤ 8): a scale a row or runs of a multiple
/// of 64 columns; shorter runs are dequantized to bf16 first.
fn skinny(m: usize, k: usize, col_block: usize) -> bool {
    m <= 8 && (col_block == k || col_block.is_multiple_of(64))
}

/// What a product of m rows multiplies: (x, W) as the path takes them — x quantized per token
/// for the FP8 GEMM, W rounded to bf16 for the dequantize-then-GEMM path.
fn operands(x: &[f32], w: &[f32], (m, n, k): (usize, usize, usize), col_block: usize) -> (Vec<f32>, Vec<f32>) {
    let bf16_w = || w.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    match (fp8_gemm(m, n, k, col_block), skinny(m, k, col_block)) {
        (true, _) => (quantize_rows(x, k).2, w.to_vec()),
        (false, false) => (x.to_vec(), bf16_w()),
        (false, true) => (x.to_vec(), w.to_vec()),
    }
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// Every path of `fp8_linear`: bf16 and f32 out, with and without a bias, scales per channel
/// and per 128 and 32 columns, the skinny GEMM's staged and streamed loads.
#[test]
fn cuda_fp8_linear_matches_host() {
    let Some((gpu, _checks)) = gpu("cuda_fp8_linear_matches_host") else { return };
    let mut rng = rng("fp8_linear");
    for (m, n, k) in [
        (1, 67, 64usize),
        (3, 1003, 992),
        (8, 130, 4096),
        (13, 77, 992),
        (40, 32, 64),
        (64, 256, 4096),
        (17, 520, 1024),
        // Over 32 MiB of codes: the skinny GEMM's streamed loads (the others take staged ones).
        (2, 8200, 4096),
    ] {
        for col_block in [k, 128, 32] {
            if col_block > k || (col_block != k && !k.is_multiple_of(col_block) && col_block == 32) {
                continue;
            }
            let (codes, scales) = random_fp8(&mut rng, n, k, col_block);
            let w = dequantize(&codes, &scales, k, col_block);
            let mat = Fp8Matrix::upload(gpu, (n, k), &codes, &scales, col_block).unwrap();
            let (xh, xf) = rand_bf16(&mut rng, m * k, 1.0);
            let (bh, bf) = rand_bf16(&mut rng, n, 1.0);
            let x_d = gpu.upload(&xh).unwrap();
            // cuBLASLt's FP8 GEMM sums with Hopper's fast accumulation: 2e-3 rel L2 measured.
            let fast = if fp8_gemm(m, n, k, col_block) { 10.0 } else { 1.0 };
            let atol = fast * 2e-6 * k as f32 * max_abs(&w);
            let case = format!("m={m} n={n} k={k} scales every {col_block}");
            let mut scratch = poisoned_bf16(gpu, mat.scratch_len(m));
            // bf16 out, through whichever path m, n and the scales take.
            let (want_x, want_w) = operands(&xf, &w, (m, n, k), col_block);
            let want = linear(&want_x, m, &want_w, n, k, None);
            let mut y = poisoned_bf16(gpu, m * n);
            ops::fp8_linear::<bf16>(gpu, &x_d, &mat, None, &mut y, m, Some(&mut scratch)).unwrap();
            let got = to_f32(&gpu.download(&y).unwrap());
            compare("fp8_linear", &format!("{case} bf16"), &got, &want, atol, RTOL);
            let want_b = linear(&want_x, m, &want_w, n, k, Some(&bf));
            let b16 = gpu.upload(&bh).unwrap();
            let mut y = poisoned_bf16(gpu, m * n);
            let bias = Some(&b16 as &dyn DevicePtr<bf16>);
            ops::fp8_linear(gpu, &x_d, &mat, bias, &mut y, m, Some(&mut scratch)).unwrap();
            let got = to_f32(&gpu.download(&y).unwrap());
            compare("fp8_linear", &format!("{case} bf16+bias"), &got, &want_b, atol + max_abs(&want) / 256.0, RTOL);
            // f32 out: the skinny GEMM or the bf16 GEMM.
            let want_w = if skinny(m, k, col_block) {
                w.clone()
            } else {
                w.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
            };
            let want_b = linear(&xf, m, &want_w, n, k, Some(&bf));
            let b32 = gpu.upload(&bf).unwrap();
            let mut y = poisoned_f32(gpu, m * n);
            let mut big = poisoned_bf16(gpu, n * k);
            ops::fp8_linear(gpu, &x_d, &mat, Some(&b32 as &dyn DevicePtr<f32>), &mut y, m, Some(&mut big)).unwrap();
            compare("fp8_linear", &format!("{case} f32+bias"), &gpu.download(&y).unwrap(), &want_b, atol, 1e-5);
        }
    }
}

/// The gated projection: the skinny GEMM's activation epilogue (m ≤ 8; scales per row or per
/// run of 64 columns and up) and the GEMM then the activation (m > 8, or shorter runs),
/// against the host's `act(x·gateᵀ) · (x·upᵀ)` over the same products.
#[test]
fn cuda_fp8_linear_gated_matches_host() {
    let Some((gpu, _checks)) = gpu("cuda_fp8_linear_gated_matches_host") else { return };
    let mut rng = rng("fp8_gated");
    let cases = [(1, 67, 128, 128), (5, 300, 1024, 1024), (8, 96, 4096, 4096), (24, 130, 512, 512)];
    let runs = [(2, 70, 960, 192), (7, 33, 1024, 128), (3, 40, 256, 32), (33, 256, 1024, 1024)];
    // Over 32 MiB of codes: the skinny GEMM's streamed loads (the others take staged ones).
    let streamed = [(3, 4100, 4096, 4096), (1, 4100, 4096, 128)];
    for (m, n, k, col_block) in cases.into_iter().chain(runs).chain(streamed) {
        let (codes, scales) = random_fp8(&mut rng, 2 * n, k, col_block);
        let w = dequantize(&codes, &scales, k, col_block);
        let mat = Fp8Matrix::upload(gpu, (2 * n, k), &codes, &scales, col_block).unwrap();
        let (xh, xf) = rand_bf16(&mut rng, m * k, 1.0);
        let (x, wq) = operands(&xf, &w, (m, 2 * n, k), col_block);
        let gu = linear(&x, m, &wq, 2 * n, k, None);
        for (act, name) in [(GatedActivation::Silu, "silu"), (GatedActivation::GeluTanh, "gelu")] {
            let f = |g: f32| match act {
                GatedActivation::Silu => g / (1.0 + (-g).exp()),
                GatedActivation::GeluTanh => {
                    0.5 * g * (1.0 + ((2.0 / std::f32::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh())
                }
            };
            let round = |v: f32| bf16::from_f32(v).to_f32();
            let want: Vec<f32> = (0..m * n)
                .map(|i| f(round(gu[(i / n) * 2 * n + i % n])) * round(gu[(i / n) * 2 * n + n + i % n]))
                .collect();
            let mut gate_up = poisoned_bf16(gpu, m * 2 * n);
            let mut y = poisoned_bf16(gpu, m * n);
            let mut scratch = poisoned_bf16(gpu, mat.scratch_len(m));
            ops::fp8_linear_gated(
                gpu,
                act,
                &gpu.upload(&xh).unwrap(),
                &mat,
                &mut gate_up,
                &mut y,
                m,
                Some(&mut scratch),
            )
            .unwrap();
            let fast = if fp8_gemm(m, 2 * n, k, col_block) { 10.0 } else { 1.0 };
            let atol = fast * 4e-6 * k as f32 * max_abs(&w) * max_abs(&gu).max(1.0);
            let case = format!("{name} m={m} n={n} k={k} scales every {col_block}");
            compare("fp8_linear_gated", &case, &to_f32(&gpu.download(&y).unwrap()), &want, atol, 2.0 * RTOL);
        }
    }
}

/// `Fp8Matrix::quantize` of a bf16 matrix, the embedding gather and `dequantize`: codes as the
/// host quantizes them, rows exactly.
#[test]
fn cuda_fp8_quantize_and_gather_match_host() {
    let Some((gpu, _checks)) = gpu("cuda_fp8_quantize_and_gather_match_host") else { return };
    let mut rng = rng("fp8_quantize");
    let (rows, cols) = (37, 272);
    let (wh, wf) = rand_bf16(&mut rng, rows * cols, 3.0);
    let mat = Fp8Matrix::quantize(gpu, &gpu.upload(&wh).unwrap(), rows, cols).unwrap();
    let (_, _, want) = quantize_rows(&wf, cols);
    let mut out = poisoned_bf16(gpu, rows * cols);
    mat.dequantize(gpu, &mut out).unwrap();
    let want_bf16: Vec<f32> = want.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    compare("fp8_quantize", "per channel", &to_f32(&gpu.download(&out).unwrap()), &want_bf16, 0.0, 0.0);
    // The gather: rows by id times a scale, an id past the table a zero row.
    let ids: Vec<u32> = vec![3, 0, 36, 40, 3];
    let mut got = poisoned_bf16(gpu, ids.len() * cols);
    ops::fp8_embedding(gpu, &mat, &gpu.upload(&ids).unwrap(), ids.len(), 2.0, &mut got).unwrap();
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&i| (0..cols).map(move |c| (i, c)))
        .map(
            |(i, c)| if (i as usize) < rows { bf16::from_f32(want[i as usize * cols + c] * 2.0).to_f32() } else { 0.0 },
        )
        .collect();
    compare("fp8_embedding", "gather", &to_f32(&gpu.download(&got).unwrap()), &want, 0.0, 0.0);
    // Random matrices: finite, within the amplitude.
    let r = Fp8Matrix::random(gpu, 64, 512, 7, 0.25).unwrap();
    let mut out = poisoned_bf16(gpu, 64 * 512);
    r.dequantize(gpu, &mut out).unwrap();
    let v = to_f32(&gpu.download(&out).unwrap());
    assert!(v.iter().all(|x| x.is_finite() && x.abs() <= 0.25), "random FP8 values out of range");
    assert!(max_abs(&v) > 0.2, "random FP8 values do not span the amplitude");
}
