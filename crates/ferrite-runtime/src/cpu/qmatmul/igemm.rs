//! Integer matmul on quantized weights with AVX-512 VNNI, for every number of activation rows:
//! `out[m, n] = x[m, k] · Wᵀ` as 16-bit integer products (`vpdpwssd`). It is the only fast path
//! for the dtypes it `supports`, from a single decode row to a 512-token prompt, so a row's
//! result never depends on how many rows share the call (batch invariance).
//!
//! Both sides are cut into blocks of 32 values along `k`. A weight block is 32 small integers
//! `v` with a scale `ws` and an offset term `wm` (`value = ws * v + wm`): a legacy block's
//! `(d, m)`, a Q4_K/Q5_K sub-block's `(d * sc, -dmin * min)`, a Q6_K half-plane's
//! `(d, 0)` with its two group scales folded into `v` (|v| ≤ 4096). An activation block is
//! 14-bit codes `q` with a scale `da` and `s = da * Σq`. The numerics, per output and block in
//! order of `k`, are exactly
//!
//! ```text
//! acc = fma(f32(Σ v·q), ws * da, acc);   acc = fma(wm, s, acc)   (the latter for affine dtypes)
//! ```
//!
//! with `Σ v·q` an exact 32-bit integer (32 · 4096 · 8191 < 2³¹), whichever kernel runs.
//!
//! Each thread takes panels of weight rows, 16 or 32 at a time:
//! - Few activation rows (`m ≤ FEW_ROWS`, decode): straight from the GGUF bytes, 16 rows side
//!   by side (`few_legacy`, `few_k4k5`, `few_q6k`): each row's block is widened to i16 and
//!   dotted with the activation block in one `vpdpwssd` (lanes along `k`), and one transposing
//!   reduction turns the 16 partial vectors into the 16 rows' exact block sums (`reduce16`);
//!   headers come in by gathers, and the next 16 rows are prefetched meanwhile (`Ahead`).
//! - More rows: slivers of 32 rows are decoded 256 columns at a time to a row-major i16
//!   buffer plus per-block `ws` and `wm`, transposed to i16 pairs `[k / 2][32]`
//!   (`transpose16`), and a 6×32 micro-kernel (`Tile`) keeps 12 integer accumulators per block,
//!   one broadcast activation pair per `vpdpwssd` (lanes along the output columns).

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::acts;
use super::isa::{f16x2, prefetch, Level};
use super::kquants::{k4k5_high, k4k5_scales_mins, k4k5_values, q6k_d, q6k_values};
use super::legacy::{Legacy, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use super::packed::{self, Packing};
use crate::cpu::SharedMut;
use crate::dtype::DType;
use crate::error::{Result, RuntimeError};
use crate::tensor::Tensor;

/// Values per scale, on both sides.
const B: usize = 32;
/// Weight rows (output columns) per sliver: two 16-lane registers.
const NR: usize = 32;
/// Activation rows per micro-tile.
const MR: usize = 6;
/// Columns of `k` decoded at a time (one K-quant super-block, eight legacy blocks).
const KC: usize = 256;
/// Largest activation code (see the overflow bound in the module docs).
const QMAX: f32 = 8191.0;
/// Up to this many activation rows, the reduction kernel beats transposing the weights.
const FEW_ROWS: usize = 2;
/// Up to this many activation rows, packed weights are expanded by each tile, not once per
/// sliver into a buffer.
const DIRECT_ROWS: usize = 2 * MR;
/// Most slivers per panel (a panel is one work item of the pool).
const MAX_PANEL_SLIVERS: usize = 16;

/// Whether this module multiplies `dtype`.
pub(crate) fn supports(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::Q4K | DType::Q5K | DType::Q6K
    )
}

/// Quantized activations. `q` holds each row's codes (`[m][k]`); `d` and `s` are laid out
/// `[m / MR][k / B][MR]`; for more than `FEW_ROWS` rows, `pairs[(blk * k / 2 + p) * MR + i]`
/// holds codes `2p, 2p + 1` of row `blk * MR + i` (when the kernel needs them). Padding rows
/// are zero.
struct Acts {
    k: usize,
    q: Vec<i16>,
    pairs: Vec<i32>,
    d: Vec<f32>,
    s: Vec<f32>,
}

impl Acts {
    /// `pairs` is filled when `with_pairs` (the register-tiled kernels need it).
    fn new(x: &[f32], m: usize, k: usize, with_pairs: bool) -> Acts {
        let blocks = m.div_ceil(MR);
        let (kb, kp) = (k / B, k / 2);
        let (mut q, mut d, mut s) = (vec![0i16; m * k], vec![0f32; blocks * kb * MR], vec![0f32; blocks * kb * MR]);
        q.par_chunks_mut(k * MR).zip(d.par_chunks_mut(kb * MR)).zip(s.par_chunks_mut(kb * MR)).enumerate().for_each(
            |(blk, ((q, d), s))| {
                let mut rd = vec![0f32; kb];
                for (i, (row, q)) in x.chunks_exact(k).skip(blk * MR).zip(q.chunks_exact_mut(k)).enumerate() {
                    acts::quantize_row(row, B, QMAX, q, &mut rd, Level::Avx2);
                    for (b, (&db, c)) in rd.iter().zip(q.chunks_exact(B)).enumerate() {
                        d[b * MR + i] = db;
                        s[b * MR + i] = db * c.iter().map(|&v| i32::from(v)).sum::<i32>() as f32;
                    }
                }
            },
        );
        let mut pairs = Vec::new();
        if with_pairs {
            pairs = vec![0i32; blocks * kp * MR];
            pairs.par_chunks_mut(kp * MR).zip(q.par_chunks(k * MR)).for_each(|(pairs, q)| {
                for (i, q) in q.chunks_exact(k).enumerate() {
                    for (p, c) in q.chunks_exact(2).enumerate() {
                        pairs[p * MR + i] = i32::from(c[0] as u16) | (i32::from(c[1] as u16) << 16);
                    }
                }
            });
        }
        Acts { k, q, pairs, d, s }
    }

    /// Offset of block `b` of row `i` in `d` and `s`.
    fn scale_at(&self, i: usize, b: usize) -> usize {
        ((i / MR) * (self.k / B) + b) * MR + i % MR
    }
}

/// One sliver's weights for a `KC` slice: `rows[r * KC + c]` is value `c` of row `r`; `ws`,
/// `wm` are `[b][NR]`; `pairs` (many-row path) is `rows` transposed to `[KC / 2][NR]` pairs.
/// Rows past the weight's end are zero.
struct Sliver {
    rows: Vec<i16>,
    ws: Vec<f32>,
    wm: Vec<f32>,
    pairs: Vec<i32>,
}

impl Default for Sliver {
    fn default() -> Sliver {
        Sliver {
            rows: vec![0; NR * KC],
            ws: vec![0.0; KC / B * NR],
            wm: vec![0.0; KC / B * NR],
            pairs: vec![0; KC / 2 * NR],
        }
    }
}

/// `out = x · Wᵀ` for a `dtype` that `supports` accepts, any `m ≥ 1`.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL/VNNI (and AVX2/FMA/F16C); `x`, `w` and `out` have the
/// shapes `linear` checked.
pub(crate) unsafe fn linear(x: &[f32], m: usize, w: &Tensor, out: &mut [f32]) -> Result<()> {
    // Rows hold whole blocks: `k` is a multiple of 32 (of 256 for the K-quants, whose slices
    // are then always whole super-blocks).
    let (n, k) = (w.rows(), w.row_len());
    let packed = packed::packs(w.dtype());
    let acts = Acts::new(x, m, k, packed || m > FEW_ROWS);
    // About four panels per thread, so a thread slowed by other work sheds panels to the rest.
    let threads = rayon::current_num_threads().max(1);
    let slivers = n.div_ceil(NR);
    let panels = (4 * threads * slivers.div_ceil(4 * threads * MAX_PANEL_SLIVERS)).min(slivers);
    let rows_per_panel = NR * slivers.div_ceil(panels);
    let panels = n.div_ceil(rows_per_panel);
    let dtype = w.dtype();
    // Packed weights come in groups of `GROUP` rows (a panel starts on a group), the others
    // as GGUF rows.
    let (bytes, rb) = if packed {
        (packed::packed(w), packed::group_bytes(dtype, k) / packed::GROUP)
    } else {
        (w.bytes(), w.row_bytes())
    };
    let dst = SharedMut(out.as_mut_ptr());
    (0..panels).into_par_iter().try_for_each_init(Sliver::default, |sliver, c| {
        let r0 = c * rows_per_panel;
        let r1 = (r0 + rows_per_panel).min(n);
        let end = if packed { r1.next_multiple_of(packed::GROUP) } else { r1 };
        let src = bytes
            .get(r0 * rb..end * rb)
            .ok_or_else(|| RuntimeError::Shape(format!("rows {r0}..{r1} of {w:?}: short buffer")))?;
        let base = dst;
        // SAFETY: the caller vouches for the CPU; this panel writes columns r0..r1 of every
        // row of `out`, which no other panel touches.
        unsafe {
            let c = base.ptr().add(r0);
            match dtype {
                _ if !packed => panel(&acts, m, dtype, src, rb, r1 - r0, c, n, sliver),
                DType::Q4_0 => packed_panel::<Q4_0>(&acts, m, src, r1 - r0, c, n, sliver),
                DType::Q4_1 => packed_panel::<Q4_1>(&acts, m, src, r1 - r0, c, n, sliver),
                DType::Q5_0 => packed_panel::<Q5_0>(&acts, m, src, r1 - r0, c, n, sliver),
                DType::Q5_1 => packed_panel::<Q5_1>(&acts, m, src, r1 - r0, c, n, sliver),
                _ => packed_panel::<Q8_0>(&acts, m, src, r1 - r0, c, n, sliver),
            }
        }
        Ok(())
    })
}

/// One panel of `cols` weight rows from their packed groups (`src`) into `c` (row stride
/// `ldc`), sliver by sliver. Up to `DIRECT_ROWS` activation rows, each `MR`-row tile expands
/// the codes itself over the whole of `k`; with more, a `KC` slice of the sliver is expanded
/// once into `sl` and every tile reads it from there (same integers, same order of blocks).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn packed_panel<F: Packing>(
    acts: &Acts,
    m: usize,
    src: &[u8],
    cols: usize,
    c: *mut f32,
    ldc: usize,
    sl: &mut Sliver,
) {
    let k = acts.k;
    let group = src.len() / cols.div_ceil(packed::GROUP);
    for j0 in (0..cols).step_by(NR) {
        let nr = NR.min(cols - j0);
        let mask = if nr >= 32 { u32::MAX } else { (1u32 << nr) - 1 };
        let first = src.as_ptr().add(j0 / packed::GROUP * group);
        // A lone last group reads itself twice; the second half's lanes are never stored.
        let second = if nr > packed::GROUP { first.add(group) } else { first };
        let w = PackedWeights::<F> {
            groups: [first, second],
            next: NR / packed::GROUP * group,
            kind: std::marker::PhantomData,
        };
        let slice = if m <= DIRECT_ROWS { k } else { KC };
        for pc in (0..k).step_by(slice) {
            let blocks = slice.min(k - pc) / B;
            let b0 = pc / B;
            if m > DIRECT_ROWS {
                for b in 0..blocks {
                    for z in 0..2 {
                        let (ws, wm) = w.scales(b0 + b, z);
                        _mm512_storeu_ps(sl.ws.as_mut_ptr().add(b * NR + 16 * z), ws);
                        _mm512_storeu_ps(sl.wm.as_mut_ptr().add(b * NR + 16 * z), wm);
                        for p in 0..B / 2 {
                            let at = sl.pairs.as_mut_ptr().add((b * B / 2 + p) * NR + 16 * z);
                            _mm512_storeu_si512(at as *mut __m512i, w.pairs(b0 + b, p, z));
                        }
                    }
                }
            }
            for blk in 0..m.div_ceil(MR) {
                let tile = Tile {
                    blocks,
                    a: acts.pairs.as_ptr().add((blk * k + pc) / 2 * MR),
                    da: acts.d.as_ptr().add((blk * k + pc) / B * MR),
                    sa: acts.s.as_ptr().add((blk * k + pc) / B * MR),
                    w: (),
                    c: c.add(j0 + blk * MR * ldc),
                    ldc,
                    mask,
                    accumulate: pc > 0,
                    offsets: F::AFFINE,
                };
                if m <= DIRECT_ROWS {
                    tile.with(w).run_rows(m - blk * MR);
                } else {
                    tile.with(SliverWeights { pairs: sl.pairs.as_ptr(), ws: sl.ws.as_ptr(), wm: sl.wm.as_ptr() })
                        .run_rows(m - blk * MR);
                }
            }
        }
    }
}

/// One panel of `cols` weight rows (`src`, `rb` bytes each) into `c` (row stride `ldc`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn panel(
    acts: &Acts,
    m: usize,
    dtype: DType,
    src: &[u8],
    rb: usize,
    cols: usize,
    c: *mut f32,
    ldc: usize,
    sl: &mut Sliver,
) {
    let k = acts.k;
    if m <= FEW_ROWS {
        let kernel: FewDirect = match dtype {
            DType::Q4_0 => few_legacy::<Q4_0>,
            DType::Q4_1 => few_legacy::<Q4_1>,
            DType::Q5_0 => few_legacy::<Q5_0>,
            DType::Q5_1 => few_legacy::<Q5_1>,
            DType::Q8_0 => few_legacy::<Q8_0>,
            DType::Q4K => few_k4k5::<false>,
            DType::Q5K => few_k4k5::<true>,
            _ => few_q6k,
        };
        for j0 in (0..cols).step_by(16) {
            for i in 0..m {
                kernel(acts, i, src.as_ptr().add(j0 * rb), rb, (cols - j0).min(16), c.add(i * ldc + j0));
            }
        }
        return;
    }
    let offsets = matches!(dtype, DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K);
    let (elems, block_bytes) = (dtype.block_elems(), dtype.block_bytes());
    for j0 in (0..cols).step_by(NR) {
        let nr = NR.min(cols - j0);
        if nr < NR {
            sl.rows[nr * KC..].fill(0);
            sl.ws.fill(0.0);
            sl.wm.fill(0.0);
        }
        let mut pc = 0;
        while pc < k {
            let kc = KC.min(k - pc);
            let seg = kc / elems * block_bytes;
            for j in 0..nr {
                let blocks = src.as_ptr().add((j0 + j) * rb + pc / elems * block_bytes);
                // The weights stream from memory once per call: fetch this row's next slice
                // (or, after the last one, the next sliver's first) while decoding this one.
                let next = if pc + kc < k {
                    blocks.wrapping_add(seg)
                } else {
                    blocks.wrapping_add(NR * rb - pc / elems * block_bytes)
                };
                prefetch(next, seg);
                let (ws, wm) = (sl.ws.as_mut_ptr(), sl.wm.as_mut_ptr());
                let mut scales = |b: usize, scale: f32, offset: f32| {
                    *ws.add(b * NR + j) = scale;
                    *wm.add(b * NR + j) = offset;
                };
                decode(dtype, blocks, kc, sl.rows.as_mut_ptr().add(j * KC), &mut scales);
            }
            let cs = c.add(j0);
            for half in 0..2 {
                for p0 in (0..kc / 2).step_by(16) {
                    transpose16(
                        sl.rows.as_ptr().add(16 * half * KC + 2 * p0),
                        sl.pairs.as_mut_ptr().add(p0 * NR + 16 * half),
                    );
                }
            }
            for blk in 0..m.div_ceil(MR) {
                let t = Tile {
                    blocks: kc / B,
                    a: acts.pairs.as_ptr().add((blk * k + pc) / 2 * MR),
                    da: acts.d.as_ptr().add((blk * k + pc) / B * MR),
                    sa: acts.s.as_ptr().add((blk * k + pc) / B * MR),
                    w: SliverWeights { pairs: sl.pairs.as_ptr(), ws: sl.ws.as_ptr(), wm: sl.wm.as_ptr() },
                    c: cs.add(blk * MR * ldc),
                    ldc,
                    mask: if nr >= 32 { u32::MAX } else { (1u32 << nr) - 1 },
                    accumulate: pc > 0,
                    offsets,
                };
                t.run_rows(m - blk * MR);
            }
            pc += kc;
        }
    }
}

/// The lanes of the first `live ≤ 16` rows.
fn live_mask(live: usize) -> u16 {
    if live >= 16 {
        u16::MAX
    } else {
        (1u16 << live) - 1
    }
}

/// The few-row kernels walk 16 rows side by side, 16 short strided streams that the hardware
/// prefetcher follows poorly. Instead, while they work on one group of 16 rows they fetch the
/// next group (contiguous in memory) front to back, one slice per step, into L2 (prefetching
/// into L1 evicted the current group's lines: Qwen2.5-Coder-1.5B decode 12.1 → 12.8–13.3 tok/s).
struct Ahead {
    next: *const u8,
    per_step: usize,
}

impl Ahead {
    #[inline(always)]
    fn new(w: *const u8, rb: usize, steps: usize) -> Ahead {
        Ahead { next: w.wrapping_add(16 * rb), per_step: (16 * rb).div_ceil(steps.max(1)).next_multiple_of(64) }
    }

    #[inline(always)]
    unsafe fn step(&self, i: usize) {
        let p = self.next.wrapping_add(i * self.per_step);
        for off in (0..self.per_step).step_by(64) {
            _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(off) as *const i8);
        }
    }
}

/// Byte offsets of 16 rows `rb` apart, rows past `live` repeating the last live one.
#[inline(always)]
unsafe fn row_offsets(live: usize, rb: usize) -> __m512i {
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    _mm512_mullo_epi32(_mm512_min_epi32(lanes, _mm512_set1_epi32(live as i32 - 1)), _mm512_set1_epi32(rb as i32))
}

type FewDirect = unsafe fn(&Acts, usize, *const u8, usize, usize, *mut f32);

/// Few-row kernel for the 32-value block formats, straight from the GGUF bytes: activation
/// row `i` against the `live ≤ 16` weight rows at `w` (`rb` bytes apart) into the outputs at
/// `c`. Each block's 16 headers come in one gather; the arithmetic is `few`'s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn few_legacy<F: Legacy>(acts: &Acts, i: usize, w: *const u8, rb: usize, live: usize, c: *mut f32) {
    let nb = acts.k / B;
    let a = acts.q.as_ptr().add(i * acts.k);
    let mask = live_mask(live);
    // Rows past `live` re-read the last live row; their lanes are never stored.
    let row = |r: usize| w.add(r.min(live - 1) * rb);
    let offsets = row_offsets(live, rb);
    let ahead = Ahead::new(w, rb, nb);
    let mut acc = _mm512_setzero_ps();
    for b in 0..nb {
        ahead.step(b);
        let x = _mm512_loadu_si512(a.add(b * B) as *const __m512i);
        let p: [__m512i; 16] = std::array::from_fn(|r| {
            let (lo, hi) = F::values_simd(row(r).add(b * F::BYTES));
            _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi), x)
        });
        // Sixteen (d, m) f16 pairs: `ws` from the low halves, `wm` from the high ones.
        let hdr = _mm512_i32gather_epi32::<1>(offsets, w.add(b * F::BYTES) as *const i32);
        let ws = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr));
        let at = acts.scale_at(i, b);
        let (da, sa) = (_mm512_set1_ps(*acts.d.get_unchecked(at)), _mm512_set1_ps(*acts.s.get_unchecked(at)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(reduce16(p)), _mm512_mul_ps(ws, da), acc);
        if F::AFFINE {
            let wm = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(hdr)));
            acc = _mm512_fmadd_ps(wm, sa, acc);
        }
    }
    _mm512_mask_storeu_ps(c, mask, acc);
}

/// Few-row kernel for Q4_K (`Q5 = false`) and Q5_K, straight from the GGUF bytes, like
/// `few_legacy`: per super-block, each row's sub-block `(ws, wm)` are computed once into a
/// `[sub-block][row]` table; each 32-value sub-block is then one widening load per row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn few_k4k5<const Q5: bool>(acts: &Acts, i: usize, w: *const u8, rb: usize, live: usize, c: *mut f32) {
    let bytes = if Q5 { 176 } else { 144 };
    let a = acts.q.as_ptr().add(i * acts.k);
    let row = |r: usize| w.add(r.min(live - 1) * rb);
    let offsets = row_offsets(live, rb);
    let ahead = Ahead::new(w, rb, acts.k / 256);
    let mut acc = _mm512_setzero_ps();
    for sb in 0..acts.k / 256 {
        ahead.step(sb);
        // The 16 rows' headers, four gathers: (d, dmin) and the 12 packed scale/min bytes
        // (`k4k5_scales_mins`, lane-wise), then `ws = d * sc`, `wm = -dmin * min` per sub-block.
        let base = w.add(sb * bytes);
        let field = |at: usize| _mm512_i32gather_epi32::<1>(offsets, base.add(at) as *const i32);
        let (hdr, w0, w1, w2) = (field(0), field(4), field(8), field(12));
        let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr));
        let neg_dmin =
            _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(hdr))));
        let (six, four, two) =
            (_mm512_set1_epi32(0x3F3F_3F3F), _mm512_set1_epi32(0x0F0F_0F0F), _mm512_set1_epi32(0x0303_0303));
        let top = |v: __m512i| _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(v), two));
        let sc = [_mm512_and_si512(w0, six), _mm512_or_si512(_mm512_and_si512(w2, four), top(w0))];
        let mn =
            [_mm512_and_si512(w1, six), _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32::<4>(w2), four), top(w1))];
        let byte = |v: __m512i, s: usize| {
            _mm512_cvtepi32_ps(_mm512_and_si512(
                _mm512_srl_epi32(v, _mm_cvtsi32_si128(8 * (s % 4) as i32)),
                _mm512_set1_epi32(0xFF),
            ))
        };
        let ws: [__m512; 8] = std::array::from_fn(|s| _mm512_mul_ps(d, byte(sc[s / 4], s)));
        let wm: [__m512; 8] = std::array::from_fn(|s| _mm512_mul_ps(neg_dmin, byte(mn[s / 4], s)));
        for s in 0..8 {
            let x = _mm512_loadu_si512(a.add(256 * sb + B * s) as *const __m512i);
            let p: [__m512i; 16] = std::array::from_fn(|r| {
                let blk = row(r).add(sb * bytes);
                let codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                    blk.add(if Q5 { 48 } else { 16 } + B * (s / 2)) as *const __m256i
                ));
                let mut v = if s % 2 == 0 {
                    _mm512_and_si512(codes, _mm512_set1_epi16(0x0F))
                } else {
                    _mm512_srli_epi16::<4>(codes)
                };
                if Q5 {
                    let high = _mm512_cvtepu8_epi16(_mm256_loadu_si256(blk.add(16) as *const __m256i));
                    let bit =
                        _mm512_and_si512(_mm512_srl_epi16(high, _mm_cvtsi32_si128(s as i32)), _mm512_set1_epi16(1));
                    v = _mm512_or_si512(v, _mm512_slli_epi16::<4>(bit));
                }
                _mm512_dpwssd_epi32(_mm512_setzero_si512(), v, x)
            });
            let at = acts.scale_at(i, 8 * sb + s);
            let (da, sa) = (_mm512_set1_ps(*acts.d.get_unchecked(at)), _mm512_set1_ps(*acts.s.get_unchecked(at)));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(reduce16(p)), _mm512_mul_ps(ws[s], da), acc);
            acc = _mm512_fmadd_ps(wm[s], sa, acc);
        }
    }
    _mm512_mask_storeu_ps(c, live_mask(live), acc);
}

/// Few-row kernel for Q6_K, straight from the GGUF bytes, like `few_legacy` but row by row
/// within a super-block: a row's bit planes are loaded once and rebuilt into its eight
/// 32-value sub-blocks (`code - 32` times the 16-value group scales), each dotted with its
/// activation block; the 8 × 16 partial vectors are then reduced per sub-block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn few_q6k(acts: &Acts, i: usize, w: *const u8, rb: usize, live: usize, c: *mut f32) {
    const BYTES: usize = 210;
    let a = acts.q.as_ptr().add(i * acts.k);
    let row = |r: usize| w.add(r.min(live - 1) * rb);
    let offsets = row_offsets(live, rb);
    let ahead = Ahead::new(w, rb, acts.k / 256);
    // Lanes 0..16 take group scale 2s, lanes 16..32 scale 2s + 1, for sub-block s.
    let pick: [__m512i; 8] = std::array::from_fn(|s| {
        _mm512_inserti64x4::<1>(_mm512_set1_epi16(2 * s as i16), _mm256_set1_epi16(2 * s as i16 + 1))
    });
    let (low4, bits45, off) = (_mm512_set1_epi16(0x0F), _mm512_set1_epi16(0x30), _mm512_set1_epi16(32));
    let mut partial = [[_mm512_setzero_si512(); 16]; 8];
    let mut acc = _mm512_setzero_ps();
    for sb in 0..acts.k / 256 {
        ahead.step(sb);
        let x: [__m512i; 8] = std::array::from_fn(|s| _mm512_loadu_si512(a.add(256 * sb + B * s) as *const __m512i));
        #[allow(clippy::needless_range_loop)] // `r` indexes the inner arrays of `partial`
        for r in 0..16 {
            let blk = row(r).add(sb * BYTES);
            let widen = |at: usize| _mm512_cvtepu8_epi16(_mm256_loadu_si256(blk.add(at) as *const __m256i));
            let scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192) as *const __m128i)));
            for h in 0..2 {
                let (ql, qh) = ([widen(64 * h), widen(64 * h + 32)], widen(128 + 32 * h));
                let high = [_mm512_slli_epi16::<4>(qh), _mm512_slli_epi16::<2>(qh), qh, _mm512_srli_epi16::<2>(qh)];
                for (plane, high) in high.into_iter().enumerate() {
                    let q = ql[plane % 2];
                    let low = if plane < 2 { _mm512_and_si512(q, low4) } else { _mm512_srli_epi16::<4>(q) };
                    let code = _mm512_sub_epi16(_mm512_or_si512(low, _mm512_and_si512(high, bits45)), off);
                    let s = 4 * h + plane;
                    let v = _mm512_mullo_epi16(code, _mm512_permutexvar_epi16(pick[s], scales));
                    partial[s][r] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), v, x[s]);
                }
            }
        }
        // `d` is the f16 at byte 208: the high half of the u32 at 206 (in bounds).
        let hdr = _mm512_i32gather_epi32::<1>(offsets, w.add(sb * BYTES + 206) as *const i32);
        let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(hdr)));
        for (s, p) in partial.iter().enumerate() {
            let da = _mm512_set1_ps(*acts.d.get_unchecked(acts.scale_at(i, 8 * sb + s)));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(reduce16(*p)), _mm512_mul_ps(d, da), acc);
        }
    }
    _mm512_mask_storeu_ps(c, live_mask(live), acc);
}

/// Lane `r` of the result is the sum of the 16 lanes of `p[r]` (exact: integer adds).
#[inline(always)]
unsafe fn reduce16(p: [__m512i; 16]) -> __m512i {
    // Pairs: per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3].
    let q: [__m512i; 8] = std::array::from_fn(|i| {
        let (a, b) = (p[2 * i], p[2 * i + 1]);
        _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
    });
    // Quads: per 128-bit lane, the lane sums of rows 4i..4i + 4.
    let t: [__m512i; 4] = std::array::from_fn(|i| {
        let (a, b) = (q[2 * i], q[2 * i + 1]);
        _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
    });
    // Fold the four 128-bit lanes: first pairwise within two rows-groups, then across.
    let fold = |a: __m512i, b: __m512i| {
        _mm512_add_epi32(_mm512_shuffle_i32x4::<0x88>(a, b), _mm512_shuffle_i32x4::<0xDD>(a, b))
    };
    fold(fold(t[0], t[1]), fold(t[2], t[3]))
}

/// Transpose 16 rows of 16 i32 pairs (`src`, row stride `KC` i16) into 16 pair-rows of 16
/// (`dst`, row stride `NR` i32).
#[inline(always)]
unsafe fn transpose16(src: *const i16, dst: *mut i32) {
    let r: [__m512i; 16] = std::array::from_fn(|i| _mm512_loadu_si512(src.add(i * KC) as *const __m512i));
    let t: [__m512i; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    // u[4g + j], per 128-bit lane L: column 4L + j of rows 4g..4g + 4.
    let u: [__m512i; 16] = std::array::from_fn(|q| {
        let (g, j) = (q / 4, q % 4);
        let (a, b) = (t[4 * g + j / 2], t[4 * g + 2 + j / 2]);
        if j % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    for j in 0..4 {
        let lo01 = _mm512_shuffle_i32x4::<0x44>(u[j], u[4 + j]);
        let hi01 = _mm512_shuffle_i32x4::<0xEE>(u[j], u[4 + j]);
        let lo23 = _mm512_shuffle_i32x4::<0x44>(u[8 + j], u[12 + j]);
        let hi23 = _mm512_shuffle_i32x4::<0xEE>(u[8 + j], u[12 + j]);
        let out = [
            _mm512_shuffle_i32x4::<0x88>(lo01, lo23),
            _mm512_shuffle_i32x4::<0xDD>(lo01, lo23),
            _mm512_shuffle_i32x4::<0x88>(hi01, hi23),
            _mm512_shuffle_i32x4::<0xDD>(hi01, hi23),
        ];
        for (l, o) in out.into_iter().enumerate() {
            _mm512_storeu_si512(dst.add((4 * l + j) * NR) as *mut __m512i, o);
        }
    }
}

/// Decode `kc` values of one row starting at the block at `blk` into `out` as `v`, and report
/// each 32-block's `(ws, wm)` (K-quant slices are always one whole super-block).
#[inline(always)]
unsafe fn decode(dtype: DType, blk: *const u8, kc: usize, out: *mut i16, scales: &mut impl FnMut(usize, f32, f32)) {
    let store = |at: usize, v: __m256i| _mm256_storeu_si256(out.add(at) as *mut __m256i, v);
    match dtype {
        DType::Q4_0 => legacy::<Q4_0>(blk, kc, out, scales),
        DType::Q4_1 => legacy::<Q4_1>(blk, kc, out, scales),
        DType::Q5_0 => legacy::<Q5_0>(blk, kc, out, scales),
        DType::Q5_1 => legacy::<Q5_1>(blk, kc, out, scales),
        DType::Q8_0 => legacy::<Q8_0>(blk, kc, out, scales),
        DType::Q4K | DType::Q5K => {
            let q5 = dtype == DType::Q5K;
            let (d, dmin) = f16x2(blk);
            let (sc, mn) = k4k5_scales_mins(blk);
            let mut high = if q5 { k4k5_high::<true>(blk) } else { k4k5_high::<false>(blk) };
            for g in 0..4 {
                let v =
                    if q5 { k4k5_values::<true>(blk, g, &mut high) } else { k4k5_values::<false>(blk, g, &mut high) };
                for (i, v) in v.into_iter().enumerate() {
                    store(64 * g + 16 * i, v);
                }
                for s in [2 * g, 2 * g + 1] {
                    scales(s, d * f32::from(sc[s]), -dmin * f32::from(mn[s]));
                }
            }
        }
        DType::Q6K => {
            let d = q6k_d(blk);
            let scale = |g: usize| _mm256_set1_epi16(i16::from(*blk.add(192 + g) as i8));
            for h in 0..2 {
                for (p, [lo, hi]) in q6k_values(blk, h).into_iter().enumerate() {
                    let g = 8 * h + 2 * p;
                    store(128 * h + 32 * p, _mm256_mullo_epi16(lo, scale(g)));
                    store(128 * h + 32 * p + 16, _mm256_mullo_epi16(hi, scale(g + 1)));
                    scales(4 * h + p, d, 0.0);
                }
            }
        }
        _ => {}
    }
}

#[inline(always)]
unsafe fn legacy<F: Legacy>(blk: *const u8, kc: usize, out: *mut i16, scales: &mut impl FnMut(usize, f32, f32)) {
    for b in 0..kc / B {
        let at = blk.add(b * F::BYTES);
        let (lo, hi) = F::values_simd(at);
        _mm256_storeu_si256(out.add(B * b) as *mut __m256i, lo);
        _mm256_storeu_si256(out.add(B * b + 16) as *mut __m256i, hi);
        let (d, m) = f16x2(at);
        scales(b, d, if F::AFFINE { m } else { 0.0 });
    }
}

/// Where a micro-tile reads its 32 weight columns (two halves `z` of 16): per block `b`, the
/// halves' `(ws, wm)` and, per step `p`, their pairs `(v[2p], v[2p + 1])`.
trait TileWeights {
    unsafe fn scales(&self, b: usize, z: usize) -> (__m512, __m512);
    unsafe fn pairs(&self, b: usize, p: usize, z: usize) -> __m512i;
}

/// A decoded and transposed `Sliver`.
struct SliverWeights {
    pairs: *const i32,
    ws: *const f32,
    wm: *const f32,
}

impl TileWeights for SliverWeights {
    #[inline(always)]
    unsafe fn scales(&self, b: usize, z: usize) -> (__m512, __m512) {
        (_mm512_loadu_ps(self.ws.add(b * NR + 16 * z)), _mm512_loadu_ps(self.wm.add(b * NR + 16 * z)))
    }
    #[inline(always)]
    unsafe fn pairs(&self, b: usize, p: usize, z: usize) -> __m512i {
        _mm512_loadu_si512(self.pairs.add((b * B / 2 + p) * NR + 16 * z) as *const __m512i)
    }
}

/// Two packed groups of 16 rows (`packed`). Reading a block's scales also fetches the same
/// block of the next sliver (`next` bytes on) into L2, so the weights stream in ahead of use.
struct PackedWeights<F> {
    groups: [*const u8; 2],
    next: usize,
    kind: std::marker::PhantomData<F>,
}

impl<F> Clone for PackedWeights<F> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<F> Copy for PackedWeights<F> {}

impl<F: Packing> TileWeights for PackedWeights<F> {
    #[inline(always)]
    unsafe fn scales(&self, b: usize, z: usize) -> (__m512, __m512) {
        let hdr = self.groups[z].add(b * F::PACKED);
        let ahead = hdr.wrapping_add(self.next);
        for off in (0..F::PACKED).step_by(64) {
            _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(off) as *const i8);
        }
        let half = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(hdr.add(at) as *const __m256i));
        (half(0), if F::AFFINE { half(32) } else { _mm512_setzero_ps() })
    }
    #[inline(always)]
    unsafe fn pairs(&self, b: usize, p: usize, z: usize) -> __m512i {
        F::pairs(self.groups[z].add(b * F::PACKED + F::HEADER), p)
    }
}

/// One micro-tile: `R ≤ MR` activation rows times 32 weight columns over `blocks` blocks.
#[derive(Clone, Copy)]
struct Tile<W> {
    blocks: usize,
    a: *const i32,
    da: *const f32,
    sa: *const f32,
    w: W,
    c: *mut f32,
    ldc: usize,
    mask: u32,
    accumulate: bool,
    /// Whether the weights have offset terms (`wm` is all zero otherwise).
    offsets: bool,
}

impl Tile<()> {
    /// This tile reading `w`.
    #[inline(always)]
    fn with<W>(&self, w: W) -> Tile<W> {
        let Tile { blocks, a, da, sa, w: (), c, ldc, mask, accumulate, offsets } = *self;
        Tile { blocks, a, da, sa, w, c, ldc, mask, accumulate, offsets }
    }
}

impl<W: TileWeights> Tile<W> {
    /// `run` for the first `rows.min(MR)` activation rows.
    #[inline(always)]
    unsafe fn run_rows(&self, rows: usize) {
        match rows.min(MR) {
            6 => self.run::<6>(),
            5 => self.run::<5>(),
            4 => self.run::<4>(),
            3 => self.run::<3>(),
            2 => self.run::<2>(),
            _ => self.run::<1>(),
        }
    }

    #[inline(always)]
    unsafe fn run<const R: usize>(&self) {
        let mut acc = super::gemm512::load_tile::<R>(self.c, self.ldc, self.mask, self.accumulate);
        for b in 0..self.blocks {
            let mut dot = [[_mm512_setzero_si512(); 2]; R];
            let a = self.a.add(b * B / 2 * MR);
            for p in 0..B / 2 {
                let (w0, w1) = (self.w.pairs(b, p, 0), self.w.pairs(b, p, 1));
                for (i, d) in dot.iter_mut().enumerate() {
                    let x = _mm512_set1_epi32(*a.add(p * MR + i));
                    d[0] = _mm512_dpwssd_epi32(d[0], w0, x);
                    d[1] = _mm512_dpwssd_epi32(d[1], w1, x);
                }
            }
            let (s0, s1) = (self.w.scales(b, 0), self.w.scales(b, 1));
            let (ws, wm) = ([s0.0, s1.0], [s0.1, s1.1]);
            for (i, (a, d)) in acc.iter_mut().zip(&dot).enumerate() {
                let da = _mm512_set1_ps(*self.da.add(b * MR + i));
                let sa = _mm512_set1_ps(*self.sa.add(b * MR + i));
                for z in 0..2 {
                    a[z] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[z]), _mm512_mul_ps(ws[z], da), a[z]);
                    if self.offsets {
                        a[z] = _mm512_fmadd_ps(wm[z], sa, a[z]);
                    }
                }
            }
        }
        super::gemm512::store_tile(&acc, self.c, self.ldc, self.mask);
    }
}
