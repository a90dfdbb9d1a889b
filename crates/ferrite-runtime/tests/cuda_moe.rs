//! The mixture-of-experts kernels against plain reference loops: the routing (softmax, top-k
//! with the lower expert first among equals, renormalized or not, per-expert scales) and the
//! grouping by expert (offsets, active experts, each grouped row's token, each pair's row);
//! then every expert's gate-up and down projections and the weighted combine, for bf16, GGUF
//! (Q4_K, Q8_0), MLX (4-bit groups of 64 with bf16 scales, 8-bit groups of 32 with f32
//! scales) and FP8 experts (a checkpoint's block scales: runs of 128 and of 32 along a row, a
//! block wider than the row, a scale a row; and bf16 experts quantized on the device, as
//! `--quantization fp8` does, code for code against the host's quantization), at token counts on both kernels (the skinny GEMM over the chosen
//! experts up to 8 tokens, the grouped tensor-core GEMM above), odd shapes, and skewed loads:
//! an expert no token picks, every token on one expert. Outputs are NaN-poisoned first, so a
//! row the kernels fail to write fails. Gated on `FERRITE_TEST_CUDA=1`.
//!
//! The reference takes the routes the GPU chose (the routing test checks those) and makes
//! the GPU's roundings: gate and up rounded to bf16 before the activation, the activation and
//! each expert's output stored as bf16, and, for the GEMM (more than 8 tokens), the weights
//! dequantized to bf16 first (the skinny GEMM reads them in f32). What is left is f32
//! summation order, and the bf16 rounding it may flip: rtol 2^-7 against the values plus an
//! absolute part of 2^-8 of the row's largest value.

mod cuda_common;

use cuda_common::fp8::{dequantize, quantize_rows, random_fp8};
use cuda_common::{compare, dequantized, gpu, poisoned_bf16, rand_bf16, random_blocks, rng, to_f32};
use ferrite_runtime::cuda::ops::{self, ExpertMatrix, ExpertProduct, ExpertSum, GatedActivation, MoeRoute};
use ferrite_runtime::cuda::{DevicePtr, Gpu};
use ferrite_runtime::{DType, MlxFormat, MlxScale};
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

const RTOL: f32 = 1.0 / 128.0;

fn round(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// Each token's route as the CPU model makes it: softmax in f64, the `k` best (stable: the
/// lower expert first among equals), divided by their sum when `renormalize`, times `scale`;
/// in ascending expert order. Also whether the k-th and (k+1)-th probabilities are too close
/// for f32 arithmetic to be sure of the choice.
fn reference_route(logits: &[f32], k: usize, renormalize: bool, scale: Option<&[f32]>) -> (Vec<(usize, f32)>, bool) {
    let mx = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let ex: Vec<f64> = logits.iter().map(|&v| f64::from(v - mx).exp()).collect();
    let sum: f64 = ex.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| ex[b].total_cmp(&ex[a]));
    let close = order.len() > k
        && ex[order[k - 1]] - ex[order[k]] < 1e-5 * ex[order[k - 1]]
        && ex[order[k - 1]] != ex[order[k]];
    let top = &order[..k];
    let chosen: f64 = top.iter().map(|&e| ex[e] / sum).sum();
    let mut route: Vec<(usize, f32)> = top
        .iter()
        .map(|&e| {
            let p = ex[e] / sum;
            let w = if renormalize { p / chosen } else { p };
            (e, (w * f64::from(scale.map_or(1.0, |s| s[e]))) as f32)
        })
        .collect();
    route.sort_by_key(|&(e, _)| e);
    (route, close)
}

/// Router logits for `tokens` tokens over `experts`: uniform, with expert `never` pushed far
/// down and expert `always` far up when given.
fn logits(rng: &mut StdRng, tokens: usize, experts: usize, never: Option<usize>, always: Option<usize>) -> Vec<f32> {
    let mut v: Vec<f32> = (0..tokens * experts).map(|_| rng.random_range(-4.0f32..4.0)).collect();
    for row in v.chunks_exact_mut(experts) {
        if let Some(e) = never {
            row[e] = -60.0;
        }
        if let Some(e) = always {
            row[e] = 60.0;
        }
    }
    v
}

/// Route `logits` on the device; the (ids, weights) it chose.
fn route_on_gpu(
    gpu: &Gpu,
    r: &mut MoeRoute,
    logits: &[f32],
    tokens: usize,
    renormalize: bool,
    scale: Option<&[f32]>,
) -> (Vec<i32>, Vec<f32>) {
    let l = gpu.upload(logits).unwrap();
    let s = scale.map(|s| gpu.upload(s).unwrap());
    ops::moe_route(gpu, &l, tokens, renormalize, s.as_ref().map(|s| s as &dyn DevicePtr<f32>), r).unwrap();
    let (ids, weights) = r.choices();
    let k = r.top_k();
    (gpu.download(&ids.slice(..tokens * k)).unwrap(), gpu.download(&weights.slice(..tokens * k)).unwrap())
}

/// The grouping `r` holds for `ids` (`tokens` × `k`, `experts`): offsets are the counts'
/// running sums, the active experts those with pairs in order, each expert's rows its pairs in
/// token order, and the pair → row map the inverse of row → token.
fn check_grouping(gpu: &Gpu, r: &MoeRoute, ids: &[i32], tokens: usize, case: &str) {
    let (e, k) = (r.experts(), r.top_k());
    let [offsets, active, rows, pos, tiles] = r.grouping();
    let offsets = gpu.download(offsets).unwrap();
    let tiles = gpu.download(tiles).unwrap();
    let active = gpu.download(active).unwrap();
    let rows = gpu.download(&rows.slice(..tokens * k)).unwrap();
    let pos = gpu.download(&pos.slice(..tokens * k)).unwrap();
    let mut counts = vec![0i32; e];
    ids.iter().for_each(|&x| counts[x as usize] += 1);
    let mut want_offsets = vec![0i32];
    counts.iter().for_each(|c| want_offsets.push(want_offsets.last().unwrap() + c));
    assert_eq!(offsets, want_offsets, "{case}: offsets");
    let mut want_tiles = vec![0i32];
    counts.iter().for_each(|c| want_tiles.push(want_tiles.last().unwrap() + (c + 63) / 64));
    assert_eq!(tiles, want_tiles, "{case}: tiles");
    let mut want_active: Vec<i32> = (0..e as i32).filter(|&x| counts[x as usize] > 0).collect();
    want_active.resize(e, -1);
    assert_eq!(active, want_active, "{case}: active experts");
    for x in 0..e {
        let want: Vec<i32> = (0..tokens * k).filter(|&p| ids[p] == x as i32).map(|p| (p / k) as i32).collect();
        let got = &rows[offsets[x] as usize..offsets[x + 1] as usize];
        assert_eq!(got, want, "{case}: rows of expert {x}");
    }
    for (p, &g) in pos.iter().enumerate() {
        assert_eq!(rows[g as usize], (p / k) as i32, "{case}: pair {p} at row {g}");
        let x = ids[p] as usize;
        assert!((offsets[x]..offsets[x + 1]).contains(&g), "{case}: pair {p} outside expert {x}'s rows");
    }
}

/// Routing and grouping: random logits at odd token counts (up to 8 tokens routed by one
/// block, more by two kernels), renormalized or not, with and without per-expert scales;
/// equal logits (the lower experts win); an expert never chosen and one always chosen.
#[test]
fn cuda_moe_route_matches_reference() {
    let Some((gpu, _checks)) = gpu("cuda_moe_route_matches_reference") else { return };
    let mut rng = rng("moe_route");
    let cases = [
        (1, 8, 2),
        (5, 128, 8),
        (8, 257, 32),
        (8, 1400, 8),
        (3, 1600, 4),
        (37, 60, 4),
        (300, 128, 8),
        (9, 4, 4),
        (70, 257, 32),
    ];
    for (tokens, experts, k) in cases {
        for (renormalize, scaled, skew) in [(true, false, 0), (false, true, 1), (true, true, 2)] {
            // An expert no token picks (where a token does not take them all), one every token
            // picks.
            let (never, always) = match skew {
                1 if k < experts => (Some(experts - 1), None),
                2 => (None, Some(experts / 2)),
                _ => (None, None),
            };
            let mut l = logits(&mut rng, tokens, experts, never, always);
            // The last token's logits all equal: experts 0 .. k, equal weights.
            l[(tokens - 1) * experts..].fill(0.5);
            let scale: Option<Vec<f32>> = scaled.then(|| (0..experts).map(|_| rng.random_range(0.5f32..2.0)).collect());
            let mut r = MoeRoute::new(gpu, tokens + 3, experts, k).unwrap();
            let (ids, weights) = route_on_gpu(gpu, &mut r, &l, tokens, renormalize, scale.as_deref());
            let case =
                format!("{tokens} tokens, {k} of {experts}, renormalize {renormalize}, scaled {scaled}, skew {skew}");
            let (mut want_w, mut got_w, mut unsure) = (Vec::new(), Vec::new(), 0);
            for t in 0..tokens {
                let (want, close) =
                    reference_route(&l[t * experts..(t + 1) * experts], k, renormalize, scale.as_deref());
                let got: Vec<usize> = ids[t * k..(t + 1) * k].iter().map(|&x| x as usize).collect();
                if close {
                    unsure += 1;
                    continue;
                }
                assert_eq!(got, want.iter().map(|&(e, _)| e).collect::<Vec<_>>(), "{case}: token {t}'s experts");
                want_w.extend(want.iter().map(|&(_, w)| w));
                got_w.extend_from_slice(&weights[t * k..(t + 1) * k]);
            }
            assert!(unsure <= tokens / 20, "{case}: {unsure} near ties");
            compare("moe_route", &format!("{case} weights"), &got_w, &want_w, 1e-6, 1e-5);
            assert!(ids.iter().all(|&x| never.is_none_or(|n| x != n as i32)), "{case}: the shunned expert was chosen");
            if let Some(a) = always {
                assert!(
                    ids.chunks(k).take(tokens - 1).all(|c| c.contains(&(a as i32))),
                    "{case}: the favourite was skipped"
                );
            }
            assert_eq!(&ids[(tokens - 1) * k..], (0..k as i32).collect::<Vec<_>>(), "{case}: equal logits");
            check_grouping(gpu, &r, &ids, tokens, &case);
        }
    }
}

/// One expert projection's weights: bf16 values, random GGUF or MLX blocks or FP8 rows, on the
/// host as the GPU computes with them (f32 dequantized values) and on the device.
struct Weights {
    values: Vec<f32>,
    dev: ExpertMatrix,
}

/// How a case's experts are made.
#[derive(Debug, Clone, Copy)]
enum Format {
    /// Bytes of a type `ExpertMatrix::upload` takes (bf16, GGUF or MLX blocks).
    Upload(DType),
    /// A checkpoint's FP8 codes with a scale every this many columns (0: one a row).
    Fp8(usize),
    /// bf16 experts quantized to FP8 on the device (`ExpertMatrix::quantize_fp8`).
    Fp8Quantized,
}

fn expert_weights(gpu: &Gpu, rng: &mut StdRng, format: Format, shape: (usize, usize, usize)) -> Weights {
    let (e, rows, cols) = shape;
    let amp = (3.0 / cols as f32).sqrt();
    let dtype = match format {
        Format::Upload(dtype) => dtype,
        Format::Fp8(block) => {
            let col_block = if block == 0 { cols } else { block };
            let (codes, mut scales) = random_fp8(rng, e * rows, cols, col_block);
            scales.iter_mut().for_each(|s| *s *= amp);
            let values = dequantize(&codes, &scales, cols, col_block);
            return Weights { values, dev: ExpertMatrix::upload_fp8(gpu, shape, &codes, &scales, col_block).unwrap() };
        }
        Format::Fp8Quantized => {
            let (h, values) = rand_bf16(rng, e * rows * cols, amp);
            let bytes: Vec<u8> = h.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
            let bf16 = ExpertMatrix::upload(gpu, DType::BF16, shape, &bytes).unwrap();
            let dev = ExpertMatrix::quantize_fp8(gpu, &bf16).unwrap();
            return Weights { values: quantize_rows(&values, cols).2, dev };
        }
    };
    if dtype == DType::BF16 {
        let (h, values) = rand_bf16(rng, e * rows * cols, (3.0 / cols as f32).sqrt());
        let bytes: Vec<u8> = h.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
        return Weights { values, dev: ExpertMatrix::upload(gpu, dtype, (e, rows, cols), &bytes).unwrap() };
    }
    let bytes = random_blocks(rng, dtype, e * rows, cols);
    let values = dequantized(dtype, &bytes, cols);
    Weights { values, dev: ExpertMatrix::upload(gpu, dtype, (e, rows, cols), &bytes).unwrap() }
}

/// `W[e] · x` for expert `e`'s `rows` rows of `cols` values (the weights rounded to bf16 when
/// `gemm`).
fn expert_dot(w: &Weights, e: usize, (rows, cols): (usize, usize), x: &[f32], gemm: bool) -> Vec<f32> {
    let m = &w.values[e * rows * cols..(e + 1) * rows * cols];
    m.chunks_exact(cols)
        .map(|row| row.iter().zip(x).map(|(&a, &b)| if gemm { round(a) * b } else { a * b }).sum())
        .collect()
}

/// Every expert's products and their sum (inside the down projection's launch up to 8 tokens)
/// against the reference loops, for experts of `format` of `hidden` × `inter`, over each token
/// count and load.
fn experts_case(gpu: &Gpu, rng: &mut StdRng, format: Format, (hidden, inter): (usize, usize)) {
    let (experts, k) = (16, 4);
    let gate_up = expert_weights(gpu, rng, format, (experts, 2 * inter, hidden));
    let down = expert_weights(gpu, rng, format, (experts, hidden, inter));
    // One sum for every case: the decode sums leave its counters zero for the next.
    let mut sum = ExpertSum::new(gpu, hidden).unwrap();
    for tokens in [1, 3, 8, 9, 61, 200] {
        for skew in 0..3 {
            let (never, always) = match skew {
                1 => (Some(5), None),
                2 => (None, Some(2)),
                _ => (None, None),
            };
            let case = format!("{format:?} [{hidden}, {inter}] {tokens} tokens skew {skew}");
            let l = logits(rng, tokens, experts, never, always);
            let mut r = MoeRoute::new(gpu, tokens, experts, k).unwrap();
            let (ids, weights) = route_on_gpu(gpu, &mut r, &l, tokens, true, None);
            let (xh, xf) = rand_bf16(rng, tokens * hidden, 1.0);
            let x = gpu.upload(&xh).unwrap();
            let pairs = tokens * k;
            let mut act = poisoned_bf16(gpu, pairs * inter);
            let mut y = poisoned_bf16(gpu, pairs * hidden);
            let mut out = poisoned_bf16(gpu, tokens * hidden);
            let gated = ExpertProduct::Gated(GatedActivation::Silu);
            ops::moe_linear(gpu, gated, &x, true, &gate_up.dev, &r, tokens, &mut act).unwrap();
            ops::moe_down(gpu, &act, &down.dev, &r, tokens, &mut y, &mut sum, &mut out).unwrap();
            let pos = gpu.download(&r.grouping()[3].slice(..pairs)).unwrap();
            let (act, y, out) = (
                to_f32(&gpu.download(&act).unwrap()),
                to_f32(&gpu.download(&y).unwrap()),
                to_f32(&gpu.download(&out).unwrap()),
            );
            // Each pair's rows where the grouping put them, against the reference of its token
            // through its expert; the combine from the GPU's own expert outputs.
            let gemm = tokens > 8;
            let (mut want_act, mut got_act, mut want_y, mut got_y) = (vec![], vec![], vec![], vec![]);
            let mut want_out = vec![0f32; tokens * hidden];
            for p in 0..pairs {
                let (t, e, g) = (p / k, ids[p] as usize, pos[p] as usize);
                let gu = expert_dot(&gate_up, e, (2 * inter, hidden), &xf[t * hidden..(t + 1) * hidden], gemm);
                let a: Vec<f32> = (0..inter).map(|j| round(silu(round(gu[j])) * round(gu[inter + j]))).collect();
                let gpu_act = &act[g * inter..(g + 1) * inter];
                want_y.extend(expert_dot(&down, e, (hidden, inter), gpu_act, gemm).iter().map(|&v| round(v)));
                want_act.extend(a);
                got_act.extend_from_slice(gpu_act);
                let gpu_y = &y[g * hidden..(g + 1) * hidden];
                got_y.extend_from_slice(gpu_y);
                for (o, &v) in want_out[t * hidden..(t + 1) * hidden].iter_mut().zip(gpu_y) {
                    *o += weights[p] * v;
                }
            }
            let want_out: Vec<f32> = want_out.iter().map(|&v| round(v)).collect();
            let atol = |v: &[f32]| v.iter().fold(0f32, |m, x| m.max(x.abs())) / 256.0;
            compare("moe_experts", &format!("{case} gate-up"), &got_act, &want_act, atol(&want_act), RTOL);
            compare("moe_experts", &format!("{case} down"), &got_y, &want_y, atol(&want_y), RTOL);
            compare("moe_experts", &format!("{case} combine"), &out, &want_out, atol(&want_out), RTOL);
        }
    }
}

#[test]
fn cuda_moe_experts_match_reference_loops() {
    let Some((gpu, _checks)) = gpu("cuda_moe_experts_match_reference_loops") else { return };
    let mut rng = rng("moe_experts");
    // bf16 rows of multiples of 8 only (K steps with a ragged end); blocks need whole blocks;
    // FP8 rows multiples of 16 (gate-up rows of 176 and 112: K steps with a ragged end).
    experts_case(gpu, &mut rng, Format::Upload(DType::BF16), (200, 72));
    experts_case(gpu, &mut rng, Format::Upload(DType::BF16), (64, 16));
    experts_case(gpu, &mut rng, Format::Upload(DType::Q4K), (256, 512));
    experts_case(gpu, &mut rng, Format::Upload(DType::Q8_0), (96, 160));
    experts_case(gpu, &mut rng, Format::Upload(mlx(4, 64, MlxScale::Bf16)), (256, 192));
    experts_case(gpu, &mut rng, Format::Upload(mlx(8, 32, MlxScale::F32)), (96, 160));
    // Runs of 128 (gate-up: 3 along a row, the last partial; down: one block wider than the
    // row), runs of 32 (6 and 3 a row), a scale a row.
    experts_case(gpu, &mut rng, Format::Fp8(128), (336, 96));
    experts_case(gpu, &mut rng, Format::Fp8(32), (192, 96));
    experts_case(gpu, &mut rng, Format::Fp8(0), (176, 48));
    experts_case(gpu, &mut rng, Format::Fp8Quantized, (112, 64));
}

/// Random FP8 experts (synthetic models): every product finite and not all zero.
#[test]
fn cuda_moe_random_fp8_experts_are_finite() {
    let Some((gpu, _checks)) = gpu("cuda_moe_random_fp8_experts_are_finite") else { return };
    let mut rng = rng("moe_random_fp8");
    let (experts, k, hidden, inter, tokens) = (8, 2, 256, 128, 12);
    let w = ExpertMatrix::random(gpu, DType::F8E4M3, (experts, 2 * inter, hidden), 3, 0.1).unwrap();
    let mut r = MoeRoute::new(gpu, tokens, experts, k).unwrap();
    let l = logits(&mut rng, tokens, experts, None, None);
    let x = gpu.upload(&rand_bf16(&mut rng, tokens * hidden, 1.0).0).unwrap();
    for m in [3, tokens] {
        route_on_gpu(gpu, &mut r, &l[..m * experts], m, true, None);
        let mut act = poisoned_bf16(gpu, m * k * inter);
        ops::moe_linear(gpu, ExpertProduct::Gated(GatedActivation::Silu), &x, true, &w, &r, m, &mut act).unwrap();
        let act = to_f32(&gpu.download(&act).unwrap());
        assert!(act.iter().all(|v| v.is_finite()), "{m} tokens: random FP8 experts gave a non-finite value");
        assert!(act.iter().any(|&v| v != 0.0), "{m} tokens: random FP8 experts gave zeros");
    }
    // A step of fewer tokens than the routing holds is refused (its rows lie past the buffers).
    let mut act = poisoned_bf16(gpu, 3 * k * inter);
    assert!(ops::moe_linear(gpu, ExpertProduct::Gated(GatedActivation::Silu), &x, true, &w, &r, 3, &mut act).is_err());
}

fn mlx(bits: u32, group: usize, scale: MlxScale) -> DType {
    DType::Mlx(MlxFormat::new(bits, group, scale).unwrap())
}

/// A token's expert outputs do not depend on the tokens batched with it: the first 9 tokens'
/// rows alone and inside 150 tokens (both the grouped GEMM, their experts' tiles laid out
/// differently) are bit-equal.
#[test]
fn cuda_moe_rows_do_not_depend_on_the_batch() {
    let Some((gpu, _checks)) = gpu("cuda_moe_rows_do_not_depend_on_the_batch") else { return };
    let mut rng = rng("moe_batch");
    let (experts, k, hidden, inter) = (8, 2, 256, 256);
    let formats = [Format::Upload(DType::BF16), Format::Upload(DType::Q4K), Format::Upload(mlx(4, 128, MlxScale::F16))];
    for format in formats.into_iter().chain([Format::Fp8(128)]) {
        let gate_up = expert_weights(gpu, &mut rng, format, (experts, 2 * inter, hidden));
        let l = logits(&mut rng, 150, experts, None, None);
        let (xh, _) = rand_bf16(&mut rng, 150 * hidden, 1.0);
        let rows_of = |tokens: usize| -> Vec<u16> {
            let mut r = MoeRoute::new(gpu, tokens, experts, k).unwrap();
            route_on_gpu(gpu, &mut r, &l[..tokens * experts], tokens, true, None);
            let x = gpu.upload(&xh[..tokens * hidden]).unwrap();
            let mut act = poisoned_bf16(gpu, tokens * k * inter);
            let gated = ExpertProduct::Gated(GatedActivation::Silu);
            ops::moe_linear(gpu, gated, &x, true, &gate_up.dev, &r, tokens, &mut act).unwrap();
            let pos = gpu.download(&r.grouping()[3].slice(..tokens * k)).unwrap();
            let act = gpu.download(&act).unwrap();
            // The first 9 tokens' rows, by pair.
            pos[..9 * k]
                .iter()
                .flat_map(|&g| act[g as usize * inter..(g as usize + 1) * inter].iter().map(|v| v.to_bits()))
                .collect()
        };
        let (alone, batched) = (rows_of(9), rows_of(150));
        let same = alone.iter().zip(&batched).filter(|(a, b)| a == b).count();
        println!("TABLE|moe_batch|{format:?} 9 tokens alone vs in 150|{same}/{} bit-equal|", alone.len());
        assert_eq!(same, alone.len(), "{format:?}: a token's expert rows depend on its batch");
    }
}
