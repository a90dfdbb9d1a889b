//! Causal GQA attention over the paged KV cache.
//!
//! `write_kv` stores a step's new keys and values into the blocks its rows own; then
//! `paged_attention` lets every query token attend to its row's positions `[lo, pos]`, where
//! `lo` is 0 for full attention and `pos + 1 - window` for sliding-window layers. Work is split
//! over (token, kv-head) pairs; the query heads of one KV head share each key read.

use rayon::prelude::*;

use super::SharedMut;
use crate::batch::{ForwardBatch, RowSpan, NO_BLOCK};
use crate::error::{Result, RuntimeError};
use crate::kv::LayerKv;

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
}

fn slot_of(table: &[u32], block_size: usize, pos: usize) -> Result<(usize, usize)> {
    match table.get(pos / block_size) {
        Some(&b) if b != NO_BLOCK => Ok((b as usize, pos % block_size)),
        Some(_) => Err(RuntimeError::Shape(format!("position {pos} is in a released block"))),
        None => Err(RuntimeError::Shape(format!(
            "position {pos} is past the row's block table ({} blocks)",
            table.len()
        ))),
    }
}

/// The row's block table for the KV group `layer` belongs to.
fn table<'a>(row: &'a RowSpan, layer: &LayerKv) -> Result<&'a [u32]> {
    row.block_tables.get(layer.spec.group).map(Vec::as_slice).ok_or_else(|| {
        RuntimeError::Shape(format!("row has {} block tables, layer needs group {}", row.block_tables.len(), layer.spec.group))
    })
}

/// Write `k`, `v` (`[tokens, n_kv_heads * head_dim]`) into the cache at each token's position.
pub fn write_kv(k: &[f32], v: &[f32], batch: &ForwardBatch, layer: &mut LayerKv, block_size: usize) -> Result<()> {
    let (nkv, hd) = (layer.spec.n_kv_heads, layer.spec.head_dim);
    let width = nkv * hd;
    if k.len() != batch.num_tokens() * width || v.len() != k.len() {
        return Err(RuntimeError::Shape(format!("write_kv: {} values for {} tokens", k.len(), batch.num_tokens())));
    }
    for row in &batch.rows {
        let table = table(row, layer)?;
        for t in row.query_start..row.query_start + row.query_len {
            let (block, slot) = slot_of(table, block_size, batch.positions[t] as usize)?;
            for h in 0..nkv {
                let off = layer.offset(block_size, block, h, slot);
                let src = t * width + h * hd;
                layer.k[off..off + hd].copy_from_slice(&k[src..src + hd]);
                layer.v[off..off + hd].copy_from_slice(&v[src..src + hd]);
            }
        }
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
    if nkv == 0 || nh % nkv != 0 || layer.spec.n_kv_heads != nkv || layer.spec.head_dim != hd {
        return Err(RuntimeError::Shape(format!("attention heads {nh}/{nkv} x {hd} vs cache {:?}", layer.spec)));
    }
    let t_total = batch.num_tokens();
    if q.len() != t_total * nh * hd || out.len() != q.len() {
        return Err(RuntimeError::Shape(format!("attention: q has {} values for {t_total} tokens", q.len())));
    }
    let group = nh / nkv;
    let mut work = Vec::with_capacity(t_total * nkv);
    for row in &batch.rows {
        for t in row.query_start..row.query_start + row.query_len {
            for g in 0..nkv {
                work.push((row, t, g));
            }
        }
    }
    let dst = SharedMut(out.as_mut_ptr());
    work.par_iter().try_for_each_init(Vec::new, |scores: &mut Vec<f32>, &(row, t, g)| {
        let table = table(row, layer)?;
        let pos = batch.positions[t] as usize;
        let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let n = pos + 1 - lo;
        scores.resize(group * n, 0.0);
        // Scores for the `group` query heads that share KV head g.
        for (j, kpos) in (lo..=pos).enumerate() {
            let (block, slot) = slot_of(table, block_size, kpos)?;
            let off = layer.offset(block_size, block, g, slot);
            let key = &layer.k[off..off + hd];
            for qh in 0..group {
                let h = g * group + qh;
                let qv = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
                let mut s = super::matmul::dot(qv, key) * p.scale;
                if let Some(cap) = p.softcap {
                    s = cap * (s / cap).tanh();
                }
                scores[qh * n + j] = s;
            }
        }
        for qh in 0..group {
            super::reduce::softmax_in_place(&mut scores[qh * n..(qh + 1) * n]);
        }
        // SAFETY: (t, heads g*group..(g+1)*group) is written by this work item only.
        let o = unsafe { std::slice::from_raw_parts_mut(dst.ptr().add((t * nh + g * group) * hd), group * hd) };
        o.fill(0.0);
        for (j, kpos) in (lo..=pos).enumerate() {
            let (block, slot) = slot_of(table, block_size, kpos)?;
            let off = layer.offset(block_size, block, g, slot);
            let val = &layer.v[off..off + hd];
            for qh in 0..group {
                let w = scores[qh * n + j];
                for (o, v) in o[qh * hd..(qh + 1) * hd].iter_mut().zip(val) {
                    *o += w * v;
                }
            }
        }
        Ok(())
    })
}
