//! Integer matmul on quantized weights with AVX-512 VNNI, for every number of activation rows:
//! `out[m, n] = x[m, k] · Wᵀ` as 16-bit integer products (`vpdpwssd`). It is the only fast path
//! for the dtypes `packed` lays out, from a single decode row to a 512-token prompt, so a
//! row's result never depends on how many rows share the call (batch invariance).
//!
//! Both sides are cut into blocks of 32 values along `k`. A weight block is 32 small integers
//! `v` with a scale `ws` and an offset term `wm` (`value = ws * v + wm`): a legacy block's
//! `(d, m)`, a Q4_K/Q5_K sub-block's `(d * sc, -dmin * min)`, a Q6_K block's `(d, 0)` with its
//! two group scales folded into `v` (|v| ≤ 4096), an MLX block's `(scale, bias)` of its group
//! with its unsigned codes (v ≤ 255). An activation block is 14-bit codes `q` with
//! a scale `da` and `s = da * Σq`. The numerics, per output and block in order of `k`, are
//! exactly
//!
//! ```text
//! acc = fma(f32(Σ v·q), ws * da, acc);   acc = fma(wm, s, acc)   (the latter for affine dtypes)
//! ```
//!
//! with `Σ v·q` an exact 32-bit integer (32 · 4096 · 8191 < 2³¹), whichever kernel runs.
//!
//! The weights are read from their `packed` copy (16 rows interleaved). Each thread takes
//! panels of 32-row slivers; an 8×32 micro-kernel (`Tile`) keeps 16 integer accumulators per
//! block, one broadcast activation pair per `vpdpwssd` (lanes along the output columns); its
//! f32 accumulators spill, which costs little next to a block's 32 `vpdpwssd` per row, and
//! eight rows let a batch of eight decode rows expand each weight step once (six rows plus
//! two expanded it twice: 7.3 → 6.4 ms for SmolLM2's layer matmuls at 8 rows). Up
//! to `DIRECT_ROWS` activation rows the tile expands the packed codes itself (decode: the
//! weights stream from memory once, the next sliver prefetched into L2 meanwhile); with more,
//! each `KC` slice of a sliver is expanded once into a buffer that every tile reads.

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::acts;
use super::igemm_avx2::Halves;
use super::isa::Level;
use super::packed::{self, FormatFn, Half, Packing, QUAD, QUADS};
use crate::cpu::SharedMut;
use crate::dtype::DType;
use crate::error::{Result, RuntimeError};
use crate::tensor::Tensor;
use crate::threads;

/// Values per scale, on both sides.
const B: usize = 32;
/// Code pairs per block.
const STEPS: usize = B / 2;
/// Weight rows (output columns) per sliver: two packed groups.
const NR: usize = 2 * packed::GROUP;
/// Activation rows per micro-tile (a batch of eight decode rows is one tile).
pub(super) const MR: usize = 8;
/// Columns of `k` expanded at a time into a `Sliver` (many-row path).
const KC: usize = 256;
/// Largest activation code (see the overflow bound in the module docs).
const QMAX: f32 = 8191.0;
/// Most activation rows one pass over a panel's slivers serves (many-row path): a `KC` slice
/// of their codes (256 KiB) stays in L2 while every sliver of the panel reads it. A 2,048-token
/// prompt in one pass streamed its codes from L3 for each sliver.
const MC: usize = 512;
/// Up to this many activation rows, each tile expands the packed codes itself.
const DIRECT_ROWS: usize = 2 * MR;
/// Most slivers per panel (a panel is one work item of the pool).
const MAX_PANEL_SLIVERS: usize = 16;

/// Whether this module multiplies `dtype`.
pub(crate) fn supports(dtype: DType) -> bool {
    packed::packs(dtype)
}

/// Quantized activations (shared with `igemm_avx2`), in blocks of `MR` rows: `d` and `s` are laid out
/// `[m / MR][k / B][MR]`, `pairs[(blk * k / 2 + p) * MR + i]` holds codes `2p, 2p + 1` of row
/// `blk * MR + i`, and `sums16` (`[m / MR][k / 16][MR]`) the integer sum of each 16 codes (what
/// a format with an offset per 16-value sub-block takes off once instead of at every code).
/// Padding rows are zero.
pub(super) struct Acts {
    pub(super) k: usize,
    pub(super) pairs: Vec<i32>,
    pub(super) d: Vec<f32>,
    pub(super) s: Vec<f32>,
    pub(super) sums16: Vec<i32>,
}

impl Acts {
    /// The codes of `x` (`[m, k]`), quantized with AVX2 (which the integer GEMMs' CPUs have).
    pub(super) fn new(x: &[f32], m: usize, k: usize) -> Acts {
        let blocks = m.div_ceil(MR);
        let (kb, kp) = (k / B, k / 2);
        let mut pairs = vec![0i32; blocks * kp * MR];
        let (mut d, mut s) = (vec![0f32; blocks * kb * MR], vec![0f32; blocks * kb * MR]);
        let mut sums16 = vec![0i32; blocks * k / 16 * MR];
        pairs
            .par_chunks_mut(kp * MR)
            .zip(d.par_chunks_mut(kb * MR))
            .zip(s.par_chunks_mut(kb * MR))
            .zip(sums16.par_chunks_mut(k / 16 * MR))
            .enumerate()
            .for_each(|(blk, (((pairs, d), s), sums16))| {
                // The block's rows as codes, row after row (padding rows stay zero).
                let (mut q, mut rd) = (vec![0i16; MR * k], vec![0f32; kb]);
                for (i, (row, q)) in x.chunks_exact(k).skip(blk * MR).zip(q.chunks_exact_mut(k)).enumerate() {
                    acts::quantize_row(row, B, QMAX, q, &mut rd, Level::Avx2);
                    for (j, c) in q.chunks_exact(16).enumerate() {
                        sums16[j * MR + i] = c.iter().map(|&v| i32::from(v)).sum();
                    }
                    for (b, &db) in rd.iter().enumerate() {
                        d[b * MR + i] = db;
                        s[b * MR + i] = db * (sums16[2 * b * MR + i] + sums16[(2 * b + 1) * MR + i]) as f32;
                    }
                }
                // SAFETY: `Acts` is only built on CPUs with AVX2 (see the GEMMs' `linear_many`), and
                // `q` holds `MR` rows of `2 * kp` codes, `pairs` `kp * MR` pairs.
                unsafe { interleave_pairs(&q, kp, pairs) };
            });
        Acts { k, pairs, d, s, sums16 }
    }
}

/// `pairs[p * MR + i]` = codes `2p, 2p + 1` of row `i` of `q` (`MR` rows of `2 * kp` codes):
/// each row read as `kp` little-endian i32 pairs, the `MR × kp` matrix transposed 8 × 8 at a
/// time (a scalar loop over the pairs cost ~4 µs per call at eight rows, serial in a decode
/// step).
#[target_feature(enable = "avx2")]
unsafe fn interleave_pairs(q: &[i16], kp: usize, pairs: &mut [i32]) {
    const { assert!(MR == 8) };
    assert!(q.len() == MR * 2 * kp && pairs.len() == kp * MR && kp.is_multiple_of(8));
    let row = |i: usize, p: usize| _mm256_loadu_si256(q.as_ptr().add(2 * (i * kp + p)) as *const __m256i);
    for p in (0..kp).step_by(8) {
        let r: [__m256i; 8] = std::array::from_fn(|i| row(i, p));
        // t[2j + h]: rows 2j, 2j + 1 interleaved; pairs 0, 1 | 4, 5 (h = 0) or 2, 3 | 6, 7.
        let t: [__m256i; 8] = std::array::from_fn(|a| {
            let (x, y) = (r[a & !1], r[a | 1]);
            if a % 2 == 0 {
                _mm256_unpacklo_epi32(x, y)
            } else {
                _mm256_unpackhi_epi32(x, y)
            }
        });
        // u[4g + c]: rows 4g..4g + 4 of pair c (low lane) and pair c + 4 (high lane).
        let u: [__m256i; 8] = std::array::from_fn(|a| {
            let (g, c) = (a / 4, a % 4);
            let (x, y) = (t[4 * g + c / 2], t[4 * g + 2 + c / 2]);
            if c % 2 == 0 {
                _mm256_unpacklo_epi64(x, y)
            } else {
                _mm256_unpackhi_epi64(x, y)
            }
        });
        let out = pairs.as_mut_ptr().add(p * MR) as *mut __m256i;
        for c in 0..4 {
            _mm256_storeu_si256(out.add(c), _mm256_permute2x128_si256::<0x20>(u[c], u[4 + c]));
            _mm256_storeu_si256(out.add(c + 4), _mm256_permute2x128_si256::<0x31>(u[c], u[4 + c]));
        }
    }
}

/// One sliver's weights for a `KC` slice, expanded (many-row path): `pairs` is
/// `[KC / 2][NR]` code pairs, `ws` and `wm` are `[KC / B][NR]`.
struct Sliver {
    pairs: Vec<i32>,
    ws: Vec<f32>,
    wm: Vec<f32>,
}

impl Default for Sliver {
    fn default() -> Sliver {
        Sliver { pairs: vec![0; KC / 2 * NR], ws: vec![0.0; KC / B * NR], wm: vec![0.0; KC / B * NR] }
    }
}

/// `outs[i] = x · ws[i]ᵀ` for weights of one `dtype` that `supports` accepts and one row
/// length, any `m ≥ 1`: the activations are quantized once and the panels of every weight
/// share one parallel loop (q/k/v, gate/up of a layer). Each output is what a call with its
/// weight alone gives, bit for bit.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL/VNNI (and AVX2/FMA/F16C); `x` is `[m, k]` and each
/// `outs[i]` is `[m, ws[i].rows()]`, every weight `[_, k]` of that one dtype.
pub(crate) unsafe fn linear_many(x: &[f32], m: usize, ws: &[&Tensor], outs: &mut [&mut [f32]]) -> Result<()> {
    struct Gemm<'a, 'b> {
        x: &'a [f32],
        m: usize,
        ws: &'a [&'a Tensor],
        outs: &'a mut [&'b mut [f32]],
    }
    impl FormatFn for Gemm<'_, '_> {
        type Out = Result<()>;
        /// # Safety
        /// `linear_many`'s.
        unsafe fn call<F: Packing + Halves>(self) -> Result<()> {
            linear_packed::<F>(self.x, self.m, self.ws, self.outs)
        }
    }
    match ws.first() {
        None => Ok(()),
        Some(w) => packed::with_format(w.dtype(), Gemm { x, m, ws, outs }),
    }
}

unsafe fn linear_packed<F: Packing>(x: &[f32], m: usize, ws: &[&Tensor], outs: &mut [&mut [f32]]) -> Result<()> {
    // Rows hold whole super-blocks, so `k` is a multiple of 32 (of 256 for the K-quants,
    // whose `KC` slices are then whole super-blocks).
    let k = ws[0].row_len();
    let half = Half::of(ws[0].dtype());
    let acts = Acts::new(x, m, k);
    // Per weight, about four panels per thread, so a thread slowed by other work sheds
    // panels to the rest; a panel starts on a packed group.
    let threads = rayon::current_num_threads().max(1);
    let mut jobs = Vec::new();
    for (i, w) in ws.iter().enumerate() {
        let n = w.rows();
        let slivers = n.div_ceil(NR);
        let panels = (4 * threads * slivers.div_ceil(4 * threads * MAX_PANEL_SLIVERS)).min(slivers);
        let rows_per_panel = NR * slivers.div_ceil(panels);
        jobs.extend(
            (0..n.div_ceil(rows_per_panel)).map(|c| (i, c * rows_per_panel, ((c + 1) * rows_per_panel).min(n))),
        );
    }
    let group = packed::group_bytes::<F>(k);
    let packed: Vec<&[u8]> = ws.iter().map(|w| packed::packed(w)).collect();
    // Each job's packed groups.
    let srcs = jobs
        .iter()
        .map(|&(i, r0, r1)| {
            packed[i]
                .get(r0 / packed::GROUP * group..r1.div_ceil(packed::GROUP) * group)
                .ok_or_else(|| RuntimeError::Shape(format!("rows {r0}..{r1} of {:?}: short packed buffer", ws[i])))
        })
        .collect::<Result<Vec<&[u8]>>>()?;
    let dst: Vec<SharedMut> = outs.iter_mut().map(|o| SharedMut(o.as_mut_ptr())).collect();
    // Jobs are claimed one at a time (see `threads::for_each_claimed`).
    threads::for_each_claimed(jobs.len(), Sliver::default, |sliver, j| {
        let (i, r0, r1) = jobs[j];
        // SAFETY: the caller vouches for the CPU; this job writes columns r0..r1 of every row
        // of output i, which no other job touches.
        unsafe { panel::<F>(&acts, m, srcs[j], (group, half), r1 - r0, dst[i].ptr().add(r0), ws[i].rows(), sliver) };
    });
    Ok(())
}

/// One panel of `cols` weight rows from their packed groups (`src`, `group` bytes each, their
/// headers' 16-bit floats of type `half`) into `c` (row stride `ldc`), sliver by sliver: each `MR`-row tile over the whole of `k` straight
/// from the packed codes, or (more than `DIRECT_ROWS` rows) `KC` slices expanded once into `sl`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn panel<F: Packing>(
    acts: &Acts,
    m: usize,
    src: &[u8],
    (group, half): (usize, Half),
    cols: usize,
    c: *mut f32,
    ldc: usize,
    sl: &mut Sliver,
) {
    let k = acts.k;
    let direct = m <= DIRECT_ROWS;
    // Row chunks of at most `MC` rows, in whole tiles and about equal.
    let tiles = m.div_ceil(MR);
    let per = tiles.div_ceil(tiles.div_ceil(MC / MR));
    for t0 in (0..tiles).step_by(per) {
        for j0 in (0..cols).step_by(NR) {
            let nr = NR.min(cols - j0);
            let mask = if nr >= 32 { u32::MAX } else { (1u32 << nr) - 1 };
            let first = src.as_ptr().add(j0 / packed::GROUP * group);
            // A lone last group reads itself twice; the second half's lanes are never stored.
            let second = if nr > packed::GROUP { first.add(group) } else { first };
            let w =
                PackedWeights::<F> { groups: [first, second], next: 2 * group, half, kind: std::marker::PhantomData };
            let slice = if direct { k } else { KC };
            for pc in (0..k).step_by(slice) {
                let blocks = slice.min(k - pc) / B;
                if !direct {
                    sl.fill(&w, pc / B, blocks);
                }
                for blk in t0..(t0 + per).min(tiles) {
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
                        offsets: F::WITH_MIN,
                    };
                    if direct {
                        tile.with(w).run_rows(m - blk * MR);
                    } else {
                        tile.with(SliverWeights { pairs: sl.pairs.as_ptr(), ws: sl.ws.as_ptr(), wm: sl.wm.as_ptr() })
                            .run_rows(m - blk * MR);
                    }
                }
            }
        }
    }
}

impl Sliver {
    /// Expand `blocks` blocks of `w` from block `b0` on.
    #[inline(always)]
    unsafe fn fill<W: TileWeights>(&mut self, w: &W, b0: usize, blocks: usize) {
        for b in 0..blocks {
            for z in 0..2 {
                let (ws, wm) = w.scales(b0 + b, z);
                _mm512_storeu_ps(self.ws.as_mut_ptr().add(b * NR + 16 * z), ws);
                _mm512_storeu_ps(self.wm.as_mut_ptr().add(b * NR + 16 * z), wm);
                let block = w.block(b0 + b, z);
                for q in 0..QUADS {
                    for (s, pairs) in w.quad_pairs(block, q).into_iter().enumerate() {
                        let at = self.pairs.as_mut_ptr().add((b * STEPS + QUAD * q + s) * NR + 16 * z);
                        _mm512_storeu_si512(at as *mut __m512i, pairs);
                    }
                }
            }
        }
    }
}

/// Where a micro-tile reads its 32 weight columns (two halves `z` of 16): per block `b`, the
/// halves' `(ws, wm)` and, per step `p = 4q + s`, their pairs `(v[2p], v[2p + 1])`, a quad of
/// steps at a time.
trait TileWeights {
    /// What the steps of one block of one half need.
    type Block: Copy;
    /// What one load gives for a quad of steps.
    type Quad: Copy;
    unsafe fn scales(&self, b: usize, z: usize) -> (__m512, __m512);
    unsafe fn block(&self, b: usize, z: usize) -> Self::Block;
    unsafe fn quad(&self, block: Self::Block, q: usize) -> Self::Quad;
    unsafe fn pairs<const S: usize>(&self, block: Self::Block, quad: Self::Quad, q: usize) -> __m512i;

    /// The pairs of the four steps of quad `q`.
    #[inline(always)]
    unsafe fn quad_pairs(&self, block: Self::Block, q: usize) -> [__m512i; QUAD] {
        let quad = self.quad(block, q);
        [
            self.pairs::<0>(block, quad, q),
            self.pairs::<1>(block, quad, q),
            self.pairs::<2>(block, quad, q),
            self.pairs::<3>(block, quad, q),
        ]
    }
}

/// An expanded `Sliver`.
struct SliverWeights {
    pairs: *const i32,
    ws: *const f32,
    wm: *const f32,
}

impl TileWeights for SliverWeights {
    type Block = *const i32;
    type Quad = ();
    #[inline(always)]
    unsafe fn scales(&self, b: usize, z: usize) -> (__m512, __m512) {
        (_mm512_loadu_ps(self.ws.add(b * NR + 16 * z)), _mm512_loadu_ps(self.wm.add(b * NR + 16 * z)))
    }
    #[inline(always)]
    unsafe fn block(&self, b: usize, z: usize) -> *const i32 {
        self.pairs.add(b * STEPS * NR + 16 * z)
    }
    #[inline(always)]
    unsafe fn quad(&self, _: *const i32, _: usize) {}
    #[inline(always)]
    unsafe fn pairs<const S: usize>(&self, block: *const i32, _: (), q: usize) -> __m512i {
        _mm512_loadu_si512(block.add((QUAD * q + S) * NR) as *const __m512i)
    }
}

/// Two packed groups of 16 rows. Reading a block's scales also fetches the same block of the
/// next sliver (`next` bytes on) into L2, so the weights stream in ahead of their use.
struct PackedWeights<F> {
    groups: [*const u8; 2],
    next: usize,
    half: Half,
    kind: std::marker::PhantomData<F>,
}

impl<F> Clone for PackedWeights<F> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<F> Copy for PackedWeights<F> {}

impl<F: Packing> PackedWeights<F> {
    /// Packed super-block of block `b` in half `z`, and `b`'s index in it.
    #[inline(always)]
    unsafe fn super_block(&self, b: usize, z: usize) -> (*const u8, usize) {
        let per = F::SB / B;
        (self.groups[z].add(b / per * F::PACKED), b % per)
    }
}

impl<F: Packing> TileWeights for PackedWeights<F> {
    type Block = F::Block;
    type Quad = F::Quad;
    #[inline(always)]
    unsafe fn scales(&self, b: usize, z: usize) -> (__m512, __m512) {
        let (sb, s) = self.super_block(b, z);
        let share = F::PACKED / (F::SB / B);
        let ahead = sb.wrapping_add(self.next + s * share);
        for off in (0..share).step_by(64) {
            _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(off) as *const i8);
        }
        F::scales(sb, s, self.half)
    }
    #[inline(always)]
    unsafe fn block(&self, b: usize, z: usize) -> F::Block {
        let (sb, s) = self.super_block(b, z);
        F::block(sb, s)
    }
    #[inline(always)]
    unsafe fn quad(&self, block: F::Block, q: usize) -> F::Quad {
        F::quad(block, q)
    }
    #[inline(always)]
    unsafe fn pairs<const S: usize>(&self, block: F::Block, quad: F::Quad, q: usize) -> __m512i {
        F::pairs::<S>(block, quad, q)
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
            8 => self.run::<8>(),
            7 => self.run::<7>(),
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
            let a = self.a.add(b * STEPS * MR);
            let blocks = [self.w.block(b, 0), self.w.block(b, 1)];
            for q in 0..QUADS {
                let quads = [self.w.quad(blocks[0], q), self.w.quad(blocks[1], q)];
                self.step::<R, 0>(&mut dot, a, blocks, quads, q);
                self.step::<R, 1>(&mut dot, a, blocks, quads, q);
                self.step::<R, 2>(&mut dot, a, blocks, quads, q);
                self.step::<R, 3>(&mut dot, a, blocks, quads, q);
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

    /// Step `4q + S` of a block into the integer accumulators of `R` rows (codes at `a`).
    #[inline(always)]
    unsafe fn step<const R: usize, const S: usize>(
        &self,
        dot: &mut [[__m512i; 2]; R],
        a: *const i32,
        blocks: [W::Block; 2],
        quads: [W::Quad; 2],
        q: usize,
    ) {
        let (w0, w1) = (self.w.pairs::<S>(blocks[0], quads[0], q), self.w.pairs::<S>(blocks[1], quads[1], q));
        let p = QUAD * q + S;
        for (i, d) in dot.iter_mut().enumerate() {
            let x = _mm512_set1_epi32(*a.add(p * MR + i));
            d[0] = dpwssd(d[0], w0, x);
            d[1] = dpwssd(d[1], w1, x);
        }
    }
}

/// `acc + Σ` of the products of the 16-bit pairs of `w` and `x`, one `vpdpwssd` for certain:
/// LLVM's machine combiner otherwise splits the intrinsic into `vpmaddwd` + `vpaddd` where it
/// judges the accumulator chain critical, which halves the tile's throughput (prefill 1,150 →
/// 930 tok/s on SmolLM2 when it did).
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn dpwssd(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
    let mut acc = acc;
    std::arch::asm!("vpdpwssd {acc}, {w}, {x}", acc = inout(zmm_reg) acc, w = in(zmm_reg) w, x = in(zmm_reg) x,
        options(pure, nomem, nostack, preserves_flags));
    acc
}
