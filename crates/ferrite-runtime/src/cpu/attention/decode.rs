//! Attention for rows with few query tokens (decode, verification): per (token, KV head, chunk
//! of key positions), the `Vf32` score and weighted-sum loops straight from the cache blocks.
//!
//! A chunk returns its unnormalized output `Σ e^(s - max) v` with its `max` and `Σ e^(s - max)`
//! per query head; the chunks of one (token, KV head) merge by rescaling to the common max
//! (split-K), so even a single decode token spreads over every thread. The `group` query heads
//! of a KV head are handled together and share each key and value read.

use super::vf32::{self, KvSource, Rows, Vf32};
use super::{slot_of, table, visible_range, AttentionParams, Pools};
use crate::batch::{ForwardBatch, RowSpan};
use crate::cpu::qmatmul::Level;
use crate::error::{Result, RuntimeError};
use crate::kv::LayerKv;
use crate::threads;

/// Fewest key positions worth a chunk of their own. Splitting a short context costs more than
/// it spreads (SmolLM2, one decode row at 128–256 positions: 0.84 ms of attention a token in
/// 64-key chunks, 0.56 ms unsplit).
const MIN_CHUNK: usize = 256;

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
struct Ctx<'a, S> {
    q: &'a [f32],
    layer: &'a LayerKv,
    pools: Pools<S>,
    block_size: usize,
    p: &'a AttentionParams,
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
            let keys = visible_range(batch.positions[t] as usize, row.context_len, p);
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
    let ctx = Ctx { q, layer, pools, block_size, p };
    // Items are claimed one at a time (`threads::for_each_claimed`): as rayon pieces, two per
    // thread were the best split and still left a thread asleep in a join most layers.
    let partials: Vec<Partial> = threads::map_claimed(items.len(), Scratch::default, |scratch, i| {
        let item = &items[i];
        #[cfg(target_arch = "x86_64")]
        match level {
            // SAFETY: this level guarantees AVX-512 F and VL, AVX2 and FMA.
            Level::Avx512Vnni => return unsafe { chunk_avx512(ctx, item, scratch) },
            // SAFETY: every level from AVX2 up guarantees AVX2 and FMA.
            Level::Avx2 | Level::AvxVnni => return unsafe { chunk_avx2(ctx, item, scratch) },
            Level::Scalar => {}
        }
        chunk::<vf32::Scalar, S>(ctx, item, scratch)
    })
    .into_iter()
    .collect::<Result<_>>()?;
    merge(&items, &partials, p, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chunk_avx2<S: KvSource>(ctx: Ctx<'_, S>, item: &Item<'_>, scratch: &mut Scratch) -> Result<Partial> {
    chunk::<vf32::Avx2, S>(ctx, item, scratch)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn chunk_avx512<S: KvSource>(ctx: Ctx<'_, S>, item: &Item<'_>, scratch: &mut Scratch) -> Result<Partial> {
    chunk::<vf32::Avx512, S>(ctx, item, scratch)
}

/// A worker's buffers, reused across items: the cache offsets of an item's positions and
/// its scores.
#[derive(Default)]
struct Scratch {
    offs: Vec<usize>,
    scores: Vec<f32>,
}

/// The offsets in the K and V pools of the cache slots of `keys` for KV head `g`, in order.
fn slot_offsets<S>(ctx: Ctx<'_, S>, item: &Item<'_>, offs: &mut Vec<usize>) -> Result<()> {
    let (hd, bs) = (ctx.p.head_dim, ctx.block_size);
    offs.clear();
    let mut pos = item.keys.start;
    while pos < item.keys.end {
        let (block, slot) = slot_of(item.table, bs, pos)?;
        let run = (bs - slot).min(item.keys.end - pos);
        let base = ctx.layer.offset(bs, block, item.g, slot);
        offs.extend((0..run).map(|j| base + j * hd));
        pos += run;
    }
    Ok(())
}

#[inline(always)]
fn chunk<V: Vf32, S: KvSource>(ctx: Ctx<'_, S>, item: &Item<'_>, scratch: &mut Scratch) -> Result<Partial> {
    let p = ctx.p;
    let (hd, group) = (p.head_dim, p.n_heads / p.n_kv_heads);
    let n = item.keys.len();
    let q0 = (item.t * p.n_heads + item.g * group) * hd;
    let qs =
        ctx.q.get(q0..q0 + group * hd).ok_or_else(|| RuntimeError::Shape("attention: query out of range".into()))?;
    slot_offsets(ctx, item, &mut scratch.offs)?;
    let outside = || RuntimeError::Shape("attention: a block is outside the KV cache".into());
    let keys = Rows::new(ctx.pools.k, &scratch.offs, hd).ok_or_else(outside)?;
    let values = Rows::new(ctx.pools.v, &scratch.offs, hd).ok_or_else(outside)?;
    let scores = &mut scratch.scores;
    scores.resize(group * n, 0.0);
    V::scores(qs, &keys, p.scale, scores);
    if let Some(cap) = p.softcap {
        scores.iter_mut().for_each(|s| *s = cap * (*s / cap).tanh());
    }
    let mut max = vec![f32::NEG_INFINITY; group];
    let mut sum = vec![0f32; group];
    for ((m, s), sc) in max.iter_mut().zip(&mut sum).zip(scores.chunks_exact_mut(n)) {
        (*m, *s) = V::max_exp_sum(sc);
    }
    let mut out = vec![0f32; group * hd];
    V::weighted_sum(scores, &values, &mut out);
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
