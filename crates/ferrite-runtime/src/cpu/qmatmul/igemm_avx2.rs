//! The integer GEMM at the levels below AVX-512 (AVX2, AVX-VNNI), for every number of
//! activation rows: `igemm`'s arithmetic with 256-bit registers.
//!
//! The numbers are `igemm`'s (see its module docs): 14-bit activation codes in blocks of 32
//! (its `Acts`), the weights' own integer codes from the same `packed` copy, an exact i32 sum
//! `Σ v·q` per block and, per output and block in order of `k`,
//! `acc = fma(f32(Σ v·q), ws * da, acc); acc = fma(wm, s, acc)`. Only the register width
//! differs: a register holds eight output columns, so a packed group of 16 weight rows is read
//! as two halves `h` (rows `8h..8h + 8`).
//!
//! A micro-tile is up to `RT` (4) activation rows by one group's 16 columns: eight integer
//! accumulators, the two halves' pairs of the current step and one broadcast activation pair
//! fit the 16 registers. Each thread takes panels of groups (about four per thread and
//! weight). Up to `STREAM_ROWS` rows (decode) a tile decodes its pairs straight from the packed
//! codes while fetching the next group into L2; with more (prompts), the activation rows go in
//! chunks whose codes (`ACT_CHUNK_BYTES`) stay in L2, each group is expanded once per chunk into
//! i32 pairs (`Expansion`, `k` × 32 bytes) and every tile of the chunk reads those with plain
//! loads — a 5- or 6-bit step costs several instructions to decode, more than its products.
//! A decode tile of one or two rows over Q6_K sums each sub-block's raw codes' products, takes
//! the codes' offset off once (with the activations' 16-value sums) and multiplies by the
//! sub-block's scale once (`SUB_SCALED_ROWS`), instead of offsetting and scaling the codes at
//! every step.
//!
//! Before this module the AVX2 levels dotted every weight row with every activation row from
//! the GGUF blocks (`legacy`, `kquants`, `mlx`): each row pair re-decoded the weight block and
//! reduced across lanes, 84 % of a SmolLM2 prefill.

use std::arch::x86_64::*;

use super::igemm::{Acts, MR};
use super::isa::{self, Simd};
use super::packed::{self, high_mask, high_word, FormatFn, Half, LegacyCodes, Mlx, Packing, K4K5, Q6K, QUAD, QUADS};
use crate::cpu::SharedMut;
use crate::error::{Result, RuntimeError};
use crate::tensor::Tensor;
use crate::threads;

/// Values per scale.
const B: usize = 32;
/// Code pairs per block.
const STEPS: usize = B / 2;
/// Output columns per register.
const LANES: usize = 8;
/// Activation rows per micro-tile (half of an `Acts` block of `MR`).
const RT: usize = 4;
/// Bytes of activation codes one chunk of rows may hold. On a 1 MiB-L2 EPYC (Qwen2.5-0.5B
/// pp512): 256 KiB 241 tok/s, 512 KiB 274, 1 MiB 270, all rows in one chunk 258 — fewer chunks
/// expand each group fewer times, until the codes no longer stay in L2.
const ACT_CHUNK_BYTES: usize = 512 << 10;
/// Most packed groups per panel (a panel is one work item of the pool).
const MAX_PANEL_GROUPS: usize = 8;
/// Up to this many activation rows, the weights stream from memory once per call (decode):
/// each tile fetches the next group's bytes into L2 as it reads its own.
const STREAM_ROWS: usize = 2 * MR;
/// Up to this many rows a tile of a format with sub-block scales (Q6_K) applies them once per
/// sub-block instead of once per step: one multiply per 16 values instead of eight, and the
/// scales out of the steps' registers; with more rows the per-step multiply is shared by more
/// products than the extra accumulators would cost.
const SUB_SCALED_ROWS: usize = 2;

/// A packed block format read a half group (eight rows) at a time.
pub(super) trait Halves: Packing {
    /// What the steps of one block of one half need.
    type Block8: Copy;
    /// `(ws, wm)` of block `s` of the packed super-block at `sb` for rows `8h..8h + 8`.
    unsafe fn scales8(sb: *const u8, s: usize, half: Half, h: usize) -> (__m256, __m256);
    unsafe fn block8(sb: *const u8, s: usize, h: usize) -> Self::Block8;
    /// Quad `q` of a block's codes (4- to 6-bit codes; unused for 8-bit ones).
    unsafe fn quad8(block: Self::Block8, q: usize, h: usize) -> __m256i;
    /// The pairs `(v[2p], v[2p + 1])` of the half's rows at step `p = 4q + S`.
    unsafe fn pairs8<const S: usize>(block: Self::Block8, quad: __m256i, q: usize, h: usize) -> __m256i;
    /// Whether each half of a block (16 values) has its own integer scale: `pairs8` is then
    /// `(unscaled_pairs8 - SUB_OFFSET) * sub_scale8`, and a tile of few rows may sum the raw
    /// pairs' products over a sub-block, take off `SUB_OFFSET` times the activations' sum over it
    /// (`Acts::sums16`) and multiply once (the same exact integers).
    const SUB_SCALES: bool = false;
    /// With `SUB_SCALES`, the offset of the codes.
    const SUB_OFFSET: i32 = 0;
    /// `pairs8`'s codes before their offset and sub-block scale.
    #[inline(always)]
    unsafe fn unscaled_pairs8<const S: usize>(block: Self::Block8, quad: __m256i, q: usize, h: usize) -> __m256i {
        Self::pairs8::<S>(block, quad, q, h)
    }
    /// Sub-block `sub`'s scale per lane (1 without `SUB_SCALES`).
    #[inline(always)]
    unsafe fn sub_scale8(_block: Self::Block8, _sub: usize) -> __m256i {
        _mm256_set1_epi32(1)
    }
}

/// Eight rows' f16s at `at` as f32.
#[inline(always)]
unsafe fn f16x8(at: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i))
}

/// Eight rows' 16-bit floats of type `half` at `at` as f32.
#[inline(always)]
unsafe fn half8(at: *const u8, half: Half) -> __m256 {
    match half {
        Half::F16 => f16x8(at),
        Half::Bf16 => {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(at as *const __m128i))))
        }
    }
}

/// Eight rows' u8s at `at` as f32.
#[inline(always)]
unsafe fn bytes8(at: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(at as *const __m128i)))
}

/// Half `h` of quad `q` of the 4-bit codes at `codes` (row j's u32 at bytes 4j..4j + 4).
#[inline(always)]
unsafe fn nibble_quad8(codes: *const u8, q: usize, h: usize) -> __m256i {
    _mm256_loadu_si256(codes.add(64 * q + 32 * h) as *const __m256i)
}

/// Step `S` of a quad's nibbles as pairs: lane j = lo | hi << 16.
#[inline(always)]
unsafe fn nibble_pairs8<const S: usize>(quad: __m256i) -> __m256i {
    let shifted = match S {
        0 => quad,
        1 => _mm256_srli_epi32::<4>(quad),
        2 => _mm256_srli_epi32::<8>(quad),
        _ => _mm256_srli_epi32::<12>(quad),
    };
    _mm256_and_si256(shifted, _mm256_set1_epi32(0x000F_000F))
}

/// `v` (step `p`'s pairs of nibbles, half `h` of the rows) with the codes' high bits set
/// from their word (`packed::high_word`).
#[inline(always)]
unsafe fn with_high8<const BITS: u32>(v: __m256i, codes: *const u8, p: usize, h: usize) -> __m256i {
    let (at, shift) = high_word(codes, BITS, p);
    let word = _mm256_loadu_si256(at.add(32 * h) as *const __m256i);
    let field = _mm256_and_si256(_mm256_srl_epi32(word, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(high_mask(BITS)));
    _mm256_or_si256(v, _mm256_slli_epi32::<4>(field))
}

impl<F: LegacyCodes> Halves for F {
    type Block8 = *const u8;

    #[inline(always)]
    unsafe fn scales8(sb: *const u8, _: usize, _: Half, h: usize) -> (__m256, __m256) {
        let wm = if Self::WITH_MIN { f16x8(sb.add(32 + 16 * h)) } else { _mm256_setzero_ps() };
        (f16x8(sb.add(16 * h)), wm)
    }

    #[inline(always)]
    unsafe fn block8(sb: *const u8, _: usize, _: usize) -> *const u8 {
        sb.add(Self::HEADER)
    }

    #[inline(always)]
    unsafe fn quad8(codes: *const u8, q: usize, h: usize) -> __m256i {
        if F::BITS == 8 {
            return _mm256_setzero_si256();
        }
        nibble_quad8(codes, q, h)
    }

    #[inline(always)]
    unsafe fn pairs8<const S: usize>(codes: *const u8, quad: __m256i, q: usize, h: usize) -> __m256i {
        let p = QUAD * q + S;
        if F::BITS == 8 {
            return _mm256_cvtepi8_epi16(_mm_loadu_si128(codes.add(32 * p + 16 * h) as *const __m128i));
        }
        let mut v = nibble_pairs8::<S>(quad);
        if F::BITS == 5 {
            v = with_high8::<5>(v, codes, p, h);
        }
        if F::OFFSET != 0 {
            v = _mm256_sub_epi16(v, _mm256_set1_epi16(F::OFFSET));
        }
        v
    }
}

impl<const Q5: bool> Halves for K4K5<Q5> {
    type Block8 = *const u8;

    #[inline(always)]
    unsafe fn scales8(sb: *const u8, s: usize, _: Half, h: usize) -> (__m256, __m256) {
        let neg_dmin = _mm256_sub_ps(_mm256_setzero_ps(), f16x8(sb.add(32 + 16 * h)));
        let (sc, mn) = (bytes8(sb.add(64 + 16 * s + 8 * h)), bytes8(sb.add(192 + 16 * s + 8 * h)));
        (_mm256_mul_ps(f16x8(sb.add(16 * h)), sc), _mm256_mul_ps(neg_dmin, mn))
    }

    #[inline(always)]
    unsafe fn block8(sb: *const u8, s: usize, _: usize) -> *const u8 {
        sb.add(Self::HEADER + s * Self::BLOCK)
    }

    #[inline(always)]
    unsafe fn quad8(codes: *const u8, q: usize, h: usize) -> __m256i {
        nibble_quad8(codes, q, h)
    }

    #[inline(always)]
    unsafe fn pairs8<const S: usize>(codes: *const u8, quad: __m256i, q: usize, h: usize) -> __m256i {
        let v = nibble_pairs8::<S>(quad);
        if Q5 {
            with_high8::<5>(v, codes, QUAD * q + S, h)
        } else {
            v
        }
    }
}

impl Halves for Q6K {
    /// The codes, and the half's scales (as i16 pairs) of steps 0..8 and 8..16.
    type Block8 = (*const u8, __m256i, __m256i);

    #[inline(always)]
    unsafe fn scales8(sb: *const u8, _: usize, _: Half, h: usize) -> (__m256, __m256) {
        (f16x8(sb.add(16 * h)), _mm256_setzero_ps())
    }

    #[inline(always)]
    unsafe fn block8(sb: *const u8, s: usize, h: usize) -> Self::Block8 {
        // Lane j = sc | sc << 16 for row 8h + j's scale of group g.
        let scale = |g: usize| {
            let x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(sb.add(32 + 16 * g + 8 * h) as *const __m128i));
            _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32::<16>(x))
        };
        (sb.add(Self::HEADER + s * Self::BLOCK), scale(2 * s), scale(2 * s + 1))
    }

    #[inline(always)]
    unsafe fn quad8((codes, _, _): Self::Block8, q: usize, h: usize) -> __m256i {
        nibble_quad8(codes, q, h)
    }

    #[inline(always)]
    unsafe fn pairs8<const S: usize>(block: Self::Block8, quad: __m256i, q: usize, h: usize) -> __m256i {
        let (_, lo, hi) = block;
        let v =
            _mm256_sub_epi16(Self::unscaled_pairs8::<S>(block, quad, q, h), _mm256_set1_epi16(Self::SUB_OFFSET as i16));
        _mm256_mullo_epi16(v, if q < QUADS / 2 { lo } else { hi })
    }

    const SUB_SCALES: bool = true;
    const SUB_OFFSET: i32 = 32;

    #[inline(always)]
    unsafe fn unscaled_pairs8<const S: usize>(
        (codes, _, _): Self::Block8,
        quad: __m256i,
        q: usize,
        h: usize,
    ) -> __m256i {
        with_high8::<6>(nibble_pairs8::<S>(quad), codes, QUAD * q + S, h)
    }

    #[inline(always)]
    unsafe fn sub_scale8((_, lo, hi): Self::Block8, sub: usize) -> __m256i {
        _mm256_srai_epi32::<16>(if sub == 0 { lo } else { hi })
    }
}

impl<const BITS: u32, const G: usize> Halves for Mlx<BITS, G> {
    type Block8 = *const u8;

    #[inline(always)]
    unsafe fn scales8(sb: *const u8, _: usize, half: Half, h: usize) -> (__m256, __m256) {
        (half8(sb.add(16 * h), half), half8(sb.add(32 + 16 * h), half))
    }

    #[inline(always)]
    unsafe fn block8(sb: *const u8, s: usize, _: usize) -> *const u8 {
        sb.add(Self::HEADER + s * Self::BLOCK)
    }

    #[inline(always)]
    unsafe fn quad8(codes: *const u8, q: usize, h: usize) -> __m256i {
        if BITS == 8 {
            return _mm256_setzero_si256();
        }
        nibble_quad8(codes, q, h)
    }

    #[inline(always)]
    unsafe fn pairs8<const S: usize>(codes: *const u8, quad: __m256i, q: usize, h: usize) -> __m256i {
        if BITS == 8 {
            let p = QUAD * q + S;
            return _mm256_cvtepu8_epi16(_mm_loadu_si128(codes.add(32 * p + 16 * h) as *const __m128i));
        }
        nibble_pairs8::<S>(quad)
    }
}

/// `outs[i] = x · ws[i]ᵀ` for weights of one `dtype` that `packed::packs` accepts and one row
/// length, any `m ≥ 1`, at `level` (`Avx2` or `AvxVnni`): the activations are quantized once
/// and the panels of every weight share one parallel loop. Each output is what a call with its
/// weight alone gives, bit for bit, for every `m`.
///
/// # Safety
/// The CPU must have `level` (AVX2, FMA, F16C; and AVX-VNNI for `AvxVnni`); `x` is `[m, k]`
/// and each `outs[i]` is `[m, ws[i].rows()]`, every weight `[_, k]` of that one dtype.
pub(super) unsafe fn linear_many(
    x: &[f32],
    m: usize,
    ws: &[&Tensor],
    outs: &mut [&mut [f32]],
    level: isa::Level,
) -> Result<()> {
    struct Gemm<'a, 'b> {
        x: &'a [f32],
        m: usize,
        ws: &'a [&'a Tensor],
        outs: &'a mut [&'b mut [f32]],
        vnni: bool,
    }
    impl FormatFn for Gemm<'_, '_> {
        type Out = Result<()>;
        /// # Safety
        /// `linear_many`'s.
        unsafe fn call<F: Packing + Halves>(self) -> Result<()> {
            linear_packed::<F>(self.x, self.m, self.ws, self.outs, self.vnni)
        }
    }
    let vnni = level == isa::Level::AvxVnni;
    match ws.first() {
        None => Ok(()),
        Some(w) => packed::with_format(w.dtype(), Gemm { x, m, ws, outs, vnni }),
    }
}

/// One job: groups `g0..g1` of weight `i`.
#[derive(Clone, Copy)]
struct Job {
    i: usize,
    g0: usize,
    g1: usize,
}

unsafe fn linear_packed<F: Halves>(
    x: &[f32],
    m: usize,
    ws: &[&Tensor],
    outs: &mut [&mut [f32]],
    vnni: bool,
) -> Result<()> {
    let k = ws[0].row_len();
    let half = Half::of(ws[0].dtype());
    let acts = Acts::new(x, m, k);
    let threads = rayon::current_num_threads().max(1);
    let mut jobs = Vec::new();
    for (i, w) in ws.iter().enumerate() {
        let groups = w.rows().div_ceil(packed::GROUP);
        let panels = (4 * threads * groups.div_ceil(4 * threads * MAX_PANEL_GROUPS)).min(groups);
        let per = groups.div_ceil(panels);
        jobs.extend((0..groups.div_ceil(per)).map(|c| Job { i, g0: c * per, g1: ((c + 1) * per).min(groups) }));
    }
    let group = packed::group_bytes::<F>(k);
    let packed: Vec<&[u8]> = ws.iter().map(|w| packed::packed(w)).collect();
    for (w, p) in ws.iter().zip(&packed) {
        if p.len() < w.rows().div_ceil(packed::GROUP) * group {
            return Err(RuntimeError::Shape(format!("{w:?}: short packed buffer")));
        }
    }
    let dst: Vec<SharedMut> = outs.iter_mut().map(|o| SharedMut(o.as_mut_ptr())).collect();
    threads::for_each_claimed(jobs.len(), Expansion::default, |x, j| {
        let Job { i, g0, g1 } = jobs[j];
        let n = ws[i].rows();
        let panel = Panel {
            acts: &acts,
            m,
            src: packed[i].as_ptr().add(g0 * group),
            group,
            half,
            cols: (g1 * packed::GROUP).min(n) - g0 * packed::GROUP,
            c: dst[i].ptr().add(g0 * packed::GROUP),
            ldc: n,
        };
        // SAFETY: the caller vouches for the CPU; this job writes columns of groups g0..g1
        // of every row of output i, which no other job touches; the packed buffer holds
        // every group (checked above).
        if vnni {
            panel_avxvnni::<F>(&panel, x)
        } else {
            panel_avx2::<F>(&panel, x)
        }
    });
    Ok(())
}

/// One job's panel: `cols` weight rows from their packed groups at `src` (`group` bytes each)
/// into columns of `c` (row stride `ldc`).
struct Panel<'a> {
    acts: &'a Acts,
    m: usize,
    src: *const u8,
    group: usize,
    half: Half,
    cols: usize,
    c: *mut f32,
    ldc: usize,
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel_avx2<F: Halves>(p: &Panel<'_>, x: &mut Expansion) {
    run_panel::<F, isa::Avx2>(p, x)
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn panel_avxvnni<F: Halves>(p: &Panel<'_>, x: &mut Expansion) {
    run_panel::<F, isa::AvxVnni>(p, x)
}

/// The panel chunk by chunk of activation rows, group by group, tile by tile. Up to
/// `STREAM_ROWS` rows the tiles decode the packed codes themselves; with more, each group is
/// expanded once per chunk into `x` and every tile of the chunk reads that.
#[inline(always)]
unsafe fn run_panel<F: Halves, S: Simd>(p: &Panel<'_>, x: &mut Expansion) {
    let k = p.acts.k;
    let tiles = p.m.div_ceil(MR);
    // Whole `Acts` blocks whose codes (4 bytes a pair, 2 a value) fit `ACT_CHUNK_BYTES`.
    let chunk = (ACT_CHUNK_BYTES / (2 * k * MR)).max(1);
    let stream = p.m <= STREAM_ROWS;
    for t0 in (0..tiles).step_by(chunk) {
        for g in 0..p.cols.div_ceil(packed::GROUP) {
            let packed = Packed::<F> {
                group: p.src.add(g * p.group),
                half: p.half,
                next: if stream { p.group } else { 0 },
                kind: std::marker::PhantomData,
            };
            let at = |blk: usize, r0: usize| {
                let row = blk * MR + r0;
                let tile = Tile {
                    blocks: k / B,
                    a: p.acts.pairs.as_ptr().add(blk * k / 2 * MR + r0),
                    da: p.acts.d.as_ptr().add(blk * k / B * MR + r0),
                    sa: p.acts.s.as_ptr().add(blk * k / B * MR + r0),
                    sums16: p.acts.sums16.as_ptr().add(blk * k / 16 * MR + r0),
                    c: p.c.add(row * p.ldc + g * packed::GROUP),
                    ldc: p.ldc,
                    cols: (p.cols - g * packed::GROUP).min(packed::GROUP),
                };
                (tile, (p.m - row).min(RT))
            };
            let rows = || {
                (t0..(t0 + chunk).min(tiles))
                    .flat_map(|blk| (0..MR).step_by(RT).map(move |r0| (blk, r0)))
                    .filter(|&(blk, r0)| blk * MR + r0 < p.m)
            };
            if stream {
                for (blk, r0) in rows() {
                    let (tile, r) = at(blk, r0);
                    tile.run_rows::<_, S>(&packed, r);
                }
            } else {
                let expanded = x.fill(&packed, k / B);
                for (blk, r0) in rows() {
                    let (tile, r) = at(blk, r0);
                    tile.run_rows::<_, S>(&expanded, r);
                }
            }
        }
    }
}

/// Where a micro-tile reads one group's 16 weight columns (halves `h` of eight): per block
/// `b` the halves' `(ws, wm)` and, per step `p = 4q + S`, their pairs `(v[2p], v[2p + 1])`.
trait Weights8 {
    /// Whether blocks have an offset term `wm`.
    const WITH_MIN: bool;
    /// What the steps of one block of one half need.
    type Block: Copy;
    unsafe fn scales(&self, b: usize, h: usize) -> (__m256, __m256);
    unsafe fn block(&self, b: usize, h: usize) -> Self::Block;
    /// Quad `q` of a block (what one load gives for four steps).
    unsafe fn quad(&self, block: Self::Block, q: usize, h: usize) -> __m256i;
    unsafe fn pairs<const S: usize>(&self, block: Self::Block, quad: __m256i, q: usize, h: usize) -> __m256i;
    /// `Halves::SUB_SCALES` and `SUB_OFFSET` of what is read: `unscaled_pairs`, `SUB_OFFSET`
    /// and `sub_scale` then split `pairs` (otherwise they are `pairs`, 0 and 1).
    const SUB_SCALES: bool = false;
    const SUB_OFFSET: i32 = 0;
    #[inline(always)]
    unsafe fn unscaled_pairs<const S: usize>(&self, block: Self::Block, quad: __m256i, q: usize, h: usize) -> __m256i {
        self.pairs::<S>(block, quad, q, h)
    }
    #[inline(always)]
    unsafe fn sub_scale(&self, _block: Self::Block, _sub: usize) -> __m256i {
        _mm256_set1_epi32(1)
    }
}

/// One packed group, decoded as the tile goes. Reading a block of half 0 also fetches the
/// same block of the group `next` bytes on into L2 (when `next` is not 0).
struct Packed<F> {
    group: *const u8,
    half: Half,
    next: usize,
    kind: std::marker::PhantomData<F>,
}

impl<F: Halves> Packed<F> {
    /// Packed super-block of block `b`, and `b`'s index in it.
    #[inline(always)]
    unsafe fn super_block(&self, b: usize) -> (*const u8, usize) {
        let per = F::SB / B;
        (self.group.add(b / per * F::PACKED), b % per)
    }
}

impl<F: Halves> Weights8 for Packed<F> {
    const WITH_MIN: bool = F::WITH_MIN;
    type Block = F::Block8;

    #[inline(always)]
    unsafe fn scales(&self, b: usize, h: usize) -> (__m256, __m256) {
        let (sb, s) = self.super_block(b);
        F::scales8(sb, s, self.half, h)
    }

    #[inline(always)]
    unsafe fn block(&self, b: usize, h: usize) -> F::Block8 {
        let (sb, s) = self.super_block(b);
        if h == 0 && self.next != 0 {
            let share = F::PACKED / (F::SB / B);
            let ahead = sb.wrapping_add(self.next + s * share);
            for off in (0..share).step_by(64) {
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(off) as *const i8);
            }
        }
        F::block8(sb, s, h)
    }

    #[inline(always)]
    unsafe fn quad(&self, block: F::Block8, q: usize, h: usize) -> __m256i {
        F::quad8(block, q, h)
    }

    #[inline(always)]
    unsafe fn pairs<const S: usize>(&self, block: F::Block8, quad: __m256i, q: usize, h: usize) -> __m256i {
        F::pairs8::<S>(block, quad, q, h)
    }

    const SUB_SCALES: bool = F::SUB_SCALES;
    const SUB_OFFSET: i32 = F::SUB_OFFSET;

    #[inline(always)]
    unsafe fn unscaled_pairs<const S: usize>(&self, block: F::Block8, quad: __m256i, q: usize, h: usize) -> __m256i {
        F::unscaled_pairs8::<S>(block, quad, q, h)
    }

    #[inline(always)]
    unsafe fn sub_scale(&self, block: F::Block8, sub: usize) -> __m256i {
        F::sub_scale8(block, sub)
    }
}

/// One thread's buffers for an expanded group: `pairs` is `[k / 2][16]` code pairs, `ws` and
/// `wm` are `[k / B][16]`.
#[derive(Default)]
struct Expansion {
    pairs: Vec<i32>,
    ws: Vec<f32>,
    wm: Vec<f32>,
}

impl Expansion {
    /// Expand the first `blocks` blocks of `w`.
    #[inline(always)]
    unsafe fn fill<W: Weights8>(&mut self, w: &W, blocks: usize) -> Expanded<W> {
        const G: usize = packed::GROUP;
        self.pairs.resize(blocks * STEPS * G, 0);
        self.ws.resize(blocks * G, 0.0);
        self.wm.resize(blocks * G, 0.0);
        for b in 0..blocks {
            for h in 0..2 {
                let (ws, wm) = w.scales(b, h);
                _mm256_storeu_ps(self.ws.as_mut_ptr().add(b * G + LANES * h), ws);
                _mm256_storeu_ps(self.wm.as_mut_ptr().add(b * G + LANES * h), wm);
                let block = w.block(b, h);
                for q in 0..QUADS {
                    let quad = w.quad(block, q, h);
                    let steps = [
                        w.pairs::<0>(block, quad, q, h),
                        w.pairs::<1>(block, quad, q, h),
                        w.pairs::<2>(block, quad, q, h),
                        w.pairs::<3>(block, quad, q, h),
                    ];
                    for (s, pairs) in steps.into_iter().enumerate() {
                        let at = self.pairs.as_mut_ptr().add((b * STEPS + QUAD * q + s) * G + LANES * h);
                        _mm256_storeu_si256(at as *mut __m256i, pairs);
                    }
                }
            }
        }
        Expanded {
            pairs: self.pairs.as_ptr(),
            ws: self.ws.as_ptr(),
            wm: self.wm.as_ptr(),
            kind: std::marker::PhantomData,
        }
    }
}

/// An expanded group (`Expansion::fill`), read with plain loads (its pairs are scaled).
struct Expanded<W> {
    pairs: *const i32,
    ws: *const f32,
    wm: *const f32,
    kind: std::marker::PhantomData<W>,
}

impl<W: Weights8> Weights8 for Expanded<W> {
    const WITH_MIN: bool = W::WITH_MIN;
    type Block = *const i32;

    #[inline(always)]
    unsafe fn scales(&self, b: usize, h: usize) -> (__m256, __m256) {
        let at = b * packed::GROUP + LANES * h;
        (_mm256_loadu_ps(self.ws.add(at)), _mm256_loadu_ps(self.wm.add(at)))
    }

    #[inline(always)]
    unsafe fn block(&self, b: usize, h: usize) -> *const i32 {
        self.pairs.add(b * STEPS * packed::GROUP + LANES * h)
    }

    #[inline(always)]
    unsafe fn quad(&self, _: *const i32, _: usize, _: usize) -> __m256i {
        _mm256_setzero_si256()
    }

    #[inline(always)]
    unsafe fn pairs<const S: usize>(&self, block: *const i32, _: __m256i, q: usize, _: usize) -> __m256i {
        _mm256_loadu_si256(block.add((QUAD * q + S) * packed::GROUP) as *const __m256i)
    }
}

/// One micro-tile: up to `RT` activation rows (codes at `a`, `MR` rows apart per pair) times
/// the 16 columns of one group over all of `k`, stored to the first `cols` columns at `c`.
struct Tile {
    blocks: usize,
    a: *const i32,
    da: *const f32,
    sa: *const f32,
    sums16: *const i32,
    c: *mut f32,
    ldc: usize,
    cols: usize,
}

impl Tile {
    /// `run` for the first `rows` (1..=`RT`) activation rows.
    #[inline(always)]
    unsafe fn run_rows<W: Weights8, S: Simd>(&self, w: &W, rows: usize) {
        match rows {
            4 => self.run::<W, S, 4>(w),
            3 => self.run::<W, S, 3>(w),
            2 => self.run::<W, S, 2>(w),
            _ => self.run::<W, S, 1>(w),
        }
    }

    #[inline(always)]
    unsafe fn run<W: Weights8, S: Simd, const R: usize>(&self, w: &W) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for b in 0..self.blocks {
            let blocks = [w.block(b, 0), w.block(b, 1)];
            let a = self.a.add(b * STEPS * MR);
            let mut dot = [[_mm256_setzero_si256(); 2]; R];
            if W::SUB_SCALES && R <= SUB_SCALED_ROWS {
                // The sub-blocks one by one in the source: their steps' shifts are constants.
                self.sub_block::<W, S, R>(w, &mut dot, blocks, b, 0);
                self.sub_block::<W, S, R>(w, &mut dot, blocks, b, 1);
            } else {
                for q in 0..QUADS {
                    quad_steps::<W, S, R, false>(w, &mut dot, a, blocks, q);
                }
            }
            let (s0, s1) = (w.scales(b, 0), w.scales(b, 1));
            let (ws, wm) = ([s0.0, s1.0], [s0.1, s1.1]);
            for (i, (acc, dot)) in acc.iter_mut().zip(&dot).enumerate() {
                let da = _mm256_set1_ps(*self.da.add(b * MR + i));
                let sa = _mm256_set1_ps(*self.sa.add(b * MR + i));
                for z in 0..2 {
                    acc[z] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[z]), _mm256_mul_ps(ws[z], da), acc[z]);
                    if W::WITH_MIN {
                        acc[z] = _mm256_fmadd_ps(wm[z], sa, acc[z]);
                    }
                }
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            let row = self.c.add(i * self.ldc);
            if self.cols == packed::GROUP {
                _mm256_storeu_ps(row, acc[0]);
                _mm256_storeu_ps(row.add(LANES), acc[1]);
                continue;
            }
            let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            for (z, acc) in acc.iter().enumerate() {
                let live = _mm256_cmpgt_epi32(_mm256_set1_epi32((self.cols as i32) - (LANES * z) as i32), lane);
                _mm256_maskstore_ps(row.wrapping_add(LANES * z), live, *acc);
            }
        }
    }

    /// Sub-block `sub` (16 values) of block `b` into `dot`: the raw codes' products summed, the
    /// offset times the activations' sum taken off, then one multiply by the sub-block's scales.
    #[inline(always)]
    unsafe fn sub_block<W: Weights8, S: Simd, const R: usize>(
        &self,
        w: &W,
        dot: &mut [[__m256i; 2]; R],
        blocks: [W::Block; 2],
        b: usize,
        sub: usize,
    ) {
        let a = self.a.add(b * STEPS * MR);
        let mut raw = [[_mm256_setzero_si256(); 2]; R];
        quad_steps::<W, S, R, true>(w, &mut raw, a, blocks, 2 * sub);
        quad_steps::<W, S, R, true>(w, &mut raw, a, blocks, 2 * sub + 1);
        let scale = [w.sub_scale(blocks[0], sub), w.sub_scale(blocks[1], sub)];
        for (i, (dot, raw)) in dot.iter_mut().zip(&raw).enumerate() {
            let offset = _mm256_set1_epi32(W::SUB_OFFSET * *self.sums16.add((2 * b + sub) * MR + i));
            for z in 0..2 {
                dot[z] = _mm256_add_epi32(dot[z], _mm256_mullo_epi32(_mm256_sub_epi32(raw[z], offset), scale[z]));
            }
        }
    }
}

/// The four steps of quad `q` of a block into the integer accumulators of `R` rows (codes at
/// `a`), with the weights' pairs scaled or, `UNSCALED`, before their offset and sub-block scale.
#[inline(always)]
unsafe fn quad_steps<W: Weights8, S: Simd, const R: usize, const UNSCALED: bool>(
    w: &W,
    dot: &mut [[__m256i; 2]; R],
    a: *const i32,
    blocks: [W::Block; 2],
    q: usize,
) {
    let quads = [w.quad(blocks[0], q, 0), w.quad(blocks[1], q, 1)];
    step::<W, S, R, 0, UNSCALED>(w, dot, a, blocks, quads, q);
    step::<W, S, R, 1, UNSCALED>(w, dot, a, blocks, quads, q);
    step::<W, S, R, 2, UNSCALED>(w, dot, a, blocks, quads, q);
    step::<W, S, R, 3, UNSCALED>(w, dot, a, blocks, quads, q);
}

/// Step `4q + ST` of a block into the integer accumulators of `R` rows (codes at `a`).
#[inline(always)]
unsafe fn step<W: Weights8, S: Simd, const R: usize, const ST: usize, const UNSCALED: bool>(
    w: &W,
    dot: &mut [[__m256i; 2]; R],
    a: *const i32,
    blocks: [W::Block; 2],
    quads: [__m256i; 2],
    q: usize,
) {
    let (w0, w1) = if UNSCALED {
        (w.unscaled_pairs::<ST>(blocks[0], quads[0], q, 0), w.unscaled_pairs::<ST>(blocks[1], quads[1], q, 1))
    } else {
        (w.pairs::<ST>(blocks[0], quads[0], q, 0), w.pairs::<ST>(blocks[1], quads[1], q, 1))
    };
    let p = QUAD * q + ST;
    for (i, d) in dot.iter_mut().enumerate() {
        let x = _mm256_set1_epi32(*a.add(p * MR + i));
        d[0] = S::dot_i16(d[0], w0, x);
        d[1] = S::dot_i16(d[1], w1, x);
    }
}
