//! Attention for rows with few query tokens (decode, verification): per (token, KV head, chunk
//! of key positions), SIMD dot products and axpys straight from the cache blocks.
//!
//! A chunk returns its unnormalized output `Σ e^(s - max) v` with its `max` and `Σ e^(s - max)`
//! per query head; the chunks of one (token, KV head) merge by rescaling to the common max
//! (split-K), so even a single decode token spreads over every thread. The `group` query heads
//! of a KV head are handled together and share each key and value read.

use rayon::prelude::*;

use super::vf32::{self, Vf32};
use super::{slot_of, table, visible_range, AttentionParams};
use crate::batch::{ForwardBatch, RowSpan};
use crate::cpu::qmatmul::Level;
use crate::error::{Result, RuntimeError};
use crate::kv::LayerKv;

/// Fewest key positions worth a chunk of their own.
const MIN_CHUNK: usize = 64;

/// One work item: key positions `keys` for token `t` and KV head `g` of a row with block
/// table `table`.
struct Item<'a> {
    table: &'a [u32],
    t: usize,
    g: usize,
    keys: std::ops::Range<usize>,
}

/// One chunk's result: per query head its score max and exp-sum, and the unnormalized outputs.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    out: Vec<f32>,
}

/// Where the cache and the batch live, shared by every item.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    q: &'a [f32],
    layer: &'a LayerKv,
    block_size: usize,
    p: &'a AttentionParams,
}

#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    q: &[f32],
    batch: &ForwardBatch,
    rows: &[&RowSpan],
    layer: &LayerKv,
    block_size: usize,
    p: &AttentionParams,
    level: Level,
    out: &mut [f32],
) -> Result<()> {
    let pairs: usize = rows.iter().map(|r| r.query_len).sum::<usize>() * p.n_kv_heads;
    if pairs == 0 {
        return Ok(());
    }
    let threads = rayon::current_num_threads().max(1);
    // Chunks per (token, head): enough items for ~4 per thread.
    let want = (4 * threads).div_ceil(pairs);
    let mut items = Vec::new();
    for &row in rows {
        let table = table(row, layer)?;
        for t in row.query_start..row.query_start + row.query_len {
            let keys = visible_range(batch.positions[t] as usize, p.window);
            let chunks = want.min(keys.len().div_ceil(MIN_CHUNK)).max(1);
            let per = keys.len().div_ceil(chunks);
            for g in 0..p.n_kv_heads {
                for c in 0..chunks {
                    let k0 = keys.start + c * per;
                    items.push(Item { table, t, g, keys: k0..(k0 + per).min(keys.end) });
                }
            }
        }
    }
    let ctx = Ctx { q, layer, block_size, p };
    let simd = level >= Level::Avx2;
    let partials: Vec<Partial> = items
        .par_iter()
        .map_init(Vec::new, |scores, item| {
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: every level from AVX2 up guarantees AVX2 and FMA.
                return unsafe { chunk_avx2(ctx, item, scores) };
            }
            let _ = simd;
            chunk::<vf32::Scalar>(ctx, item, scores)
        })
        .collect::<Result<_>>()?;
    merge(&items, &partials, p, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chunk_avx2(ctx: Ctx<'_>, item: &Item<'_>, scores: &mut Vec<f32>) -> Result<Partial> {
    chunk::<vf32::Avx2>(ctx, item, scores)
}

/// Positions ahead of the current one whose cache lines are prefetched: cache blocks are
/// scattered, so the hardware prefetcher cannot run ahead across them.
const PREFETCH_POSITIONS: usize = 24;

/// Visit the cache slots of `keys` for KV head `g` in `data` (the K or V pool): `f(j, slot)`
/// for the j-th position, `slot` its `head_dim` values.
#[inline(always)]
fn for_each_slot<'d>(
    ctx: Ctx<'_>,
    item: &Item<'_>,
    data: &'d [f32],
    mut f: impl FnMut(usize, &'d [f32]),
) -> Result<()> {
    let hd = ctx.p.head_dim;
    let bs = ctx.block_size;
    let mut pos = item.keys.start;
    while pos < item.keys.end {
        let (block, slot) = slot_of(item.table, bs, pos)?;
        let run = (bs - slot).min(item.keys.end - pos);
        let base = ctx.layer.offset(bs, block, item.g, slot);
        let values = data
            .get(base..base + run * hd)
            .ok_or_else(|| RuntimeError::Shape(format!("attention: block {block} is outside the KV cache")))?;
        for (j, v) in values.chunks_exact(hd).enumerate() {
            let ahead = pos + j + PREFETCH_POSITIONS;
            if ahead < item.keys.end {
                if let Ok((b, s)) = slot_of(item.table, bs, ahead) {
                    prefetch(data, ctx.layer.offset(bs, b, item.g, s), hd);
                }
            }
            f(pos - item.keys.start + j, v);
        }
        pos += run;
    }
    Ok(())
}

/// Ask for the cache lines of `data[at..at + len]` (a hint; out-of-range asks nothing).
#[inline(always)]
fn prefetch(data: &[f32], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(s) = data.get(at..at + len) {
        for line in s.chunks(16) {
            // SAFETY: a prefetch of an address inside `data`; it has no architectural effect.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line.as_ptr() as *const i8)
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, at, len);
}

#[inline(always)]
fn chunk<V: Vf32>(ctx: Ctx<'_>, item: &Item<'_>, scores: &mut Vec<f32>) -> Result<Partial> {
    let p = ctx.p;
    let (hd, group) = (p.head_dim, p.n_heads / p.n_kv_heads);
    let n = item.keys.len();
    let q0 = (item.t * p.n_heads + item.g * group) * hd;
    let qs =
        ctx.q.get(q0..q0 + group * hd).ok_or_else(|| RuntimeError::Shape("attention: query out of range".into()))?;
    let (keys, values) = (&ctx.layer.k, &ctx.layer.v);
    scores.resize(group * n, 0.0);
    for_each_slot(ctx, item, keys, |j, key| {
        for (qh, qv) in qs.chunks_exact(hd).enumerate() {
            let mut s = V::dot(qv, key) * p.scale;
            if let Some(cap) = p.softcap {
                s = cap * (s / cap).tanh();
            }
            scores[qh * n + j] = s;
        }
    })?;
    let mut max = vec![f32::NEG_INFINITY; group];
    let mut sum = vec![0f32; group];
    for ((m, s), sc) in max.iter_mut().zip(&mut sum).zip(scores.chunks_exact_mut(n)) {
        *m = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        *s = V::exp_sum(sc, *m);
    }
    let mut out = vec![0f32; group * hd];
    for_each_slot(ctx, item, values, |j, val| {
        for (qh, o) in out.chunks_exact_mut(hd).enumerate() {
            V::axpy(o, scores[qh * n + j], val);
        }
    })?;
    Ok(Partial { max, sum, out })
}

/// Combine the chunks of each (token, KV head) — consecutive in `items` — into `out`.
fn merge(items: &[Item<'_>], partials: &[Partial], p: &AttentionParams, out: &mut [f32]) -> Result<()> {
    let (hd, group) = (p.head_dim, p.n_heads / p.n_kv_heads);
    let mut i = 0;
    while i < items.len() {
        let (t, g) = (items[i].t, items[i].g);
        let end = i + items[i..].iter().take_while(|it| it.t == t && it.g == g).count();
        let o0 = (t * p.n_heads + g * group) * hd;
        let dst = out
            .get_mut(o0..o0 + group * hd)
            .ok_or_else(|| RuntimeError::Shape("attention: output out of range".into()))?;
        for (qh, d) in dst.chunks_exact_mut(hd).enumerate() {
            let max = partials[i..end].iter().map(|c| c.max[qh]).fold(f32::NEG_INFINITY, f32::max);
            d.fill(0.0);
            let mut sum = 0f32;
            for c in &partials[i..end] {
                let w = (c.max[qh] - max).exp();
                sum += w * c.sum[qh];
                d.iter_mut().zip(&c.out[qh * hd..(qh + 1) * hd]).for_each(|(d, o)| *d += w * o);
            }
            let inv = 1.0 / sum;
            d.iter_mut().for_each(|d| *d *= inv);
        }
        i = end;
    }
    Ok(())
}
