//! The DeltaNet kernels against plain f64 reference loops on odd lengths, and the invariances
//! the engine relies on: a row cut into chunks (its state carried through a slot) equals the
//! row whole bit for bit, rows batched equal rows alone, a verify span's per-token states equal
//! the states of shorter runs, and slots two rows would race on are refused.

use rand::{Rng, SeedableRng};

use super::*;
use crate::kv_state::StateSpec;

const SHAPE: DeltaShape = DeltaShape { k_heads: 2, v_heads: 4, k_dim: 8, v_dim: 6, tiled: false };
const KERNEL: usize = 4;

fn spec() -> StateSpec {
    let c = 2 * SHAPE.k_heads * SHAPE.k_dim + SHAPE.v_heads * SHAPE.v_dim;
    StateSpec { conv_channels: c, conv_kernel: KERNEL, heads: 4, k_dim: 8, v_dim: 6, group: 0 }
}

/// Random inputs of `t` tokens: (q, k, v, g, beta), q and k normalized.
struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

fn inputs(t: usize, seed: u64) -> Inputs {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut r = |n: usize, lo: f32, hi: f32| (0..n).map(|_| rng.random_range(lo..hi)).collect::<Vec<f32>>();
    let s = SHAPE;
    let mut q = r(t * s.k_heads * s.k_dim, -1.0, 1.0);
    let mut k = r(t * s.k_heads * s.k_dim, -1.0, 1.0);
    l2_normalize(&mut q, s.k_dim, 1e-6, 1.0 / (s.k_dim as f32).sqrt());
    l2_normalize(&mut k, s.k_dim, 1e-6, 1.0);
    Inputs {
        q,
        k,
        v: r(t * s.v_heads * s.v_dim, -2.0, 2.0),
        g: r(t * s.v_heads, -1.5, -0.01),
        beta: r(t * s.v_heads, 0.05, 0.95),
    }
}

impl Inputs {
    /// Tokens `range` only.
    fn slice(&self, range: std::ops::Range<usize>) -> Inputs {
        let s = SHAPE;
        let cut = |x: &[f32], w: usize| x[range.start * w..range.end * w].to_vec();
        Inputs {
            q: cut(&self.q, s.k_heads * s.k_dim),
            k: cut(&self.k, s.k_heads * s.k_dim),
            v: cut(&self.v, s.v_heads * s.v_dim),
            g: cut(&self.g, s.v_heads),
            beta: cut(&self.beta, s.v_heads),
        }
    }

    /// The kernel over these tokens as rows `rows`; the output.
    fn run(&self, pool: &mut StatePool, rows: &[StateRow]) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.v.len()];
        gated_delta_rule(&self.q, &self.k, &self.v, &self.g, &self.beta, &SHAPE, pool, rows, &mut out)?;
        Ok(out)
    }
}

/// The recurrence as written, in f64: the output of every token and the final matrices.
fn reference(x: &Inputs, t: usize) -> (Vec<f64>, Vec<f64>) {
    let s = SHAPE;
    let (dk, dv) = (s.k_dim, s.v_dim);
    let mut out = vec![0f64; t * s.v_heads * dv];
    let mut states = vec![0f64; s.v_heads * dk * dv];
    for h in 0..s.v_heads {
        let kh = h / (s.v_heads / s.k_heads);
        let st = &mut states[h * dk * dv..(h + 1) * dk * dv];
        for tok in 0..t {
            let q = |i: usize| x.q[(tok * s.k_heads + kh) * dk + i] as f64;
            let k = |i: usize| x.k[(tok * s.k_heads + kh) * dk + i] as f64;
            let v = |j: usize| x.v[(tok * s.v_heads + h) * dv + j] as f64;
            let decay = (x.g[tok * s.v_heads + h] as f64).exp();
            let beta = x.beta[tok * s.v_heads + h] as f64;
            st.iter_mut().for_each(|e| *e *= decay);
            for j in 0..dv {
                let mem: f64 = (0..dk).map(|i| st[i * dv + j] * k(i)).sum();
                let delta = beta * (v(j) - mem);
                (0..dk).for_each(|i| st[i * dv + j] += k(i) * delta);
            }
            for j in 0..dv {
                out[(tok * s.v_heads + h) * dv + j] = (0..dk).map(|i| st[i * dv + j] * q(i)).sum();
            }
        }
    }
    (out, states)
}

fn close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (*g as f64 - w).abs() / w.abs().max(1.0);
        assert!(err < 2e-5, "{what} [{i}]: {g} vs {w}");
    }
}

fn row(tokens: std::ops::Range<usize>, read: Option<u32>, writes: Vec<(usize, u32)>) -> StateRow {
    StateRow { tokens, read, writes }
}

#[test]
fn the_scan_matches_the_reference_loop_on_odd_lengths() {
    for t in [1, 5, 13, 31] {
        let x = inputs(t, t as u64);
        let mut pool = StatePool::zeroed(spec(), 2);
        let out = x.run(&mut pool, &[row(0..t, None, vec![(t, 1)])]).expect("scan");
        let (want_out, want_state) = reference(&x, t);
        close(&out, &want_out, &format!("output, {t} tokens"));
        close(pool.ssm(1).expect("slot"), &want_state, &format!("state, {t} tokens"));
    }
}

#[test]
fn chunks_carried_through_a_slot_equal_the_row_whole_bit_for_bit() {
    let t = 23;
    let x = inputs(t, 7);
    let mut pool = StatePool::zeroed(spec(), 3);
    let whole = x.run(&mut pool, &[row(0..t, None, vec![(t, 0)])]).expect("whole");
    let mut pieces = Vec::new();
    let mut read = None;
    for (a, b) in [(0, 1), (1, 8), (8, 9), (9, 23)] {
        let slot = if read == Some(1) { 2 } else { 1 };
        pieces.extend(x.slice(a..b).run(&mut pool, &[row(0..b - a, read, vec![(b - a, slot)])]).expect("chunk"));
        read = Some(slot);
    }
    assert_eq!(pieces, whole);
    assert_eq!(pool.ssm(read.expect("slot")).expect("slot"), pool.ssm(0).expect("slot"));
}

#[test]
fn rows_batched_equal_rows_alone_and_spans_hold_every_prefix_state() {
    let (a, b) = (inputs(9, 1), inputs(6, 2));
    let mut joined = a.slice(0..9);
    for (dst, src) in [(&mut joined.q, &b.q), (&mut joined.k, &b.k), (&mut joined.v, &b.v)] {
        dst.extend(src);
    }
    joined.g.extend(&b.g);
    joined.beta.extend(&b.beta);
    let mut pool = StatePool::zeroed(spec(), 16);
    // Row 1 is a verify row: its state after each of its first 5 tokens goes to slots 10..15.
    let span: Vec<(usize, u32)> = (1..6).map(|n| (n, 9 + n as u32)).chain([(6, 1)]).collect();
    let together = joined.run(&mut pool, &[row(0..9, None, vec![(9, 0)]), row(9..15, None, span)]).expect("batch");
    let mut alone = StatePool::zeroed(spec(), 16);
    let mut want = a.run(&mut alone, &[row(0..9, None, vec![(9, 0)])]).expect("a");
    want.extend(b.run(&mut alone, &[row(0..6, None, vec![(6, 1)])]).expect("b"));
    assert_eq!(together, want);
    assert_eq!(pool.ssm(0).expect("slot"), alone.ssm(0).expect("slot"));
    for n in 1..6 {
        let mut short = StatePool::zeroed(spec(), 1);
        b.slice(0..n).run(&mut short, &[row(0..n, None, vec![(n, 0)])]).expect("prefix");
        assert_eq!(pool.ssm(9 + n as u32).expect("span"), short.ssm(0).expect("slot"), "span state after {n}");
    }
}

#[test]
fn slots_two_rows_would_race_on_are_refused() {
    let x = inputs(4, 3);
    let mut pool = StatePool::zeroed(spec(), 4);
    let err = |rows: &[StateRow]| x.run(&mut StatePool::zeroed(spec(), 4), rows).is_err();
    assert!(err(&[row(0..2, None, vec![(2, 1)]), row(2..4, None, vec![(2, 1)])]), "two rows write one slot");
    assert!(err(&[row(0..2, None, vec![(2, 1)]), row(2..4, Some(1), vec![(2, 2)])]), "a row reads another's slot");
    assert!(err(&[row(0..4, None, vec![(4, 9)])]), "a slot past the pool");
    // Two rows reading one cached slot is fine.
    x.run(&mut pool, &[row(0..2, Some(3), vec![(2, 1)]), row(2..4, Some(3), vec![(2, 2)])]).expect("shared read");
}

/// The conv as written: `silu(Σ_j w[j][c] · in[t − (K − 1) + j][c])`, zeros before the start.
fn conv_reference(x: &[f32], w: &[f32], c: usize) -> Vec<f64> {
    let t = x.len() / c;
    let mut out = vec![0f64; x.len()];
    for tok in 0..t {
        for ch in 0..c {
            let mut acc = 0f64;
            for j in 0..KERNEL {
                let src = tok as isize - (KERNEL as isize - 1) + j as isize;
                if src >= 0 {
                    acc += w[j * c + ch] as f64 * x[src as usize * c + ch] as f64;
                }
            }
            out[tok * c + ch] = acc / (1.0 + (-acc).exp());
        }
    }
    out
}

#[test]
fn the_conv_matches_the_reference_and_carries_its_window_across_chunks() {
    let c = spec().conv_channels;
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for t in [1, 2, 7, 19] {
        let x: Vec<f32> = (0..t * c).map(|_| rng.random_range(-2.0..2.0)).collect();
        let w: Vec<f32> = (0..KERNEL * c).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut whole = x.clone();
        let mut pool = StatePool::zeroed(spec(), 3);
        causal_conv_silu(&mut whole, &w, KERNEL, &mut pool, &[row(0..t, None, vec![(t, 0)])]).expect("conv");
        close(&whole, &conv_reference(&x, &w, c), &format!("conv, {t} tokens"));
        // One token at a time, the window carried through slots 1 and 2.
        let mut read = None;
        let mut stepped = Vec::new();
        for tok in 0..t {
            let mut one = x[tok * c..(tok + 1) * c].to_vec();
            let slot = if read == Some(1) { 2 } else { 1 };
            causal_conv_silu(&mut one, &w, KERNEL, &mut pool, &[row(0..1, read, vec![(1, slot)])]).expect("step");
            stepped.extend(one);
            read = Some(slot);
        }
        assert_eq!(stepped, whole, "{t} tokens one at a time");
        assert_eq!(pool.conv(read.expect("slot")).expect("slot"), pool.conv(0).expect("slot"));
    }
}

#[test]
fn gates_are_sigmoid_and_scaled_softplus() {
    assert_eq!(softplus(30.0), 30.0);
    assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
    // Two tokens of two heads: head h takes neg_rate[h] and dt_bias[h].
    let (beta, g) = gates(&[0.0, 2.0, -1.0, 0.5], &[0.0, 1.0, 25.0, -3.0], &[-1.0, -0.5], &[0.0, -1.0]);
    assert_eq!(beta[0], 0.5);
    assert!((beta[1] - 1.0 / (1.0 + (-2.0f32).exp())).abs() < 1e-7);
    assert!((g[0] + std::f32::consts::LN_2).abs() < 1e-7);
    assert!((g[1] + 0.5 * std::f32::consts::LN_2).abs() < 1e-7);
    assert_eq!(g[2], -25.0);
    assert!((g[3] + 0.5 * (-4.0f32).exp().ln_1p()).abs() < 1e-7);
}
