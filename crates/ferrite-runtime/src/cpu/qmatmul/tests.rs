//! Kernel tests: every fast kernel, at every level this CPU has (the scalar kernels included),
//! against the reference path on fresh random weights and activations, in shapes that are not
//! multiples of the SIMD widths (block counts that leave a partial group of 8, odd `n`,
//! `m` of 1, 3 and 17).
//!
//! Two bounds per output, both computed from the inputs:
//! - against the reference over the *same quantized activations* (`q * d`): only f32 rounding
//!   separates them, so the error must be below `TIGHT * Σ|w|·|x_q|`; a wrong bit in a single
//!   code costs about 1e-3 of that;
//! - against the exact reference over the original activations: activation quantization moves
//!   each value by at most half its block step `d / 2`, so `|fast - exact| ≤ Σ_b d_b / 2 · Σ_b |w|`
//!   (plus the rounding term).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::acts::QuantizedActs;
use super::*;
use crate::tensor::Buffer;

/// Relative f32 rounding allowance (sums of ~10-100 block terms, each rounded a few times).
const TIGHT: f64 = 2e-6;

const GGUF_ROW_KERNEL_DTYPES: [DType; 10] = [
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::F16,
    DType::BF16,
];

/// Every dtype with a row kernel: the GGUF ones above and every MLX format.
fn row_kernel_dtypes() -> Vec<DType> {
    GGUF_ROW_KERNEL_DTYPES.into_iter().chain(crate::dtype::MlxFormat::all().map(DType::Mlx)).collect()
}

fn levels() -> Vec<Level> {
    Level::ALL.into_iter().filter(|l| l.available()).collect()
}

/// Byte offsets of the f16 scale fields inside one block of `dtype`.
fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q8_1 | DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q2K => &[80, 82],
        DType::Q3K => &[108],
        DType::Q6K => &[208],
        _ => &[],
    }
}

/// Random `[n, k]` weights: random quant bytes, with every scale field a finite f16.
fn random_weights(dtype: DType, n: usize, k: usize, rng: &mut StdRng) -> Tensor {
    let bytes: Vec<u8> = match dtype {
        DType::F16 => (0..n * k).flat_map(|_| half::f16::from_f32(rng.random_range(-1.0..1.0)).to_le_bytes()).collect(),
        DType::BF16 => {
            (0..n * k).flat_map(|_| half::bf16::from_f32(rng.random_range(-1.0..1.0)).to_le_bytes()).collect()
        }
        DType::Mlx(f) => {
            let mut b: Vec<u8> = (0..dtype.row_bytes(k).unwrap() * n).map(|_| rng.random()).collect();
            let s = f.scale().bytes();
            for block in b.chunks_exact_mut(dtype.block_bytes()) {
                let scale = rng.random_range(0.0005..0.02) / if f.bits() == 8 { 16.0 } else { 1.0 };
                crate::quant::mlx::write_scale(f.scale(), scale, &mut block[..s]);
                crate::quant::mlx::write_scale(f.scale(), rng.random_range(-0.15..0.05), &mut block[s..2 * s]);
            }
            b
        }
        _ => {
            let mut b: Vec<u8> = (0..dtype.row_bytes(k).unwrap() * n).map(|_| rng.random()).collect();
            for block in b.chunks_exact_mut(dtype.block_bytes()) {
                for &off in f16_fields(dtype) {
                    let sign = if rng.random_bool(0.5) { 1.0 } else { -1.0 };
                    let v = half::f16::from_f32(sign * rng.random_range(0.001..0.02));
                    block[off..off + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
            b
        }
    };
    Tensor::new(dtype, vec![n, k], Buffer::Bytes(std::sync::Arc::new(bytes))).unwrap()
}

/// Activations in [-1, 1] with a few large outliers (which stretch a block's scale).
fn random_acts(len: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..len)
        .map(|_| if rng.random_bool(0.02) { rng.random_range(-8.0..8.0) } else { rng.random_range(-1.0..1.0) })
        .collect()
}

/// `x · Wᵀ` in f64 over the exactly dequantized weights.
fn reference(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0f64; m * n];
    for i in 0..m {
        for r in 0..n {
            out[i * n + r] = (0..k).map(|j| f64::from(x[i * k + j]) * f64::from(w[r * k + j])).sum();
        }
    }
    out
}

fn row_block(dtype: DType) -> usize {
    if dtype.block_elems() == 256 && !matches!(dtype, DType::Mlx(_)) {
        256
    } else {
        32
    }
}

/// Row lengths to test for `dtype`: a partial group of 8 blocks, fewer than 8 blocks, one
/// block; any length for the 16-bit floats.
fn lengths(dtype: DType) -> Vec<usize> {
    match dtype {
        DType::F16 | DType::BF16 => vec![301, 40, 7],
        // Groups of 32 to 128: several KC slices of the integer GEMM, and a single group.
        DType::Mlx(f) => vec![5 * f.group(), f.group()],
        _ if dtype.block_elems() == 256 => vec![3 * 256, 256],
        _ => vec![11 * 32, 3 * 32, 32],
    }
}

#[test]
fn row_kernels_match_the_reference_at_every_level() {
    let mut rng = StdRng::seed_from_u64(rand::rng().random());
    let n = 37;
    for dtype in row_kernel_dtypes() {
        for k in lengths(dtype) {
            let w = random_weights(dtype, n, k, &mut rng);
            let wf = w.to_f32_vec().unwrap();
            for m in [1, 3, 17] {
                let x = random_acts(m * k, &mut rng);
                let float = matches!(dtype, DType::F16 | DType::BF16);
                // What the kernels multiply by: the quantized activations, or x itself.
                let (xq, step) = if float {
                    (x.clone(), vec![0f32; m * k])
                } else {
                    let acts = QuantizedActs::new(&x, m, k, row_block(dtype), Level::Scalar);
                    let xq = acts.dequantized();
                    let step: Vec<f32> = x.iter().zip(&xq).map(|(a, b)| (a - b).abs()).collect();
                    (xq, step)
                };
                let same_acts = reference(&xq, m, &wf, n, k);
                let exact = reference(&x, m, &wf, n, k);
                let abs_w: Vec<f32> = wf.iter().map(|v| v.abs()).collect();
                let magnitude = reference(&xq.iter().map(|v| v.abs()).collect::<Vec<_>>(), m, &abs_w, n, k);
                let quant_bound = reference(&step, m, &abs_w, n, k);
                for level in levels() {
                    let mut out = vec![f32::NAN; m * n];
                    assert!(rows(&x, m, &w, &mut out, level), "{dtype} has no row kernel");
                    for (idx, &got) in out.iter().enumerate() {
                        let got = f64::from(got);
                        let tight = TIGHT * magnitude[idx] + 1e-9;
                        let what = format!("{dtype} {level:?} k={k} m={m} output {idx}");
                        assert!(
                            (got - same_acts[idx]).abs() <= tight,
                            "{what}: {got} vs {} (tol {tight})",
                            same_acts[idx]
                        );
                        let loose = quant_bound[idx] + tight;
                        assert!(
                            (got - exact[idx]).abs() <= loose,
                            "{what}: {got} vs exact {} (tol {loose})",
                            exact[idx]
                        );
                    }
                }
            }
        }
    }
}

/// The whole dispatch (the integer GEMM or the row kernels for quantized weights, f32 panels
/// for 16-bit floats from `PANEL_MIN_ROWS` rows on, the reference dequantizer for dtypes
/// without kernels) at every level.
#[test]
fn linear_matches_the_reference_for_every_dtype_and_level() {
    let mut rng = StdRng::seed_from_u64(rand::rng().random());
    // Three 32-row slivers, the last partial: several panels on the AVX-512 path.
    let n = 93;
    let dtypes = row_kernel_dtypes().into_iter().chain([DType::Q8_1, DType::Q2K, DType::Q3K]);
    for dtype in dtypes {
        let k = lengths(dtype)[0];
        let w = random_weights(dtype, n, k, &mut rng);
        let wf = w.to_f32_vec().unwrap();
        for m in [1, 2, 3, PANEL_MIN_ROWS, 17] {
            let x = random_acts(m * k, &mut rng);
            let exact = reference(&x, m, &wf, n, k);
            let abs_x: Vec<f32> = x.iter().map(|v| v.abs()).collect();
            let abs_w: Vec<f32> = wf.iter().map(|v| v.abs()).collect();
            let magnitude = reference(&abs_x, m, &abs_w, n, k);
            for level in levels() {
                let mut out = vec![f32::NAN; m * n];
                linear_at(&x, m, &w, &mut out, level).unwrap();
                let qmax = activation_qmax(dtype, level);
                for (idx, &got) in out.iter().enumerate() {
                    // f32 paths multiply exact weights by exact activations; the integer paths
                    // quantize activations (each value moves by at most half a step,
                    // amax / (2 qmax), and a block's amax is at most 8x the typical magnitude).
                    let quant = qmax.map_or(0.0, |q| magnitude[idx] * 8.0 / (2.0 * q));
                    let tol = TIGHT * magnitude[idx] + quant + 1e-9;
                    let got = f64::from(got);
                    assert!(
                        (got - exact[idx]).abs() <= tol,
                        "{dtype} {level:?} m={m} output {idx}: {got} vs {} (tol {tol})",
                        exact[idx]
                    );
                }
            }
        }
    }
}

/// The largest activation code of the path `linear_at` takes, `None` for the f32 paths.
fn activation_qmax(dtype: DType, level: Level) -> Option<f64> {
    if !row_kernel_dtypes().contains(&dtype) || matches!(dtype, DType::F16 | DType::BF16) {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    if takes_igemm(Some(level), dtype) {
        return Some(8191.0);
    }
    let _ = level;
    Some(f64::from(acts::QMAX))
}

/// Batch invariance: for quantized weights, `m` rows in one call give, bit for bit, what each
/// row gives alone — at every level, for `m` on both sides of every kernel switch.
#[test]
fn batched_rows_equal_rows_alone() {
    let mut rng = StdRng::seed_from_u64(rand::rng().random());
    let n = 93;
    let quantized = row_kernel_dtypes().into_iter().filter(|d| !matches!(d, DType::F16 | DType::BF16));
    for dtype in quantized {
        let k = lengths(dtype)[0];
        let w = random_weights(dtype, n, k, &mut rng);
        let x = random_acts(17 * k, &mut rng);
        for level in levels() {
            let alone: Vec<Vec<f32>> = (0..17)
                .map(|i| {
                    let mut out = vec![f32::NAN; n];
                    linear_at(&x[i * k..(i + 1) * k], 1, &w, &mut out, level).unwrap();
                    out
                })
                .collect();
            for m in [2, 3, 7, 8, 9, 16, 17] {
                let mut out = vec![f32::NAN; m * n];
                linear_at(&x[..m * k], m, &w, &mut out, level).unwrap();
                for (i, row) in out.chunks_exact(n).enumerate() {
                    let same = row.iter().zip(&alone[i]).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{dtype} {level:?}: row {i} of {m} differs from the row alone");
                }
            }
        }
    }
}

/// A long prompt through the integer GEMMs: rows in several of `igemm_avx2`'s L2 chunks and
/// `igemm`'s `KC` slices and `MC` passes (k = 2,048, 600 rows) give, bit for bit, what each
/// row gives alone, and stay within the reference bound.
#[test]
fn long_prompts_equal_rows_alone() {
    let mut rng = StdRng::seed_from_u64(rand::rng().random());
    let (n, k, m) = (40, 2048, 600);
    for dtype in [DType::Q4_1, DType::Q6K] {
        let w = random_weights(dtype, n, k, &mut rng);
        let wf = w.to_f32_vec().unwrap();
        let x = random_acts(m * k, &mut rng);
        let exact = reference(&x, m, &wf, n, k);
        let abs_x: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        let magnitude = reference(&abs_x, m, &wf.iter().map(|v| v.abs()).collect::<Vec<_>>(), n, k);
        for level in levels() {
            let mut out = vec![f32::NAN; m * n];
            linear_at(&x, m, &w, &mut out, level).unwrap();
            for i in (0..m).step_by(37).chain([m - 1]) {
                let mut alone = vec![f32::NAN; n];
                linear_at(&x[i * k..(i + 1) * k], 1, &w, &mut alone, level).unwrap();
                let same = out[i * n..(i + 1) * n].iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{dtype} {level:?}: row {i} of {m} differs from the row alone");
            }
            let qmax = activation_qmax(dtype, level).unwrap();
            for (idx, &got) in out.iter().enumerate() {
                let tol = TIGHT * magnitude[idx] + magnitude[idx] * 8.0 / (2.0 * qmax) + 1e-9;
                assert!((f64::from(got) - exact[idx]).abs() <= tol, "{dtype} {level:?} output {idx}");
            }
        }
    }
}

/// The two integer GEMMs are one arithmetic: on a CPU with AVX-512 VNNI, `igemm_avx2` gives
/// `igemm`'s bits for every packed dtype and row count (skipped below AVX-512 VNNI).
#[test]
fn integer_gemms_agree_bit_for_bit() {
    if !Level::Avx512Vnni.available() {
        eprintln!("SKIP: this CPU has no AVX-512 VNNI");
        return;
    }
    let mut rng = StdRng::seed_from_u64(rand::rng().random());
    let n = 93;
    for dtype in row_kernel_dtypes().into_iter().filter(|&d| takes_igemm(Some(Level::Avx2), d)) {
        let k = lengths(dtype)[0];
        let w = random_weights(dtype, n, k, &mut rng);
        for m in [1, 5, 17, 600] {
            let x = random_acts(m * k, &mut rng);
            let (mut a, mut b) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
            linear_at(&x, m, &w, &mut a, Level::Avx2).unwrap();
            linear_at(&x, m, &w, &mut b, Level::Avx512Vnni).unwrap();
            assert!(a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype} m={m}");
        }
    }
}

/// The reference mode is the exact path: panels over `quant::dequantize_row`.
#[test]
fn reference_mode_is_exact() {
    let mut rng = StdRng::seed_from_u64(rand::rng().random());
    let (n, k, m) = (13, 64, 2);
    let w = random_weights(DType::Q4_1, n, k, &mut rng);
    let wf = w.to_f32_vec().unwrap();
    let x = random_acts(m * k, &mut rng);
    let mut out = vec![0f32; m * n];
    panel::by_panels(&x, m, &w, &mut out, &|src, dst| reference_dequant(w.dtype(), src, dst), false).unwrap();
    let exact = reference(&x, m, &wf, n, k);
    for (got, want) in out.iter().zip(&exact) {
        assert!((f64::from(*got) - want).abs() <= 1e-5 * want.abs().max(1.0), "{got} vs {want}");
    }
}

/// `linear_many` (one quantization, one parallel loop over several weights) gives each output
/// bit for bit what `linear` gives it alone, for every dtype and on both sides of the
/// integer GEMM's row thresholds; weights of two dtypes take the one-by-one path.
#[test]
fn linear_many_equals_linear_alone() {
    let mut rng = StdRng::seed_from_u64(rand::rng().random());
    let quantized = row_kernel_dtypes().into_iter().filter(|d| !matches!(d, DType::F16 | DType::BF16));
    for dtype in quantized {
        let k = lengths(dtype)[0];
        let ws: Vec<Tensor> = [93, 32, 7].iter().map(|&n| random_weights(dtype, n, k, &mut rng)).collect();
        // Another dtype of the same row length (MLX groups of 128 rows are not Q8_0 rows).
        let other = if k.is_multiple_of(64) { DType::Q8_0 } else { DType::Q4_0 };
        let mixed = [&ws[0], &random_weights(other, 40, k, &mut rng)].map(|w| w.clone());
        for weights in [ws.iter().collect::<Vec<_>>(), mixed.iter().collect()] {
            for m in [1, 8, 17] {
                let x = random_acts(m * k, &mut rng);
                let mut outs: Vec<Vec<f32>> = weights.iter().map(|w| vec![f32::NAN; m * w.rows()]).collect();
                let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
                linear_many(&x, m, &weights, &mut refs).unwrap();
                for (w, got) in weights.iter().zip(&outs) {
                    let mut want = vec![f32::NAN; m * w.rows()];
                    linear(&x, m, w, &mut want).unwrap();
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{dtype} m={m}: {:?} differs from its own linear", w.dtype());
                }
            }
        }
    }
}

/// An MLX matrix over its checkpoint parts multiplies as its assembled blocks do, bit for bit,
/// at every level; the integer GEMM packs it a group of rows at a time, never assembling the
/// whole matrix.
#[test]
fn mlx_parts_multiply_as_their_blocks() {
    use crate::dtype::{MlxFormat, MlxScale};
    use crate::quant::mlx::MlxParts;
    let mut rng = StdRng::seed_from_u64(rand::rng().random());
    let (n, k, m) = (45, 256, 3);
    for f in [MlxFormat::new(4, 64, MlxScale::Bf16).unwrap(), MlxFormat::new(8, 128, MlxScale::F16).unwrap()] {
        let dtype = DType::Mlx(f);
        // Random parts as a checkpoint stores them: words, then finite scales and biases.
        let words: Vec<u8> = (0..n * k * f.bits() as usize / 8).map(|_| rng.random()).collect();
        let groups = n * k / f.group();
        let scale = |v: f32| match f.scale() {
            MlxScale::F16 => half::f16::from_f32(v).to_le_bytes(),
            _ => half::bf16::from_f32(v).to_le_bytes(),
        };
        let scales: Vec<u8> = (0..groups).flat_map(|_| scale(rng.random_range(0.001..0.01))).collect();
        let biases: Vec<u8> = (0..groups).flat_map(|_| scale(rng.random_range(-0.1..0.0))).collect();
        let owned = |v: &Vec<u8>| Buffer::Bytes(std::sync::Arc::new(v.clone()));
        let lazy = || {
            let parts = MlxParts::new(f, n, k, owned(&words), owned(&scales), owned(&biases)).unwrap();
            Tensor::new(dtype, vec![n, k], Buffer::Mlx(std::sync::Arc::new(parts))).unwrap()
        };
        let blocks = crate::quant::mlx::assemble(f, n, k, &words, &scales, &biases).unwrap();
        let plain = Tensor::new(dtype, vec![n, k], Buffer::Bytes(std::sync::Arc::new(blocks))).unwrap();
        let x = random_acts(m * k, &mut rng);
        for level in levels() {
            // Fresh parts at each level (the row kernels read the assembled matrix).
            let lazy = lazy();
            let (mut a, mut b) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
            linear_at(&x, m, &lazy, &mut a, level).unwrap();
            linear_at(&x, m, &plain, &mut b, level).unwrap();
            assert!(a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype} {level:?}");
            #[cfg(target_arch = "x86_64")]
            if takes_igemm(Some(level), dtype) {
                let Buffer::Mlx(p) = lazy.buffer_for_tests() else { panic!("parts") };
                assert!(!p.assembled(), "{dtype}: packing assembled the whole matrix");
            }
        }
    }
}
