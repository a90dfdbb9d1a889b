//! Attention for rows with many query tokens (prefill chunks) on AVX-512: flash-style, one
//! pass over the keys with a running softmax, vectorized along the query rows.
//!
//! Per (row, KV head, tile of `TILE` query tokens), the tile's queries — all `group` heads of
//! the KV head, stacked as rows `i = token * group + head` — are held transposed
//! (`qt[d][i]`), so one key's scores against every row form vectors along the rows: a score
//! is a broadcast of the key times a query column, and nothing is ever reduced across lanes.
//! Keys are visited in chunks of `CHUNK` positions aligned to absolute positions. Per chunk:
//!
//! 1. the chunk's keys and values are widened (or dequantized) to f32 (`kb`, `vb`,
//!    `[key][head_dim]`), the only f32 copy of cache values, one chunk at a time;
//! 2. scores `st[j][i] = scale * k_j · q_i` (four keys by up to four row vectors at a time);
//! 3. the causal / sliding-window / bidirectional mask (where the chunk is not visible to
//!    every row), then the running softmax: per row the max `m` and sum `l`; when a row's max
//!    grows, its sum and output are rescaled by `e^(m_old - m_new)`; probabilities
//!    `p = e^(s - m)`, 0 where masked;
//! 4. `ot[d][i] += Σ_j v_j[d] * p[j][i]` (four dims by up to four row vectors at a time).
//!
//! The outputs are `ot / l`, transposed back. A row's result depends only on its own query
//! and the keys it sees (chunk boundaries are absolute positions, masked keys add exact
//! zeros, an unchanged max rescales by exactly 1), never on the rows it shares a tile with,
//! so a prompt prefilled in chunks gives the same values as prefilled whole.
//!
//! This replaced two f32 GEMMs per tile (scores, then probabilities × values) whose packing,
//! masking and softmax passes cost more than the products: 54 % of a 2,048-token SmolLM2
//! prefill was attention, at 28 % of the FMA peak.

use std::arch::x86_64::*;

use super::vf32::KvSource;
use super::{for_each_kv_run, for_each_query_tile, visible_range, AttentionParams, Pools, QueryTile};
use crate::batch::{ForwardBatch, RowSpan};
use crate::cpu::qmatmul::isa::exp8;
use crate::cpu::SharedMut;
use crate::error::Result;
use crate::kv::LayerKv;

/// Query tokens per tile: `64 * group` rows, a whole number of `VECS`-vector blocks for every
/// group size.
const TILE: usize = 64;
/// Key positions per chunk (a multiple of `KEYS`).
const CHUNK: usize = 32;
/// Lanes of a row vector.
const L: usize = 16;
/// Keys per score micro-tile, dims per value micro-tile, most row vectors in either.
const KEYS: usize = 4;
const DIMS: usize = 4;
const VECS: usize = 4;

/// One worker's buffers, reused across tiles (sizes in the field docs; `mp` rows padded to
/// whole vectors).
#[derive(Default)]
struct Scratch {
    /// Queries transposed, `[head_dim][mp]`.
    qt: Vec<f32>,
    /// Output accumulators, transposed, `[head_dim][mp]`.
    ot: Vec<f32>,
    /// Scores, then probabilities, of one chunk, `[CHUNK][mp]`.
    st: Vec<f32>,
    /// Running max and sum per row.
    m: Vec<f32>,
    l: Vec<f32>,
    /// Per row: the last and the first position it sees (as f32, exact below 2^24).
    hi: Vec<f32>,
    lo: Vec<f32>,
    /// A chunk's keys and values as f32, `[CHUNK][head_dim]`.
    kb: Vec<f32>,
    vb: Vec<f32>,
}

/// `out` for the tokens of `rows` (each with at least one query token).
///
/// # Safety
/// The CPU must have AVX-512 F (and AVX2, FMA).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn attend<S: KvSource>(
    q: &[f32],
    batch: &ForwardBatch,
    rows: &[&RowSpan],
    layer: &LayerKv,
    pools: Pools<S>,
    block_size: usize,
    p: &AttentionParams,
    out: &mut [f32],
) -> Result<()> {
    let dst = SharedMut(out.as_mut_ptr());
    for_each_query_tile(rows, layer, p, TILE, q.len().min(out.len()), Scratch::default, |s, t| {
        // SAFETY: AVX-512 F (this function's contract); the tile's queries and outputs lie
        // inside `q` and `out` (checked by `for_each_query_tile`), and its tokens' query heads
        // of its KV head are written by this tile only.
        unsafe { tile(q, batch, t, layer, pools, block_size, p, s, dst) }
    })
}

/// One tile: its queries against every key they see, into `out`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn tile<S: KvSource>(
    q: &[f32],
    batch: &ForwardBatch,
    &QueryTile { table, context_len, g, ref tokens }: &QueryTile<'_>,
    layer: &LayerKv,
    pools: Pools<S>,
    block_size: usize,
    p: &AttentionParams,
    s: &mut Scratch,
    out: SharedMut,
) -> Result<()> {
    let (nh, hd, group) = (p.n_heads, p.head_dim, p.n_heads / p.n_kv_heads);
    let m = tokens.len() * group;
    let mp = m.next_multiple_of(L);
    // Rows: queries transposed, visible ends and starts. Padding rows see everything (their
    // queries are zero and their outputs dropped), so they never force a mask.
    s.qt.resize(hd * mp, 0.0);
    s.hi.clear();
    s.hi.resize(mp, f32::MAX);
    s.lo.clear();
    s.lo.resize(mp, 0.0);
    let (mut first, mut min_hi, mut max_lo, mut last) = (usize::MAX, usize::MAX, 0, 0);
    for (ti, t) in tokens.clone().enumerate() {
        let vis = visible_range(batch.positions[t] as usize, context_len, p);
        let hi = vis.end - 1;
        (first, min_hi, max_lo, last) = (first.min(vis.start), min_hi.min(hi), max_lo.max(vis.start), last.max(hi));
        for i in ti * group..(ti + 1) * group {
            s.hi[i] = hi as f32;
            s.lo[i] = vis.start as f32;
        }
    }
    // Row i of the tile: token `tokens.start + i / group`, head `g * group + i % group`.
    let row = |i: usize| (tokens.start + i / group) * nh * hd + (g * group + i % group) * hd;
    transpose_in(|i| q.as_ptr().add(row(i)), m, mp, hd, &mut s.qt);
    s.ot.clear();
    s.ot.resize(hd * mp, 0.0);
    s.m.clear();
    s.m.resize(mp, f32::NEG_INFINITY);
    s.l.clear();
    s.l.resize(mp, 0.0);
    s.st.resize(CHUNK * mp, 0.0);
    s.kb.resize(CHUNK * hd, 0.0);
    s.vb.resize(CHUNK * hd, 0.0);
    for c in first / CHUNK..=last / CHUNK {
        let (c0, c1) = (c * CHUNK, (c + 1) * CHUNK);
        gather(table, g, c0.max(first)..c1.min(last + 1), c0, layer, pools, block_size, hd, s)?;
        scores(s, hd, mp, p.scale);
        if let Some(cap) = p.softcap {
            s.st.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
        }
        // Does every row see the whole chunk (which then holds only gathered keys)?
        let visible = c0 >= max_lo && c1 <= min_hi + 1;
        softmax_chunk(s, hd, mp, c0, visible);
        values(s, hd, mp);
    }
    transpose_out(&s.ot, &s.l, m, mp, hd, |i| out.ptr().add(row(i)));
    Ok(())
}

/// `dst[d][i] = row(i)[d]` for rows `i < m` of `hd` values (`dst` is `[hd][mp]`; the padding
/// rows `m..mp` are zero), 16 × 16 blocks at a time.
#[inline(always)]
unsafe fn transpose_in(row: impl Fn(usize) -> *const f32, m: usize, mp: usize, hd: usize, dst: &mut [f32]) {
    let whole = hd - hd % L;
    for i0 in (0..mp).step_by(L) {
        for d0 in (0..whole).step_by(L) {
            let rows = std::array::from_fn(|r| {
                if i0 + r < m {
                    _mm512_loadu_ps(row(i0 + r).add(d0))
                } else {
                    _mm512_setzero_ps()
                }
            });
            for (c, col) in transpose16(rows).iter().enumerate() {
                _mm512_storeu_ps(dst.as_mut_ptr().add((d0 + c) * mp + i0), *col);
            }
        }
        for i in i0..(i0 + L).min(m) {
            for d in whole..hd {
                dst[d * mp + i] = *row(i).add(d);
            }
        }
    }
}

/// `row(i)[d] = ot[d][i] / l[i]` for rows `i < m` (`ot` is `[hd][mp]`), 16 × 16 blocks at a
/// time.
#[inline(always)]
unsafe fn transpose_out(ot: &[f32], l: &[f32], m: usize, mp: usize, hd: usize, row: impl Fn(usize) -> *mut f32) {
    let whole = hd - hd % L;
    for i0 in (0..mp).step_by(L) {
        let live = (m - i0.min(m)).min(L);
        let inv: [f32; L] = std::array::from_fn(|r| 1.0 / l[i0 + r]);
        for d0 in (0..whole).step_by(L) {
            let cols = std::array::from_fn(|c| _mm512_loadu_ps(ot.as_ptr().add((d0 + c) * mp + i0)));
            for (r, v) in transpose16(cols).iter().enumerate().take(live) {
                _mm512_storeu_ps(row(i0 + r).add(d0), _mm512_mul_ps(*v, _mm512_set1_ps(inv[r])));
            }
        }
        for (r, inv) in inv.iter().enumerate().take(live) {
            for d in whole..hd {
                *row(i0 + r).add(d) = ot[d * mp + i0 + r] * inv;
            }
        }
    }
}

/// The transpose of the 16 × 16 matrix whose rows are `r`: lane j of output i is lane i of
/// `r[j]` (pairs interleaved, then quads, then 128-bit lanes: 64 shuffles).
#[inline(always)]
unsafe fn transpose16(r: [__m512; L]) -> [__m512; L] {
    // t[2k], t[2k + 1]: rows 2k and 2k + 1 interleaved, columns 4L + (0, 1) and 4L + (2, 3).
    let t: [__m512; L] = std::array::from_fn(|a| {
        let (x, y) = (r[a & !1], r[a | 1]);
        if a % 2 == 0 {
            _mm512_unpacklo_ps(x, y)
        } else {
            _mm512_unpackhi_ps(x, y)
        }
    });
    // u[4k + j], 128-bit lane L: rows 4k..4k + 4 of column 4L + j.
    let u: [__m512; L] = std::array::from_fn(|a| {
        let (k, j) = (a / 4, a % 4);
        let (x, y) = (_mm512_castps_pd(t[4 * k + j / 2]), _mm512_castps_pd(t[4 * k + 2 + j / 2]));
        _mm512_castpd_ps(if j % 2 == 0 { _mm512_unpacklo_pd(x, y) } else { _mm512_unpackhi_pd(x, y) })
    });
    let mut out = [_mm512_setzero_ps(); L];
    for j in 0..4 {
        let v0 = _mm512_shuffle_f32x4::<0x88>(u[j], u[4 + j]);
        let v1 = _mm512_shuffle_f32x4::<0xDD>(u[j], u[4 + j]);
        let v2 = _mm512_shuffle_f32x4::<0x88>(u[8 + j], u[12 + j]);
        let v3 = _mm512_shuffle_f32x4::<0xDD>(u[8 + j], u[12 + j]);
        out[j] = _mm512_shuffle_f32x4::<0x88>(v0, v2);
        out[8 + j] = _mm512_shuffle_f32x4::<0xDD>(v0, v2);
        out[4 + j] = _mm512_shuffle_f32x4::<0x88>(v1, v3);
        out[12 + j] = _mm512_shuffle_f32x4::<0xDD>(v1, v3);
    }
    out
}

/// Widen keys and values of positions `keys` (inside chunk `c0..c0 + CHUNK`) of head `g` into
/// `kb`/`vb` at their slots in the chunk; the other slots are zero.
#[allow(clippy::too_many_arguments)]
fn gather<S: KvSource>(
    table: &[u32],
    g: usize,
    keys: std::ops::Range<usize>,
    c0: usize,
    layer: &LayerKv,
    pools: Pools<S>,
    block_size: usize,
    hd: usize,
    s: &mut Scratch,
) -> Result<()> {
    if keys.start > c0 || keys.end < c0 + CHUNK {
        s.kb.fill(0.0);
        s.vb.fill(0.0);
    }
    for_each_kv_run(table, g, keys, layer, pools, block_size, |pos, src, len| {
        let at = (pos - c0) * hd;
        pools.k.widen(src, &mut s.kb[at..at + len]);
        pools.v.widen(src, &mut s.vb[at..at + len]);
    })
}

/// `st[j][i] = scale * Σ_d kb[j][d] * qt[d][i]` for the chunk's keys and every row.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn scores(s: &mut Scratch, hd: usize, mp: usize, scale: f32) {
    let vecs = mp / L;
    for j0 in (0..CHUNK).step_by(KEYS) {
        let mut v0 = 0;
        while v0 < vecs {
            match (vecs - v0).min(VECS) {
                4 => score_tile::<4>(s, hd, mp, scale, j0, v0),
                3 => score_tile::<3>(s, hd, mp, scale, j0, v0),
                2 => score_tile::<2>(s, hd, mp, scale, j0, v0),
                _ => score_tile::<1>(s, hd, mp, scale, j0, v0),
            }
            v0 += VECS;
        }
    }
}

/// `scores` for keys `j0..j0 + KEYS` and row vectors `v0..v0 + V`.
#[inline(always)]
unsafe fn score_tile<const V: usize>(s: &mut Scratch, hd: usize, mp: usize, scale: f32, j0: usize, v0: usize) {
    let mut acc = [[_mm512_setzero_ps(); V]; KEYS];
    let (qt, kb) = (s.qt.as_ptr().add(v0 * L), s.kb.as_ptr().add(j0 * hd));
    for d in 0..hd {
        let qv: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(qt.add(d * mp + v * L)));
        for (j, acc) in acc.iter_mut().enumerate() {
            let k = _mm512_set1_ps(*kb.add(j * hd + d));
            for (a, q) in acc.iter_mut().zip(&qv) {
                *a = _mm512_fmadd_ps(k, *q, *a);
            }
        }
    }
    let sc = _mm512_set1_ps(scale);
    for (j, acc) in acc.iter().enumerate() {
        for (v, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(s.st.as_mut_ptr().add((j0 + j) * mp + (v0 + v) * L), _mm512_mul_ps(*a, sc));
        }
    }
}

/// Fold the chunk at `c0` into the running softmax: scores become probabilities (0 where
/// masked), each row's max and sum move, and its output rescales where its max grew. Without
/// `visible`, key `c0 + j` counts for row `i` only if `lo[i] ≤ c0 + j ≤ hi[i]`.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn softmax_chunk(s: &mut Scratch, hd: usize, mp: usize, c0: usize, visible: bool) {
    let st = s.st.as_mut_ptr();
    for v in 0..mp / L {
        let at = v * L;
        let (hi, lo) = (_mm512_loadu_ps(s.hi.as_ptr().add(at)), _mm512_loadu_ps(s.lo.as_ptr().add(at)));
        // Lanes of row vector v that see key c0 + j.
        let sees = |j: usize| -> __mmask16 {
            if visible {
                return 0xFFFF;
            }
            let key = _mm512_set1_ps((c0 + j) as f32);
            _mm512_cmp_ps_mask::<_CMP_LE_OQ>(key, hi) & _mm512_cmp_ps_mask::<_CMP_GE_OQ>(key, lo)
        };
        let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut max = neg_inf;
        for j in 0..CHUNK {
            max = _mm512_mask_max_ps(max, sees(j), max, _mm512_loadu_ps(st.add(j * mp + at)));
        }
        let old = _mm512_loadu_ps(s.m.as_ptr().add(at));
        let new = _mm512_max_ps(old, max);
        let grew = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(new, old);
        let corr = _mm512_mask_blend_ps(grew, _mm512_set1_ps(1.0), exp16(_mm512_sub_ps(old, new)));
        let mut sum = _mm512_setzero_ps();
        for j in 0..CHUNK {
            let x = st.add(j * mp + at);
            let e = _mm512_maskz_mov_ps(sees(j), exp16(_mm512_sub_ps(_mm512_loadu_ps(x), new)));
            _mm512_storeu_ps(x, e);
            sum = _mm512_add_ps(sum, e);
        }
        let l = s.l.as_mut_ptr().add(at);
        _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), corr, sum));
        _mm512_storeu_ps(s.m.as_mut_ptr().add(at), new);
        if grew != 0 {
            for d in 0..hd {
                let o = s.ot.as_mut_ptr().add(d * mp + at);
                _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), corr));
            }
        }
    }
}

/// `ot[d][i] += Σ_j vb[j][d] * st[j][i]` over the chunk's keys.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn values(s: &mut Scratch, hd: usize, mp: usize) {
    let vecs = mp / L;
    let mut d0 = 0;
    while d0 < hd {
        let dims = (hd - d0).min(DIMS);
        let mut v0 = 0;
        while v0 < vecs {
            match ((vecs - v0).min(VECS), dims) {
                (4, 4) => value_tile::<4, 4>(s, hd, mp, d0, v0),
                (3, 4) => value_tile::<3, 4>(s, hd, mp, d0, v0),
                (2, 4) => value_tile::<2, 4>(s, hd, mp, d0, v0),
                (1, 4) => value_tile::<1, 4>(s, hd, mp, d0, v0),
                (4, _) => value_tile::<4, 1>(s, hd, mp, d0, v0),
                (3, _) => value_tile::<3, 1>(s, hd, mp, d0, v0),
                (2, _) => value_tile::<2, 1>(s, hd, mp, d0, v0),
                _ => value_tile::<1, 1>(s, hd, mp, d0, v0),
            }
            v0 += VECS;
        }
        d0 += if dims == DIMS { DIMS } else { 1 };
    }
}

/// `values` for dims `d0..d0 + D` and row vectors `v0..v0 + V`.
#[inline(always)]
unsafe fn value_tile<const V: usize, const D: usize>(s: &mut Scratch, hd: usize, mp: usize, d0: usize, v0: usize) {
    let ot = s.ot.as_mut_ptr().add(d0 * mp + v0 * L);
    let mut acc: [[__m512; V]; D] =
        std::array::from_fn(|d| std::array::from_fn(|v| _mm512_loadu_ps(ot.add(d * mp + v * L))));
    let (st, vb) = (s.st.as_ptr().add(v0 * L), s.vb.as_ptr().add(d0));
    for j in 0..CHUNK {
        let pv: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(st.add(j * mp + v * L)));
        for (d, acc) in acc.iter_mut().enumerate() {
            let x = _mm512_set1_ps(*vb.add(j * hd + d));
            for (a, p) in acc.iter_mut().zip(&pv) {
                *a = _mm512_fmadd_ps(x, *p, *a);
            }
        }
    }
    for (d, acc) in acc.iter().enumerate() {
        for (v, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(ot.add(d * mp + v * L), *a);
        }
    }
}

/// `e^x` per lane: `isa::exp8` on each half.
#[inline(always)]
unsafe fn exp16(x: __m512) -> __m512 {
    let (lo, hi) = (_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x))));
    let (lo, hi) = (_mm256_castps_pd(exp8(lo)), _mm256_castps_pd(exp8(hi)));
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(lo), hi))
}
