//! Attention for rows with many query tokens (prefill chunks) at the scalar level (from AVX2 on
//! they take `flash`), as GEMMs over query tiles.
//!
//! Per (row, KV head, tile of `TILE` query tokens): the keys and values the tile can see are
//! gathered from the cache blocks into contiguous f32 scratch (values transposed), the tile's
//! queries (all `group` heads of the KV head, stacked) multiply them as two f32 GEMMs (the
//! `gemm` crate) — `S = Q·Kᵀ`, then `O = softmax(S)·V` — with the causal / sliding-window
//! mask applied to each score row in between (masked scores get probability 0).

use gemm::Parallelism;

use super::vf32::{self, KvSource, Vf32};
use super::{for_each_kv_run, for_each_query_tile, visible_range, AttentionParams, Pools, QueryTile};
use crate::batch::{ForwardBatch, RowSpan};
use crate::cpu::matmul::gemm_f32;
use crate::cpu::qmatmul::Level;
use crate::cpu::SharedMut;
use crate::error::{Result, RuntimeError};
use crate::kv::LayerKv;

/// Query tokens per tile.
const TILE: usize = 32;

#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    k: Vec<f32>,
    /// Values transposed: `[head_dim][keys]`.
    vt: Vec<f32>,
    /// One block's run of values as f32, before the transpose.
    run: Vec<f32>,
    s: Vec<f32>,
    o: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
pub(super) fn attend<S: KvSource>(
    q: &[f32],
    batch: &ForwardBatch,
    rows: &[&RowSpan],
    layer: &LayerKv,
    pools: Pools<S>,
    block_size: usize,
    p: &AttentionParams,
    level: Level,
    out: &mut [f32],
) -> Result<()> {
    let dst = SharedMut(out.as_mut_ptr());
    for_each_query_tile(rows, layer, p, TILE, q.len().min(out.len()), Scratch::default, |s, t| {
        let (hd, group) = (p.head_dim, p.n_heads / p.n_kv_heads);
        tile(q, batch, t, layer, pools, block_size, p, level, s)?;
        for (i, tok) in t.tokens.clone().enumerate() {
            let at = (tok * p.n_heads + t.g * group) * hd;
            // SAFETY: token tok's heads g*group..(g+1)*group are written by this tile only, and
            // lie inside `out` (checked by `for_each_query_tile`).
            let o = unsafe { std::slice::from_raw_parts_mut(dst.ptr().add(at), group * hd) };
            o.copy_from_slice(&s.o[i * group * hd..(i + 1) * group * hd]);
        }
        Ok(())
    })
}

/// Compute the tile's outputs into `s.o` (`[token][head in group][head_dim]`).
#[allow(clippy::too_many_arguments)]
fn tile<S: KvSource>(
    q: &[f32],
    batch: &ForwardBatch,
    &QueryTile { table, context_len, g, ref tokens }: &QueryTile<'_>,
    layer: &LayerKv,
    pools: Pools<S>,
    block_size: usize,
    p: &AttentionParams,
    level: Level,
    s: &mut Scratch,
) -> Result<()> {
    let (nh, hd, group) = (p.n_heads, p.head_dim, p.n_heads / p.n_kv_heads);
    // Both ends of the visible range grow with the position.
    let first = visible_range(batch.positions[tokens.start] as usize, context_len, p).start;
    let last = visible_range(batch.positions[tokens.end - 1] as usize, context_len, p).end - 1;
    let n_keys = last + 1 - first;
    // Gather keys and values [first, last] of head g.
    s.k.resize(n_keys * hd, 0.0);
    s.vt.resize(n_keys * hd, 0.0);
    for_each_kv_run(table, g, first..last + 1, layer, pools, block_size, |pos, src, len| {
        let at = pos - first;
        pools.k.widen(src, &mut s.k[at * hd..at * hd + len]);
        s.run.resize(len, 0.0);
        pools.v.widen(src, &mut s.run);
        for (j, v) in s.run.chunks_exact(hd).enumerate() {
            for (d, &x) in v.iter().enumerate() {
                s.vt[d * n_keys + at + j] = x;
            }
        }
    })?;
    // Stack the tile's queries: row (token i, head qh) = i * group + qh.
    let m = tokens.len() * group;
    s.q.clear();
    for t in tokens.clone() {
        let at = (t * nh + g * group) * hd;
        s.q.extend_from_slice(
            q.get(at..at + group * hd).ok_or_else(|| RuntimeError::Shape("attention: query out of range".into()))?,
        );
    }
    s.s.resize(m * n_keys, 0.0);
    product(&s.q, m, hd, &s.k, n_keys, &mut s.s);
    for (i, t) in tokens.clone().enumerate() {
        let vis = visible_range(batch.positions[t] as usize, context_len, p);
        let (lo, hi) = (vis.start - first, vis.end - first);
        for qh in 0..group {
            let r = &mut s.s[(i * group + qh) * n_keys..(i * group + qh + 1) * n_keys];
            r[..lo].fill(0.0);
            r[hi..].fill(0.0);
            softmax(&mut r[lo..hi], p, level);
        }
    }
    s.o.resize(m * hd, 0.0);
    product(&s.s, m, n_keys, &s.vt, hd, &mut s.o);
    Ok(())
}

/// `c[m, cols] = x[m, k] · panel[cols, k]ᵀ` (both row-major).
fn product(x: &[f32], m: usize, k: usize, panel: &[f32], cols: usize, c: &mut [f32]) {
    gemm_f32(x, m, panel, cols, k, c, cols, Parallelism::None);
}

/// Scale (and soft-cap) the visible scores, then softmax them in place.
fn softmax(r: &mut [f32], p: &AttentionParams, level: Level) {
    for v in r.iter_mut() {
        *v *= p.scale;
        if let Some(cap) = p.softcap {
            *v = cap * (*v / cap).tanh();
        }
    }
    #[cfg(target_arch = "x86_64")]
    if level >= Level::Avx2 {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn max_exp_sum_avx2(r: &mut [f32]) -> (f32, f32) {
            vf32::Avx2::max_exp_sum(r)
        }
        // SAFETY: every level from AVX2 up guarantees AVX2 and FMA.
        let inv = 1.0 / unsafe { max_exp_sum_avx2(r) }.1;
        r.iter_mut().for_each(|v| *v *= inv);
        return;
    }
    let _ = level;
    let inv = 1.0 / vf32::Scalar::max_exp_sum(r).1;
    r.iter_mut().for_each(|v| *v *= inv);
}
