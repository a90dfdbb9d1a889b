//! Gated DeltaNet on the CPU: the short causal depthwise convolution over a layer's q/k/v
//! inputs, continuing the window a state slot keeps, and the gated delta rule, whose
//! recurrent matrix per value head carries a sequence from step to step.
//!
//! The recurrence runs as a plain sequential scan, token by token, for prefill chunks and
//! decode alike (decode is the scan of one token). Per value head and token it is two passes
//! over the `[k_dim][v_dim]` matrix `S`, which stays in cache:
//!
//! ```text
//! S ← exp(g) · S;   m = Sᵀk;   δ = β · (v − m);   S ← S + k δᵀ;   o = Sᵀq
//! ```
//!
//! Why not the chunked (WY / UT-transform) form transformers and the CUDA kernels use for
//! prefill: it turns the scan into matmuls, which pays on tensor cores, but its result depends
//! on where chunks start, so a prompt prefilled in engine-sized chunks would not equal the
//! prompt whole, bit for bit — and the sequential scan is already a small part of a step on
//! the CPU (about `4 · k_dim · v_dim` flops per head and token against the projections'
//! `2 · hidden` per weight row). The scan's order is fixed per (row, head), so a row's result
//! never depends on its batch, its chunking or how a verify span is cut.
//!
//! Rows run in parallel over (row, value head). Which slot a row reads and which it writes
//! after which token is the `kv_state::state_rows` rule; rows may share a read slot (a
//! cached prefix), never a written one.

use rayon::prelude::*;

use super::SharedMut;
use crate::error::{Result, RuntimeError};
use crate::kv_state::{check_rows, StatePool, StateRow};

/// The head layout of a gated DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaShape {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    /// Value head `h` reads key head `h % k_heads` (llama.cpp's Qwen3.5 files, whose value
    /// heads are stored tiled); otherwise `h / (v_heads / k_heads)` (grouped, as trained).
    pub tiled: bool,
}

impl DeltaShape {
    /// The key (and query) head value head `h` reads.
    pub fn k_head(&self, h: usize) -> usize {
        if self.tiled {
            h % self.k_heads
        } else {
            h / (self.v_heads / self.k_heads).max(1)
        }
    }
}

/// The causal depthwise convolution of each row's tokens of `x` (`[tokens, channels]`), then
/// SiLU, in place: token `t` of a row becomes `silu(Σ_j w[j] · in[t − (kernel − 1) + j])`,
/// where the inputs before the row's first token come from its read slot's window (zeros at
/// a sequence's start). `weight` is tap-major, `[kernel][channels]`. Each write of a row
/// stores the window after its first `n` tokens (their last `kernel − 1` inputs).
pub fn causal_conv_silu(
    x: &mut [f32],
    weight: &[f32],
    kernel: usize,
    pool: &mut StatePool,
    rows: &[StateRow],
) -> Result<()> {
    let c = pool.spec.conv_channels;
    if kernel == 0 || kernel != pool.spec.conv_kernel || weight.len() != kernel * c || !x.len().is_multiple_of(c) {
        return Err(RuntimeError::Shape(format!(
            "conv of {c} channels, {kernel} taps: weight {}, input {}",
            weight.len(),
            x.len()
        )));
    }
    check_rows(pool.slots(), rows)?;
    let keep = kernel - 1;
    for row in rows {
        let n = row.tokens.len();
        if row.tokens.end * c > x.len() {
            return Err(RuntimeError::Shape(format!("row tokens {:?} past the input", row.tokens)));
        }
        // The row's inputs after the window they continue: `[keep + n][channels]`.
        let mut ext = vec![0f32; (keep + n) * c];
        if let Some(slot) = row.read {
            ext[..keep * c].copy_from_slice(pool.conv(slot)?);
        }
        let xs = &mut x[row.tokens.start * c..row.tokens.end * c];
        ext[keep * c..].copy_from_slice(xs);
        let conv_token = |t: usize, out: &mut [f32]| {
            out.fill(0.0);
            for (j, w) in weight.chunks_exact(c).enumerate() {
                let input = &ext[(t + j) * c..(t + j + 1) * c];
                out.iter_mut().zip(w).zip(input).for_each(|((o, w), i)| *o += w * i);
            }
            super::activation::silu(out);
        };
        if n * c * kernel >= PARALLEL_WORK {
            xs.par_chunks_exact_mut(c).enumerate().for_each(|(t, out)| conv_token(t, out));
        } else {
            xs.chunks_exact_mut(c).enumerate().for_each(|(t, out)| conv_token(t, out));
        }
        for &(upto, slot) in &row.writes {
            pool.conv_mut(slot)?.copy_from_slice(&ext[upto * c..(upto + keep) * c]);
        }
    }
    Ok(())
}

/// Multiply-adds of a row's conv above which its tokens run in parallel.
const PARALLEL_WORK: usize = 1 << 15;

/// Scale each `dim`-wide row of `x` to `scale · x / sqrt(Σx² + eps)` (the queries' and keys'
/// L2 norm; the queries also take `1/sqrt(k_dim)`).
pub fn l2_normalize(x: &mut [f32], dim: usize, eps: f32, scale: f32) {
    let row = |r: &mut [f32]| {
        let ss: f32 = r.iter().map(|v| v * v).sum();
        let inv = scale / (ss + eps).sqrt();
        r.iter_mut().for_each(|v| *v *= inv);
    };
    if x.len() >= PARALLEL_WORK {
        x.par_chunks_exact_mut(dim).for_each(row);
    } else {
        x.chunks_exact_mut(dim).for_each(row);
    }
}

/// The per-token gates of each value head from the projections `b` and `a` (`[tokens,
/// v_heads]`, `v_heads` the length of `neg_rate` and `dt_bias`): the write strength
/// `β = sigmoid(b)` and the log decay `g = neg_rate · softplus(a + dt_bias)` (`neg_rate` is
/// `−exp(A_log)`). Returns `(β, g)`.
pub fn gates(b: &[f32], a: &[f32], neg_rate: &[f32], dt_bias: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let nv = neg_rate.len().max(1);
    let beta = b.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
    let g = a.iter().enumerate().map(|(i, &x)| neg_rate[i % nv] * softplus(x + dt_bias[i % nv])).collect();
    (beta, g)
}

/// `log(1 + exp(x))`, linear above 20 as torch's softplus.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The gated delta rule over each row's tokens: `q`, `k` are `[tokens, k_heads · k_dim]`
/// (normalized), `v` is `[tokens, v_heads · v_dim]`, `g` (log decay, ≤ 0) and `beta` are
/// `[tokens, v_heads]`; writes `out` (`[tokens, v_heads · v_dim]`). Each row starts from its
/// read slot's matrices (zero at a sequence's start) and stores them after the token counts
/// its writes name.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    shape: &DeltaShape,
    pool: &mut StatePool,
    rows: &[StateRow],
    out: &mut [f32],
) -> Result<()> {
    let DeltaShape { k_heads, v_heads, k_dim, v_dim, .. } = *shape;
    let spec = pool.spec;
    let t = g.len() / v_heads.max(1);
    let ok = v_heads > 0
        && k_heads > 0
        && v_heads.is_multiple_of(k_heads)
        && (spec.heads, spec.k_dim, spec.v_dim) == (v_heads, k_dim, v_dim)
        && q.len() == t * k_heads * k_dim
        && k.len() == q.len()
        && v.len() == t * v_heads * v_dim
        && g.len() == t * v_heads
        && beta.len() == g.len()
        && out.len() == v.len()
        && rows.iter().all(|r| r.tokens.end <= t);
    if !ok {
        return Err(RuntimeError::Shape(format!(
            "gated delta rule over {t} tokens: {v_heads} value heads of {v_dim}, {k_heads} key heads of {k_dim} \
             (state {}×{}×{}), q {} k {} v {} out {}",
            spec.heads,
            spec.k_dim,
            spec.v_dim,
            q.len(),
            k.len(),
            v.len(),
            out.len()
        )));
    }
    check_rows(pool.slots(), rows)?;
    let per_head = k_dim * v_dim;
    let per_slot = spec.ssm_values();
    // Every read happens before any write in the same task, and no other task writes a slot
    // a task reads or writes (`check_rows`): each (row, head) task touches its head's part of
    // its own slots, and its tokens' part of `out`.
    let states = SharedMut(pool.ssm_all_mut().as_mut_ptr());
    let outp = SharedMut(out.as_mut_ptr());
    let tasks: Vec<(usize, usize)> = (0..rows.len()).flat_map(|r| (0..v_heads).map(move |h| (r, h))).collect();
    tasks.into_par_iter().for_each(|(r, h)| {
        let row = &rows[r];
        let kh = shape.k_head(h);
        let mut s = vec![0f32; per_head];
        if let Some(slot) = row.read {
            let at = slot as usize * per_slot + h * per_head;
            // SAFETY: `check_rows` checked the slot exists; this region is only written by
            // this task (a slot read by a row is written by no other row).
            let src = unsafe { std::slice::from_raw_parts(states.ptr().add(at), per_head) };
            s.copy_from_slice(src);
        }
        let (mut mem, mut delta) = (vec![0f32; v_dim], vec![0f32; v_dim]);
        let mut writes = row.writes.iter().peekable();
        for (i, tok) in row.tokens.clone().enumerate() {
            let qv = &q[(tok * k_heads + kh) * k_dim..][..k_dim];
            let kv = &k[(tok * k_heads + kh) * k_dim..][..k_dim];
            let vv = &v[(tok * v_heads + h) * v_dim..][..v_dim];
            let decay = g[tok * v_heads + h].exp();
            let b = beta[tok * v_heads + h];
            mem.fill(0.0);
            for (srow, &kr) in s.chunks_exact_mut(v_dim).zip(kv) {
                srow.iter_mut().zip(mem.iter_mut()).for_each(|(x, m)| {
                    *x *= decay;
                    *m += kr * *x;
                });
            }
            delta.iter_mut().zip(vv).zip(&mem).for_each(|((d, v), m)| *d = b * (v - m));
            // SAFETY: token `tok`'s head `h` part of `out`, written by this task only.
            let o = unsafe { std::slice::from_raw_parts_mut(outp.ptr().add((tok * v_heads + h) * v_dim), v_dim) };
            o.fill(0.0);
            for ((srow, &kr), &qr) in s.chunks_exact_mut(v_dim).zip(kv).zip(qv) {
                srow.iter_mut().zip(delta.iter()).zip(o.iter_mut()).for_each(|((x, d), o)| {
                    *x += kr * d;
                    *o += qr * *x;
                });
            }
            while let Some(&&(n, slot)) = writes.peek() {
                if n != i + 1 {
                    break;
                }
                let at = slot as usize * per_slot + h * per_head;
                // SAFETY: a slot this row writes, head `h`'s part: written by this task only.
                unsafe { std::slice::from_raw_parts_mut(states.ptr().add(at), per_head) }.copy_from_slice(&s);
                writes.next();
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests;
