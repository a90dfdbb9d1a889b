//! Attention for rows with many query tokens (prefill chunks) from AVX2 on: flash-style, one
//! pass over the keys with a running softmax, vectorized along the query rows (16 lanes with
//! AVX-512, 8 with AVX2: `Lanes`, the one part that differs).
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
//! This replaced two f32 GEMMs per tile (scores, then probabilities × values; `tiles`, now the
//! scalar level's) whose packing, masking and softmax passes cost more than the products: 54 %
//! of a 2,048-token SmolLM2 prefill was attention, at 28 % of the FMA peak.

use std::arch::x86_64::*;

use super::vf32::KvSource;
use super::{for_each_kv_run, for_each_query_tile, visible_range, AttentionParams, Pools, QueryTile};
use crate::batch::{ForwardBatch, RowSpan};
use crate::cpu::qmatmul::isa::exp8;
use crate::cpu::SharedMut;
use crate::error::Result;
use crate::kv::LayerKv;

/// Query tokens per tile: `64 * group` rows, a whole number of row vectors for every group
/// size and lane count.
const TILE: usize = 64;
/// Key positions per chunk (a multiple of `KEYS`).
const CHUNK: usize = 32;
/// Keys per score micro-tile, dims per value micro-tile (by up to `Lanes::VECS` row vectors).
const KEYS: usize = 4;
const DIMS: usize = 4;

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

/// `out` for the tokens of `rows` (each with at least one query token), with 16-lane vectors
/// when `wide`, else 8-lane ones.
///
/// # Safety
/// The CPU must have AVX2 and FMA, and AVX-512 F when `wide`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn attend<S: KvSource>(
    q: &[f32],
    batch: &ForwardBatch,
    rows: &[&RowSpan],
    layer: &LayerKv,
    pools: Pools<S>,
    block_size: usize,
    p: &AttentionParams,
    wide: bool,
    out: &mut [f32],
) -> Result<()> {
    let dst = SharedMut(out.as_mut_ptr());
    for_each_query_tile(rows, layer, p, TILE, q.len().min(out.len()), Scratch::default, |s, t| {
        let args = TileArgs { q, batch, layer, block_size, p, out: dst };
        // SAFETY: the CPU features (this function's contract); the tile's queries and outputs
        // lie inside `q` and `out` (checked by `for_each_query_tile`), and its tokens' query
        // heads of its KV head are written by this tile only.
        unsafe {
            if wide {
                tile_avx512(&args, t, pools, s)
            } else {
                tile_avx2(&args, t, pools, s)
            }
        }
    })
}

/// What every tile of one call shares.
struct TileArgs<'a> {
    q: &'a [f32],
    batch: &'a ForwardBatch,
    layer: &'a LayerKv,
    block_size: usize,
    p: &'a AttentionParams,
    out: SharedMut,
}

#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn tile_avx512<S: KvSource>(
    a: &TileArgs<'_>,
    t: &QueryTile<'_>,
    pools: Pools<S>,
    s: &mut Scratch,
) -> Result<()> {
    tile::<S, X16>(a, t, pools, s)
}

#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<S: KvSource>(a: &TileArgs<'_>, t: &QueryTile<'_>, pools: Pools<S>, s: &mut Scratch) -> Result<()> {
    tile::<S, X8>(a, t, pools, s)
}

/// One tile: its queries against every key they see, into `out`.
#[inline(always)]
unsafe fn tile<S: KvSource, X: Lanes>(
    &TileArgs { q, batch, layer, block_size, p, out }: &TileArgs<'_>,
    &QueryTile { table, context_len, g, ref tokens }: &QueryTile<'_>,
    pools: Pools<S>,
    s: &mut Scratch,
) -> Result<()> {
    let (nh, hd, group) = (p.n_heads, p.head_dim, p.n_heads / p.n_kv_heads);
    let m = tokens.len() * group;
    let mp = m.next_multiple_of(X::L);
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
    transpose_in::<X>(|i| q.as_ptr().add(row(i)), m, mp, hd, &mut s.qt);
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
        scores::<X>(s, hd, mp, p.scale);
        if let Some(cap) = p.softcap {
            s.st.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
        }
        // Does every row see the whole chunk (which then holds only gathered keys)?
        let visible = c0 >= max_lo && c1 <= min_hi + 1;
        softmax_chunk::<X>(s, hd, mp, c0, visible);
        values::<X>(s, hd, mp);
    }
    transpose_out::<X>(&s.ot, &s.l, m, mp, hd, |i| out.ptr().add(row(i)));
    Ok(())
}

/// The vector operations of the kernel at one width: `V` holds `L` lanes (row vectors), `M`
/// says which lanes a key counts for. Every method is `#[inline(always)]`, compiled inside the
/// caller's `#[target_feature]` entry.
trait Lanes {
    type V: Copy;
    type M: Copy;
    const L: usize;
    /// Row vectors per score and value micro-tile (the accumulators fit the registers).
    const VECS: usize;
    unsafe fn zero() -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn set1(x: f32) -> Self::V;
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn exp(x: Self::V) -> Self::V;
    /// Every lane.
    unsafe fn all() -> Self::M;
    /// Lanes with `lo ≤ key ≤ hi`.
    unsafe fn between(key: Self::V, lo: Self::V, hi: Self::V) -> Self::M;
    /// Lanes with `a > b`.
    unsafe fn gt(a: Self::V, b: Self::V) -> Self::M;
    unsafe fn any(m: Self::M) -> bool;
    /// `max(acc, x)` in the lanes of `m`, `acc` elsewhere.
    unsafe fn max_in(acc: Self::V, m: Self::M, x: Self::V) -> Self::V;
    /// `x` in the lanes of `m`, 0 elsewhere.
    unsafe fn keep(m: Self::M, x: Self::V) -> Self::V;
    /// `x` in the lanes of `m`, 1 elsewhere.
    unsafe fn or_one(m: Self::M, x: Self::V) -> Self::V;
    /// Transpose the `L × L` matrix whose rows are `r` (`r.len() == L`) in place.
    unsafe fn transpose(r: &mut [Self::V]);
}

/// 16 lanes (AVX-512 F).
struct X16;

impl Lanes for X16 {
    type V = __m512;
    type M = __mmask16;
    const L: usize = 16;
    const VECS: usize = 4;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn set1(x: f32) -> __m512 {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        _mm512_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        _mm512_max_ps(a, b)
    }
    /// `isa::exp8` on each half.
    #[inline(always)]
    unsafe fn exp(x: __m512) -> __m512 {
        let (lo, hi) = (_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x))));
        let (lo, hi) = (_mm256_castps_pd(exp8(lo)), _mm256_castps_pd(exp8(hi)));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(lo), hi))
    }
    #[inline(always)]
    unsafe fn all() -> __mmask16 {
        0xFFFF
    }
    #[inline(always)]
    unsafe fn between(key: __m512, lo: __m512, hi: __m512) -> __mmask16 {
        _mm512_cmp_ps_mask::<_CMP_LE_OQ>(key, hi) & _mm512_cmp_ps_mask::<_CMP_GE_OQ>(key, lo)
    }
    #[inline(always)]
    unsafe fn gt(a: __m512, b: __m512) -> __mmask16 {
        _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, b)
    }
    #[inline(always)]
    unsafe fn any(m: __mmask16) -> bool {
        m != 0
    }
    #[inline(always)]
    unsafe fn max_in(acc: __m512, m: __mmask16, x: __m512) -> __m512 {
        _mm512_mask_max_ps(acc, m, acc, x)
    }
    #[inline(always)]
    unsafe fn keep(m: __mmask16, x: __m512) -> __m512 {
        _mm512_maskz_mov_ps(m, x)
    }
    #[inline(always)]
    unsafe fn or_one(m: __mmask16, x: __m512) -> __m512 {
        _mm512_mask_blend_ps(m, _mm512_set1_ps(1.0), x)
    }
    #[inline(always)]
    unsafe fn transpose(r: &mut [__m512]) {
        let rows: [__m512; 16] = std::array::from_fn(|i| r[i]);
        r.copy_from_slice(&transpose16(rows));
    }
}

/// 8 lanes (AVX2).
struct X8;

impl Lanes for X8 {
    type V = __m256;
    type M = __m256;
    const L: usize = 8;
    const VECS: usize = 2;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn set1(x: f32) -> __m256 {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        _mm256_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        _mm256_max_ps(a, b)
    }
    #[inline(always)]
    unsafe fn exp(x: __m256) -> __m256 {
        exp8(x)
    }
    #[inline(always)]
    unsafe fn all() -> __m256 {
        _mm256_castsi256_ps(_mm256_set1_epi32(-1))
    }
    #[inline(always)]
    unsafe fn between(key: __m256, lo: __m256, hi: __m256) -> __m256 {
        _mm256_and_ps(_mm256_cmp_ps::<_CMP_LE_OQ>(key, hi), _mm256_cmp_ps::<_CMP_GE_OQ>(key, lo))
    }
    #[inline(always)]
    unsafe fn gt(a: __m256, b: __m256) -> __m256 {
        _mm256_cmp_ps::<_CMP_GT_OQ>(a, b)
    }
    #[inline(always)]
    unsafe fn any(m: __m256) -> bool {
        _mm256_movemask_ps(m) != 0
    }
    #[inline(always)]
    unsafe fn max_in(acc: __m256, m: __m256, x: __m256) -> __m256 {
        _mm256_blendv_ps(acc, _mm256_max_ps(acc, x), m)
    }
    #[inline(always)]
    unsafe fn keep(m: __m256, x: __m256) -> __m256 {
        _mm256_and_ps(m, x)
    }
    #[inline(always)]
    unsafe fn or_one(m: __m256, x: __m256) -> __m256 {
        _mm256_blendv_ps(_mm256_set1_ps(1.0), x, m)
    }
    #[inline(always)]
    unsafe fn transpose(r: &mut [__m256]) {
        let rows: [__m256; 8] = std::array::from_fn(|i| r[i]);
        r.copy_from_slice(&transpose8(rows));
    }
}

/// The most lanes of any `Lanes` (the size of the transposes' staging arrays).
const MAX_L: usize = 16;

/// `dst[d][i] = row(i)[d]` for rows `i < m` of `hd` values (`dst` is `[hd][mp]`; the padding
/// rows `m..mp` are zero), `L × L` blocks at a time.
#[inline(always)]
unsafe fn transpose_in<X: Lanes>(row: impl Fn(usize) -> *const f32, m: usize, mp: usize, hd: usize, dst: &mut [f32]) {
    let whole = hd - hd % X::L;
    let mut block = [X::zero(); MAX_L];
    let block = &mut block[..X::L];
    for i0 in (0..mp).step_by(X::L) {
        for d0 in (0..whole).step_by(X::L) {
            for (r, v) in block.iter_mut().enumerate() {
                *v = if i0 + r < m { X::load(row(i0 + r).add(d0)) } else { X::zero() };
            }
            X::transpose(block);
            for (c, col) in block.iter().enumerate() {
                X::store(dst.as_mut_ptr().add((d0 + c) * mp + i0), *col);
            }
        }
        for i in i0..(i0 + X::L).min(m) {
            for d in whole..hd {
                dst[d * mp + i] = *row(i).add(d);
            }
        }
    }
}

/// `row(i)[d] = ot[d][i] / l[i]` for rows `i < m` (`ot` is `[hd][mp]`), `L × L` blocks at a
/// time.
#[inline(always)]
unsafe fn transpose_out<X: Lanes>(
    ot: &[f32],
    l: &[f32],
    m: usize,
    mp: usize,
    hd: usize,
    row: impl Fn(usize) -> *mut f32,
) {
    let whole = hd - hd % X::L;
    let mut block = [X::zero(); MAX_L];
    let block = &mut block[..X::L];
    for i0 in (0..mp).step_by(X::L) {
        let live = (m - i0.min(m)).min(X::L);
        let mut inv = [0f32; MAX_L];
        for (r, inv) in inv.iter_mut().enumerate().take(X::L) {
            *inv = 1.0 / l[i0 + r];
        }
        for d0 in (0..whole).step_by(X::L) {
            for (c, v) in block.iter_mut().enumerate() {
                *v = X::load(ot.as_ptr().add((d0 + c) * mp + i0));
            }
            X::transpose(block);
            for (r, v) in block.iter().enumerate().take(live) {
                X::store(row(i0 + r).add(d0), X::mul(*v, X::set1(inv[r])));
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
unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    // t[2k], t[2k + 1]: rows 2k and 2k + 1 interleaved, columns 4L + (0, 1) and 4L + (2, 3).
    let t: [__m512; 16] = std::array::from_fn(|a| {
        let (x, y) = (r[a & !1], r[a | 1]);
        if a % 2 == 0 {
            _mm512_unpacklo_ps(x, y)
        } else {
            _mm512_unpackhi_ps(x, y)
        }
    });
    // u[4k + j], 128-bit lane L: rows 4k..4k + 4 of column 4L + j.
    let u: [__m512; 16] = std::array::from_fn(|a| {
        let (k, j) = (a / 4, a % 4);
        let (x, y) = (_mm512_castps_pd(t[4 * k + j / 2]), _mm512_castps_pd(t[4 * k + 2 + j / 2]));
        _mm512_castpd_ps(if j % 2 == 0 { _mm512_unpacklo_pd(x, y) } else { _mm512_unpackhi_pd(x, y) })
    });
    let mut out = [_mm512_setzero_ps(); 16];
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

/// The transpose of the 8 × 8 matrix whose rows are `r` (pairs interleaved, then quads, then
/// 128-bit lanes: 24 shuffles).
#[inline(always)]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    // t[2k], t[2k + 1]: rows 2k and 2k + 1 interleaved, per 128-bit lane columns (0, 1) and (2, 3).
    let t: [__m256; 8] = std::array::from_fn(|a| {
        let (x, y) = (r[a & !1], r[a | 1]);
        if a % 2 == 0 {
            _mm256_unpacklo_ps(x, y)
        } else {
            _mm256_unpackhi_ps(x, y)
        }
    });
    // u[4k + j], per 128-bit lane h: rows 4k..4k + 4 of column 4h + j.
    let u: [__m256; 8] = std::array::from_fn(|a| {
        let (k, j) = (a / 4, a % 4);
        let (x, y) = (_mm256_castps_pd(t[4 * k + j / 2]), _mm256_castps_pd(t[4 * k + 2 + j / 2]));
        _mm256_castpd_ps(if j % 2 == 0 { _mm256_unpacklo_pd(x, y) } else { _mm256_unpackhi_pd(x, y) })
    });
    let mut out = [_mm256_setzero_ps(); 8];
    for j in 0..4 {
        out[j] = _mm256_permute2f128_ps::<0x20>(u[j], u[4 + j]);
        out[4 + j] = _mm256_permute2f128_ps::<0x31>(u[j], u[4 + j]);
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
#[inline(always)]
unsafe fn scores<X: Lanes>(s: &mut Scratch, hd: usize, mp: usize, scale: f32) {
    let vecs = mp / X::L;
    for j0 in (0..CHUNK).step_by(KEYS) {
        let mut v0 = 0;
        while v0 < vecs {
            match (vecs - v0).min(X::VECS) {
                4 => score_tile::<X, 4>(s, hd, mp, scale, j0, v0),
                3 => score_tile::<X, 3>(s, hd, mp, scale, j0, v0),
                2 => score_tile::<X, 2>(s, hd, mp, scale, j0, v0),
                _ => score_tile::<X, 1>(s, hd, mp, scale, j0, v0),
            }
            v0 += X::VECS;
        }
    }
}

/// `scores` for keys `j0..j0 + KEYS` and row vectors `v0..v0 + V`.
#[inline(always)]
unsafe fn score_tile<X: Lanes, const V: usize>(
    s: &mut Scratch,
    hd: usize,
    mp: usize,
    scale: f32,
    j0: usize,
    v0: usize,
) {
    let mut acc = [[X::zero(); V]; KEYS];
    let (qt, kb) = (s.qt.as_ptr().add(v0 * X::L), s.kb.as_ptr().add(j0 * hd));
    for d in 0..hd {
        let qv: [X::V; V] = std::array::from_fn(|v| X::load(qt.add(d * mp + v * X::L)));
        for (j, acc) in acc.iter_mut().enumerate() {
            let k = X::set1(*kb.add(j * hd + d));
            for (a, q) in acc.iter_mut().zip(&qv) {
                *a = X::fmadd(k, *q, *a);
            }
        }
    }
    let sc = X::set1(scale);
    for (j, acc) in acc.iter().enumerate() {
        for (v, a) in acc.iter().enumerate() {
            X::store(s.st.as_mut_ptr().add((j0 + j) * mp + (v0 + v) * X::L), X::mul(*a, sc));
        }
    }
}

/// Fold the chunk at `c0` into the running softmax: scores become probabilities (0 where
/// masked), each row's max and sum move, and its output rescales where its max grew. Without
/// `visible`, key `c0 + j` counts for row `i` only if `lo[i] ≤ c0 + j ≤ hi[i]`.
#[inline(always)]
unsafe fn softmax_chunk<X: Lanes>(s: &mut Scratch, hd: usize, mp: usize, c0: usize, visible: bool) {
    let st = s.st.as_mut_ptr();
    for v in 0..mp / X::L {
        let at = v * X::L;
        let (hi, lo) = (X::load(s.hi.as_ptr().add(at)), X::load(s.lo.as_ptr().add(at)));
        // Lanes of row vector v that see key c0 + j.
        let sees = |j: usize| -> X::M {
            if visible {
                return X::all();
            }
            X::between(X::set1((c0 + j) as f32), lo, hi)
        };
        let mut max = X::set1(f32::NEG_INFINITY);
        for j in 0..CHUNK {
            max = X::max_in(max, sees(j), X::load(st.add(j * mp + at)));
        }
        let old = X::load(s.m.as_ptr().add(at));
        let new = X::max(old, max);
        let grew = X::gt(new, old);
        let corr = X::or_one(grew, X::exp(X::sub(old, new)));
        let mut sum = X::zero();
        for j in 0..CHUNK {
            let x = st.add(j * mp + at);
            let e = X::keep(sees(j), X::exp(X::sub(X::load(x), new)));
            X::store(x, e);
            sum = X::add(sum, e);
        }
        let l = s.l.as_mut_ptr().add(at);
        X::store(l, X::fmadd(X::load(l), corr, sum));
        X::store(s.m.as_mut_ptr().add(at), new);
        if X::any(grew) {
            for d in 0..hd {
                let o = s.ot.as_mut_ptr().add(d * mp + at);
                X::store(o, X::mul(X::load(o), corr));
            }
        }
    }
}

/// `ot[d][i] += Σ_j vb[j][d] * st[j][i]` over the chunk's keys.
#[inline(always)]
unsafe fn values<X: Lanes>(s: &mut Scratch, hd: usize, mp: usize) {
    let vecs = mp / X::L;
    let mut d0 = 0;
    while d0 < hd {
        let dims = (hd - d0).min(DIMS);
        let mut v0 = 0;
        while v0 < vecs {
            match ((vecs - v0).min(X::VECS), dims) {
                (4, 4) => value_tile::<X, 4, 4>(s, hd, mp, d0, v0),
                (3, 4) => value_tile::<X, 3, 4>(s, hd, mp, d0, v0),
                (2, 4) => value_tile::<X, 2, 4>(s, hd, mp, d0, v0),
                (1, 4) => value_tile::<X, 1, 4>(s, hd, mp, d0, v0),
                (4, _) => value_tile::<X, 4, 1>(s, hd, mp, d0, v0),
                (3, _) => value_tile::<X, 3, 1>(s, hd, mp, d0, v0),
                (2, _) => value_tile::<X, 2, 1>(s, hd, mp, d0, v0),
                _ => value_tile::<X, 1, 1>(s, hd, mp, d0, v0),
            }
            v0 += X::VECS;
        }
        d0 += if dims == DIMS { DIMS } else { 1 };
    }
}

/// `values` for dims `d0..d0 + D` and row vectors `v0..v0 + V`.
#[inline(always)]
unsafe fn value_tile<X: Lanes, const V: usize, const D: usize>(
    s: &mut Scratch,
    hd: usize,
    mp: usize,
    d0: usize,
    v0: usize,
) {
    let ot = s.ot.as_mut_ptr().add(d0 * mp + v0 * X::L);
    let mut acc: [[X::V; V]; D] = std::array::from_fn(|d| std::array::from_fn(|v| X::load(ot.add(d * mp + v * X::L))));
    let (st, vb) = (s.st.as_ptr().add(v0 * X::L), s.vb.as_ptr().add(d0));
    for j in 0..CHUNK {
        let pv: [X::V; V] = std::array::from_fn(|v| X::load(st.add(j * mp + v * X::L)));
        for (d, acc) in acc.iter_mut().enumerate() {
            let x = X::set1(*vb.add(j * hd + d));
            for (a, p) in acc.iter_mut().zip(&pv) {
                *a = X::fmadd(x, *p, *a);
            }
        }
    }
    for (d, acc) in acc.iter().enumerate() {
        for (v, a) in acc.iter().enumerate() {
            X::store(ot.add(d * mp + v * X::L), *a);
        }
    }
}
