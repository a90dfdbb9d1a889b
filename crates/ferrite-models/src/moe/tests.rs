//! The MoE block against plain reference loops: every token through each of its experts
//! alone, summed in ascending expert order — for f32 and Q8_0 experts, an odd token count, an
//! expert no token picks and all tokens on one expert; routing with and without
//! renormalization; and (quantized weights) a row's output independent of the rows batched
//! with it.

use std::sync::Arc;

use ferrite_runtime::{Buffer, DType, Tensor};
use rand::{Rng, SeedableRng};

use super::*;

const HIDDEN: usize = 64;
const INTER: usize = 32;

fn values(rng: &mut impl Rng, n: usize, std: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.random::<f32>() - 0.5) * 3.4 * std).collect()
}

/// `values` (`rows × cols`, cols a multiple of 32) as Q8_0 blocks: a f16 scale, 32 codes.
fn q8_0(rows: usize, cols: usize, v: &[f32]) -> Tensor {
    let mut bytes = Vec::with_capacity(rows * cols / 32 * 34);
    for block in v.chunks_exact(32) {
        let d = block.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
        let d16 = half::f16::from_f32(d);
        bytes.extend(d16.to_le_bytes());
        let inv = if d16.to_f32() > 0.0 { 1.0 / d16.to_f32() } else { 0.0 };
        bytes.extend(block.iter().map(|x| ((x * inv).round().clamp(-127.0, 127.0) as i8) as u8));
    }
    Tensor::new(DType::Q8_0, vec![rows, cols], Buffer::Bytes(Arc::new(bytes))).expect("q8_0 tensor")
}

fn matrix(rng: &mut impl Rng, rows: usize, cols: usize, dtype: DType) -> Linear {
    let v = values(rng, rows * cols, 0.15);
    let t = match dtype {
        DType::Q8_0 => q8_0(rows, cols, &v),
        _ => Tensor::from_f32(vec![rows, cols], v).expect("tensor"),
    };
    cpu::prepare_linear(&t);
    Linear::from_tensor(t)
}

fn experts(n: usize, dtype: DType, seed: u64) -> Experts {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let experts = (0..n)
        .map(|_| {
            let gate = matrix(&mut rng, INTER, HIDDEN, dtype);
            let up = matrix(&mut rng, INTER, HIDDEN, dtype);
            Mlp::gated(gate, up, matrix(&mut rng, HIDDEN, INTER, dtype), Activation::Silu)
        })
        .collect();
    Experts { experts, hidden: HIDDEN }
}

/// Each token alone through each of its experts, in ascending expert order.
fn reference(e: &Experts, x: &[f32], routes: &[Vec<(usize, f32)>]) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (tok, route) in routes.iter().enumerate() {
        let row = &x[tok * HIDDEN..(tok + 1) * HIDDEN];
        let mut sorted = route.clone();
        sorted.sort_by_key(|&(expert, _)| expert);
        for (expert, w) in sorted {
            let mut y = vec![0f32; HIDDEN];
            e.experts[expert].forward(row, 1, &mut y, LayerLora::NONE).expect("expert");
            out[tok * HIDDEN..(tok + 1) * HIDDEN].iter_mut().zip(&y).for_each(|(o, v)| *o += v * w);
        }
    }
    out
}

#[test]
fn gathered_experts_equal_the_plain_loop() {
    let tokens = 7;
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let x = values(&mut rng, tokens * HIDDEN, 1.0);
    // Expert 2 gets no token; best-first order differs from expert order.
    let mixed: Vec<Vec<(usize, f32)>> = (0..tokens)
        .map(|t| {
            let w = 0.3 + t as f32 * 0.01;
            if t % 2 == 0 {
                vec![(0, 0.7), (1, w)]
            } else {
                vec![(3, 0.7), (0, w)]
            }
        })
        .collect();
    assert!(mixed.iter().all(|r| r.iter().all(|(e, _)| *e != 2)));
    // Every token on expert 1 (with expert 3 as its second choice).
    let one: Vec<Vec<(usize, f32)>> = (0..tokens).map(|t| vec![(1, 0.9 - t as f32 * 0.05), (3, 0.1)]).collect();
    for dtype in [DType::F32, DType::Q8_0] {
        let e = experts(4, dtype, 9);
        for (name, routes) in [("mixed", &mixed), ("one expert", &one)] {
            let mut out = vec![f32::NAN; x.len()];
            e.mix(&x, routes, &mut out).expect("mix");
            let want = reference(&e, &x, routes);
            if dtype == DType::F32 {
                // The f32 GEMM's tiling depends on the row count (last-bit differences).
                let worst = out.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst < 1e-5, "{name}: {worst}");
            } else {
                // The quantized kernels give a row the same result in any batch.
                assert_eq!(out, want, "{dtype:?} {name}");
            }
            assert!(out.iter().all(|v| v.is_finite()) && out.iter().any(|v| *v != 0.0));
        }
    }
}

#[test]
fn mix_refuses_routes_that_do_not_fit() {
    let e = experts(2, DType::F32, 1);
    let x = vec![0.5f32; 2 * HIDDEN];
    let mut out = vec![0f32; 2 * HIDDEN];
    assert!(e.mix(&x, &[vec![(0, 1.0)], vec![(2, 1.0)]], &mut out).is_err(), "expert 2 of 2");
    assert!(e.mix(&x, &[vec![(0, 1.0)]], &mut out).is_err(), "one route for two tokens");
}

#[test]
fn routes_are_the_top_k_renormalized_when_asked() {
    let logits = [1.0f32, 3.0, 2.0, 0.0];
    let probs: Vec<f32> = {
        let mut p = logits.to_vec();
        cpu::softmax_in_place(&mut p);
        p
    };
    let raw = route_row(&mut logits.clone(), 2, false, None);
    assert_eq!(raw, vec![(1, probs[1]), (2, probs[2])]);
    let norm = route_row(&mut logits.clone(), 2, true, None);
    assert_eq!(norm.iter().map(|r| r.0).collect::<Vec<_>>(), vec![1, 2]);
    assert!((norm[0].1 + norm[1].1 - 1.0).abs() < 1e-6);
    assert!((norm[0].1 / norm[1].1 - probs[1] / probs[2]).abs() < 1e-5);
    // Gemma 4's per-expert scale multiplies the renormalized weight.
    let scaled = route_row(&mut logits.clone(), 2, true, Some(&[1.0, 2.0, 0.5, 1.0]));
    assert_eq!(scaled, vec![(1, norm[0].1 * 2.0), (2, norm[1].1 * 0.5)]);
}

#[test]
fn a_rows_output_does_not_depend_on_its_batch() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let moe = Moe {
        router: matrix(&mut rng, 8, HIDDEN, DType::Q8_0),
        top_k: 2,
        renormalize: true,
        experts: experts(8, DType::Q8_0, 12),
        gemma4: None,
        shared: None,
    };
    let tokens = 9;
    let x = values(&mut rng, tokens * HIDDEN, 1.0);
    let mut batched = vec![0f32; x.len()];
    moe.forward(&x, &x, tokens, &mut batched).expect("batched");
    let routes = moe.route(&x, tokens).expect("routes");
    assert_eq!(batched, reference(&moe.experts, &x, &routes), "the block is its routes' plain loop");
    let used: std::collections::BTreeSet<usize> = routes.iter().flatten().map(|r| r.0).collect();
    assert!(used.len() > 2, "the tokens share experts in several ways: {used:?}");
    for t in 0..tokens {
        let row = &x[t * HIDDEN..(t + 1) * HIDDEN];
        let mut alone = vec![0f32; HIDDEN];
        moe.forward(row, row, 1, &mut alone).expect("alone");
        assert_eq!(alone, batched[t * HIDDEN..(t + 1) * HIDDEN], "token {t}");
    }
}

/// Qwen3-Next's shared expert: every token adds `sigmoid(g · x) · shared(x)` to its routed sum,
/// whatever its batch.
#[test]
fn a_gated_shared_expert_joins_every_token() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    let shared = || {
        let mut r = rand::rngs::StdRng::seed_from_u64(13);
        let (g, u) = (matrix(&mut r, INTER, HIDDEN, DType::Q8_0), matrix(&mut r, INTER, HIDDEN, DType::Q8_0));
        Mlp::gated(g, u, matrix(&mut r, HIDDEN, INTER, DType::Q8_0), Activation::Silu)
    };
    let gate = values(&mut rng, HIDDEN, 0.3);
    let moe = Moe {
        router: matrix(&mut rng, 8, HIDDEN, DType::Q8_0),
        top_k: 2,
        renormalize: true,
        experts: experts(8, DType::Q8_0, 14),
        gemma4: None,
        shared: Some(Shared { mlp: shared(), gate: Some(gate.clone()) }),
    };
    let tokens = 5;
    let x = values(&mut rng, tokens * HIDDEN, 1.0);
    let mut out = vec![0f32; x.len()];
    moe.forward(&x, &x, tokens, &mut out).expect("forward");
    let routed = reference(&moe.experts, &x, &moe.route(&x, tokens).expect("routes"));
    let mut plain = vec![0f32; x.len()];
    shared().forward(&x, tokens, &mut plain, LayerLora::NONE).expect("shared");
    for t in 0..tokens {
        let row = &x[t * HIDDEN..(t + 1) * HIDDEN];
        let g = 1.0 / (1.0 + (-row.iter().zip(&gate).map(|(a, b)| a * b).sum::<f32>()).exp());
        for i in t * HIDDEN..(t + 1) * HIDDEN {
            let want = routed[i] + g * plain[i];
            assert!((out[i] - want).abs() <= 1e-5 * want.abs().max(1.0), "token {t}: {} vs {want}", out[i]);
        }
        let mut alone = vec![0f32; HIDDEN];
        moe.forward(row, row, 1, &mut alone).expect("alone");
        assert_eq!(alone, out[t * HIDDEN..(t + 1) * HIDDEN], "token {t} alone");
    }
}
