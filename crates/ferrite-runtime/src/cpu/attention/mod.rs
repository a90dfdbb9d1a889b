//! GQA attention over the paged KV cache: causal, or bidirectional (encoders).
//!
//! `write_kv` stores a step's new keys and values into the blocks its rows own (in the
//! layer's pools, or its full-precision twins for a row before its quantized start); then
//! `paged_attention` lets every query token attend to its row's positions `[lo, hi]`, where
//! `lo` is 0 for full attention and `pos + 1 - window` for sliding-window layers, and `hi` is
//! the token's own position — or, for a non-causal (bidirectional) layer, the row's last
//! position (within `pos + window - 1` when sliding): every key of such a row must be in the
//! cache before it attends, so a bidirectional row runs whole in one step. The query
//! heads of one KV head are always processed together and share each key and value read.
//! Rows with many query tokens go to `flash` from AVX2 on (one pass over the keys with a
//! running softmax, vectorized along the query rows) and to `tiles` at the scalar level (query
//! tiles as two f32 GEMMs), the others to `decode` (SIMD dot products over the cache, key
//! ranges split across threads). The kernels run their vector code at the `KernelMode`'s level
//! (scalar for `Scalar` and `Reference`).

mod decode;
#[cfg(target_arch = "x86_64")]
mod flash;
#[cfg(test)]
mod tests;
mod tiles;
mod vf32;

use half::f16;

use self::vf32::{KvSource, KvValue};
use crate::batch::{ForwardBatch, RowSpan, NO_BLOCK};
use crate::cpu::qmatmul::{kernel_mode, Level};
use crate::error::{Result, RuntimeError};
use crate::kv::{KvPool, LayerKv};

/// Rows with at least this many query tokens take the GEMM (tile) path.
const TILE_MIN_QUERIES: usize = 16;

#[derive(Debug, Clone, Copy)]
pub struct AttentionParams {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Sliding window length (a query sees itself and the `window - 1` positions before it).
    pub window: Option<usize>,
    /// Gemma-2 style `cap * tanh(score / cap)` on the scores.
    pub softcap: Option<f32>,
    /// Queries see only earlier positions (false: the whole row, bidirectional attention,
    /// within `window` on either side when sliding).
    pub causal: bool,
}

/// Key positions a query at `pos` of a row whose KV length is `context_len` sees.
fn visible_range(pos: usize, context_len: usize, p: &AttentionParams) -> std::ops::Range<usize> {
    let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let hi = match (p.causal, p.window) {
        (true, _) => pos + 1,
        (false, None) => context_len,
        (false, Some(w)) => (pos + w).min(context_len),
    };
    lo..hi
}

fn slot_of(table: &[u32], block_size: usize, pos: usize) -> Result<(usize, usize)> {
    match table.get(pos / block_size) {
        Some(&b) if b != NO_BLOCK => Ok((b as usize, pos % block_size)),
        Some(_) => Err(RuntimeError::Shape(format!("position {pos} is in a released block"))),
        None => {
            Err(RuntimeError::Shape(format!("position {pos} is past the row's block table ({} blocks)", table.len())))
        }
    }
}

/// The row's block table for the KV group `layer` belongs to.
fn table<'a>(row: &'a RowSpan, layer: &LayerKv) -> Result<&'a [u32]> {
    row.block_tables.get(layer.spec.group).map(Vec::as_slice).ok_or_else(|| {
        RuntimeError::Shape(format!(
            "row has {} block tables, layer needs group {}",
            row.block_tables.len(),
            layer.spec.group
        ))
    })
}

/// A prefill work item: query tokens `tokens` of a row with block table `table`, for KV head
/// `g`.
struct QueryTile<'a> {
    table: &'a [u32],
    /// The row's KV length.
    context_len: usize,
    g: usize,
    tokens: std::ops::Range<usize>,
}

/// `run(scratch, tile)` on the pool for every tile of `tile_len` query tokens of `rows` and KV
/// head, each worker with its own scratch from `init`, after checking that the tile's queries
/// and outputs (its tokens' query heads of its KV head) lie inside `len` values.
fn for_each_query_tile<S>(
    rows: &[&RowSpan],
    layer: &LayerKv,
    p: &AttentionParams,
    tile_len: usize,
    len: usize,
    init: impl Fn() -> S + Sync + Send,
    run: impl Fn(&mut S, &QueryTile<'_>) -> Result<()> + Sync + Send,
) -> Result<()> {
    use rayon::prelude::*;
    let mut tiles = Vec::new();
    for &row in rows {
        let table = table(row, layer)?;
        let end = row.query_start + row.query_len;
        for g in 0..p.n_kv_heads {
            for t0 in (row.query_start..end).step_by(tile_len) {
                tiles.push(QueryTile { table, context_len: row.context_len, g, tokens: t0..(t0 + tile_len).min(end) });
            }
        }
    }
    tiles.par_iter().try_for_each_init(init, |s, tile| {
        let group = p.n_heads / p.n_kv_heads;
        if ((tile.tokens.end - 1) * p.n_heads + (tile.g + 1) * group) * p.head_dim > len {
            return Err(RuntimeError::Shape("attention: query or output out of range".into()));
        }
        run(s, tile)
    })
}

/// `f(pos, at, len)` for each run of the positions `keys` that lies in one cache block: its
/// first position and where the run's K and V rows of KV head `g` are in the pools (values
/// `at..at + len`, checked to lie inside both).
#[allow(clippy::too_many_arguments)]
fn for_each_kv_run<S: KvSource>(
    table: &[u32],
    g: usize,
    keys: std::ops::Range<usize>,
    layer: &LayerKv,
    pools: Pools<S>,
    block_size: usize,
    mut f: impl FnMut(usize, usize, usize),
) -> Result<()> {
    let hd = layer.spec.head_dim;
    let mut pos = keys.start;
    while pos < keys.end {
        let (block, slot) = slot_of(table, block_size, pos)?;
        let run = (block_size - slot).min(keys.end - pos);
        let src = layer.offset(block_size, block, g, slot);
        if src + run * hd > pools.k.len().min(pools.v.len()) {
            return Err(RuntimeError::Shape(format!("attention: block {block} is outside the KV cache")));
        }
        f(pos, src, run * hd);
        pos += run;
    }
    Ok(())
}

/// A layer's K and V pools, of one value type.
#[derive(Clone, Copy)]
pub(super) struct Pools<S> {
    k: S,
    v: S,
}

fn mixed_pools() -> RuntimeError {
    RuntimeError::Shape("KV cache layer: K and V pools of different value types".into())
}

/// Write `k`, `v` (`[tokens, n_kv_heads * head_dim]`) into the cache at each token's position,
/// rounded to the pools' value type: each row into its own pools (the layer's, or its
/// full-precision twins for a row before its quantized start).
pub fn write_kv(k: &[f32], v: &[f32], batch: &ForwardBatch, layer: &mut LayerKv, block_size: usize) -> Result<()> {
    let (nkv, hd) = (layer.spec.n_kv_heads, layer.spec.head_dim);
    let width = nkv * hd;
    if k.len() != batch.num_tokens() * width || v.len() != k.len() {
        return Err(RuntimeError::Shape(format!("write_kv: {} values for {} tokens", k.len(), batch.num_tokens())));
    }
    // Slot offsets first (they borrow the layer), then the writes into its pools; rows of the
    // twin pools (`full`) apart.
    let (mut at, mut at_full) = (Vec::with_capacity(batch.num_tokens() * nkv), Vec::new());
    for row in &batch.rows {
        let table = table(row, layer)?;
        let dst = if row.full_precision { &mut at_full } else { &mut at };
        for t in row.query_start..row.query_start + row.query_len {
            let (block, slot) = slot_of(table, block_size, batch.positions[t] as usize)?;
            dst.extend((0..nkv).map(|h| (layer.offset(block_size, block, h, slot), t * width + h * hd)));
        }
    }
    if !at_full.is_empty() {
        write_pools(k, v, layer.full.as_deref_mut().ok_or_else(no_twin)?, &at_full)?;
    }
    write_pools(k, v, layer, &at)
}

/// Write the rows of `k`, `v` at `at` (`(pool offset, source offset)` pairs) into `layer`'s
/// pools.
fn write_pools(k: &[f32], v: &[f32], layer: &mut LayerKv, at: &[(usize, usize)]) -> Result<()> {
    let hd = layer.spec.head_dim;
    if let Some(end) = at.iter().map(|&(off, _)| off + hd).max() {
        layer.populate_to(end);
    }
    match (&mut layer.k, &mut layer.v) {
        (KvPool::F32(kp), KvPool::F32(vp)) => write_rows(k, v, kp, vp, at, hd),
        (KvPool::F16(kp), KvPool::F16(vp)) => write_rows(k, v, kp, vp, at, hd),
        (KvPool::Quant(kp), KvPool::Quant(vp)) => {
            let (nkv, mut shifted) = (layer.spec.n_kv_heads, vec![0f32; hd]);
            for &(off, src) in at {
                let key = match &layer.key_offset {
                    Some(mu) => {
                        let h = (src / hd) % nkv;
                        let row = k[src..src + hd].iter().zip(&mu[h * hd..(h + 1) * hd]);
                        shifted.iter_mut().zip(row).for_each(|(d, (x, m))| *d = x - m);
                        &shifted[..]
                    }
                    None => &k[src..src + hd],
                };
                if !(kp.write(off, key) && vp.write(off, &v[src..src + hd])) {
                    return Err(RuntimeError::Shape(format!("write_kv: slot at {off} is outside the KV cache")));
                }
            }
            Ok(())
        }
        _ => Err(mixed_pools()),
    }
}

fn no_twin() -> RuntimeError {
    RuntimeError::Shape("a row keeps full-precision KV but the cache has no full-precision pools".into())
}

/// `kp[off..off + hd] = k[src..src + hd]` (and the same for `v`) for each `(off, src)` of `at`.
fn write_rows<T: KvValue>(
    k: &[f32],
    v: &[f32],
    kp: &mut [T],
    vp: &mut [T],
    at: &[(usize, usize)],
    hd: usize,
) -> Result<()> {
    for &(off, src) in at {
        let (Some(kd), Some(vd)) = (kp.get_mut(off..off + hd), vp.get_mut(off..off + hd)) else {
            return Err(RuntimeError::Shape(format!("write_kv: slot at {off} is outside the KV cache")));
        };
        T::narrow(&k[src..src + hd], kd);
        T::narrow(&v[src..src + hd], vd);
    }
    Ok(())
}

/// `out[t, h*hd..]` = softmax(q·Kᵀ·scale) · V over the row's visible positions.
pub fn paged_attention(
    q: &[f32],
    batch: &ForwardBatch,
    layer: &LayerKv,
    block_size: usize,
    p: &AttentionParams,
    out: &mut [f32],
) -> Result<()> {
    let (nh, nkv, hd) = (p.n_heads, p.n_kv_heads, p.head_dim);
    if nkv == 0 || hd == 0 || nh % nkv != 0 || layer.spec.n_kv_heads != nkv || layer.spec.head_dim != hd {
        return Err(RuntimeError::Shape(format!("attention heads {nh}/{nkv} x {hd} vs cache {:?}", layer.spec)));
    }
    let t_total = batch.num_tokens();
    if q.len() != t_total * nh * hd || out.len() != q.len() {
        return Err(RuntimeError::Shape(format!("attention: q has {} values for {t_total} tokens", q.len())));
    }
    attend_at(q, batch, layer, block_size, p, kernel_mode().level().unwrap_or(Level::Scalar), out)
}

/// `paged_attention` (shapes checked) with the vector code of `level`: the rows of each
/// pool (the layer's own, its full-precision twins) over that pool.
fn attend_at(
    q: &[f32],
    batch: &ForwardBatch,
    layer: &LayerKv,
    block_size: usize,
    p: &AttentionParams,
    level: Level,
    out: &mut [f32],
) -> Result<()> {
    let (full, own): (Vec<&RowSpan>, Vec<&RowSpan>) = batch.rows.iter().partition(|r| r.full_precision);
    if !full.is_empty() {
        attend_layer(q, batch, &full, layer.full.as_deref().ok_or_else(no_twin)?, block_size, p, level, out)?;
    }
    attend_layer(q, batch, &own, layer, block_size, p, level, out)
}

/// `rows` of `batch` over the pools of `layer`, whatever their value type.
#[allow(clippy::too_many_arguments)]
fn attend_layer(
    q: &[f32],
    batch: &ForwardBatch,
    rows: &[&RowSpan],
    layer: &LayerKv,
    block_size: usize,
    p: &AttentionParams,
    level: Level,
    out: &mut [f32],
) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    match (&layer.k, &layer.v) {
        (KvPool::F32(k), KvPool::F32(v)) => {
            attend_pools::<&[f32]>(q, batch, rows, layer, Pools { k, v }, block_size, p, level, out)
        }
        (KvPool::F16(k), KvPool::F16(v)) => {
            attend_pools::<&[f16]>(q, batch, rows, layer, Pools { k, v }, block_size, p, level, out)
        }
        (KvPool::Quant(k), KvPool::Quant(v)) => {
            attend_pools(q, batch, rows, layer, Pools { k, v }, block_size, p, level, out)
        }
        _ => Err(mixed_pools()),
    }
}

#[allow(clippy::too_many_arguments)]
fn attend_pools<S: KvSource>(
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
    let (tiled, small): (Vec<&RowSpan>, Vec<&RowSpan>) =
        rows.iter().copied().partition(|r| r.query_len >= TILE_MIN_QUERIES);
    #[cfg(target_arch = "x86_64")]
    if level >= Level::Avx2 {
        let wide = level == Level::Avx512Vnni;
        // SAFETY: these levels guarantee AVX2 and FMA, and AVX-512 F when `wide`.
        unsafe { flash::attend(q, batch, &tiled, layer, pools, block_size, p, wide, out)? };
        return decode::attend(q, batch, &small, layer, pools, block_size, p, level, out);
    }
    tiles::attend(q, batch, &tiled, layer, pools, block_size, p, level, out)?;
    decode::attend(q, batch, &small, layer, pools, block_size, p, level, out)
}
