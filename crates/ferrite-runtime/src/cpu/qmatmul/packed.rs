//! Interleaved weights for the integer GEMMs (`igemm`, `igemm_avx2`): every block format it multiplies (Q4_0, Q4_1, Q5_0,
//! Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, and MLX's affine 4- and 8-bit groups with 16-bit scales)
//! re-laid out once, so that the integer GEMM reads the codes of 16 output columns already in
//! its register order, for every number of activation rows.
//!
//! `igemm`'s micro-kernel keeps the output columns in the lanes of a register and multiplies
//! one broadcast pair of activation codes by the pairs `(v[2p], v[2p + 1])` of 16 weight rows
//! (`vpdpwssd`). Read from the GGUF layout, every weight row would have to be decoded and
//! transposed for that; here one load and a few instructions give the register.
//!
//! Rows are packed in groups of 16, super-block by super-block (32 values for the legacy
//! formats, 256 for the K-quants, the group for MLX). A packed super-block holds the 16 rows'
//! headers side by side, then its 32-value blocks, each 16 steps `p` holding codes `2p` and
//! `2p + 1` of the 16 rows:
//!
//! ```text
//! legacy  d[16] f16, m[16] f16 (affine formats only)
//! MLX     scale[16], bias[16] in the checkpoint's bf16 or f16 (`Half`), for every block
//! Q4_K/5_K d[16] f16, dmin[16] f16, sc[8][16] u8, mn[8][16] u8   (6-bit scales unpacked)
//! Q6_K    d[16] f16, sc[16][16] i8                                (one scale per 16 values)
//! block   4- to 6-bit: 4 quads of 64 bytes, then the high bits' words
//!           quad q: row j's u32 (bytes 4j..4j + 4) holds in nibble s the low 4 bits of code
//!           2p and in nibble 4 + s those of code 2p + 1, for step p = 4q + s
//!           high words (5-bit: one, 6-bit: two, 64 bytes each): row j's u32 at 4j holds,
//!           for the h = bits − 4 high bits of a code and the 16 / h steps p = w·16/h + s
//!           of word w, code 2p's at bit h·s and code 2p + 1's at bit 16 + h·s
//!         8-bit: per step two bytes per row (signed; MLX's unsigned)   32 bytes a step
//! ```
//!
//! — the GGUF size, 2–3 % more for Q4_K/Q5_K. A quad gives the kernel four steps from one
//! 64-byte load, each one shift and one mask away (`(u32 >> 4s) & 0x000F000F` is the pair of
//! step `4q + s`); a step's high bits are a shift, a mask and a shift more
//! (`((w >> h·s) & (2^h − 1)·0x00010001) << 4`). The codes are the blocks' own, so the
//! arithmetic is the GGUF one; rows past the weight's end are zero.

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::igemm_avx2::Halves;
use super::legacy::{Legacy, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use crate::dtype::{DType, MlxScale};
use crate::quant::mlx::code;
use crate::quant::{k4_k5_codes, q6_k_codes, scale_min_k4};
use crate::tensor::Tensor;

/// Weight rows per group (lanes of one register).
pub(super) const GROUP: usize = 16;
/// Values per block (one scale).
const B: usize = 32;
/// Steps (code pairs) per block.
const STEPS: usize = B / 2;
/// Steps per quad (one 64-byte load of 4-bit codes).
pub(super) const QUAD: usize = 4;
/// Quads per block.
pub(super) const QUADS: usize = STEPS / QUAD;

/// How the 16-bit floats of a packed header widen: f16 (the GGUF formats, MLX with f16
/// scales) or bf16 (MLX with bf16 scales). The bits are copied as stored; the kernel widens
/// them, exactly either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Half {
    F16,
    Bf16,
}

impl Half {
    /// The header type of `dtype`'s packed copy.
    pub(super) fn of(dtype: DType) -> Half {
        match dtype {
            DType::Mlx(f) if f.scale() == MlxScale::Bf16 => Half::Bf16,
            _ => Half::F16,
        }
    }
}

/// A block format's packed encoding.
pub(super) trait Packing {
    /// Values per super-block and GGUF bytes of one.
    const SB: usize;
    const GGUF_BYTES: usize;
    /// Whether blocks have an offset term `wm` (`value = ws * v + wm`).
    const WITH_MIN: bool;
    /// Bytes of the headers of one packed super-block.
    const HEADER: usize;
    /// Bytes of one 32-value block of 16 rows.
    const BLOCK: usize;
    /// Bytes of one packed super-block of 16 rows.
    const PACKED: usize = Self::HEADER + Self::SB / B * Self::BLOCK;
    /// What the steps of one block need (its codes, and Q6_K's scales).
    type Block: Copy;
    /// What one load gives for the four steps of a quad.
    type Quad: Copy;

    /// Write GGUF super-block `src` of row `j` into packed super-block `dst`.
    fn pack(src: &[u8], j: usize, dst: &mut [u8]);
    /// `(ws, wm)` of block `s` of the packed super-block at `sb`, for the 16 rows, with the
    /// header's 16-bit floats of type `half`.
    unsafe fn scales(sb: *const u8, s: usize, half: Half) -> (__m512, __m512);
    unsafe fn block(sb: *const u8, s: usize) -> Self::Block;
    /// Quad `q` of a block.
    unsafe fn quad(block: Self::Block, q: usize) -> Self::Quad;
    /// The pairs `(v[2p], v[2p + 1])` of the 16 rows at step `p = 4q + S` of a block.
    unsafe fn pairs<const S: usize>(block: Self::Block, quad: Self::Quad, q: usize) -> __m512i;
}

/// Bytes of one block of `bits`-wide codes (the layout in the module docs).
const fn block_bytes(bits: u32) -> usize {
    if bits == 8 {
        STEPS * 32
    } else {
        STEPS * 16 + 64 * high_bits(bits) as usize
    }
}

/// High bits a code has beyond its nibble (0 for 4- and 8-bit codes, which have none in words).
const fn high_bits(bits: u32) -> u32 {
    match bits {
        5 | 6 => bits - 4,
        _ => 0,
    }
}

/// Steps one high-bit word holds.
const fn steps_per_word(bits: u32) -> usize {
    16 / high_bits(bits) as usize
}

/// Place the codes of row `j` (whole 32-value blocks of `bits` wide codes) in `blocks`.
fn put_codes(codes: &[u8], j: usize, bits: u32, blocks: &mut [u8]) {
    for (codes, block) in codes.chunks_exact(B).zip(blocks.chunks_exact_mut(block_bytes(bits))) {
        put_block(codes, j, bits, block);
    }
}

/// Place the 32 codes of row `j` in one `block`.
fn put_block(codes: &[u8], j: usize, bits: u32, block: &mut [u8]) {
    if bits == 8 {
        for (step, pair) in block.chunks_exact_mut(32).zip(codes.chunks_exact(2)) {
            step[2 * j..2 * j + 2].copy_from_slice(pair);
        }
        return;
    }
    let (nibbles, high) = block.split_at_mut(STEPS * 16);
    for (q, quad) in codes.chunks_exact(2 * QUAD).enumerate() {
        let lane = quad.chunks_exact(2).enumerate().fold(0u32, |lane, (s, pair)| {
            lane | u32::from(pair[0] & 15) << (4 * s) | u32::from(pair[1] & 15) << (16 + 4 * s)
        });
        nibbles[64 * q + 4 * j..64 * q + 4 * j + 4].copy_from_slice(&lane.to_le_bytes());
    }
    if bits == 4 {
        return;
    }
    // Word w of row j: code 2p's high bits at h·s, code 2p + 1's at 16 + h·s (p = w·16/h + s).
    let h = high_bits(bits);
    let mut words = [0u32; 2];
    for (p, pair) in codes.chunks_exact(2).enumerate() {
        let (w, s) = (p / steps_per_word(bits), (p % steps_per_word(bits)) as u32);
        words[w] |= u32::from(pair[0] >> 4) << (h * s) | u32::from(pair[1] >> 4) << (16 + h * s);
    }
    for (w, word) in words.iter().take(h as usize).enumerate() {
        high[64 * w + 4 * j..64 * w + 4 * j + 4].copy_from_slice(&word.to_le_bytes());
    }
}

/// 16 rows' f16s at `at` as f32.
#[inline(always)]
unsafe fn f16x16(at: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(at as *const __m256i))
}

/// 16 rows' 16-bit floats of type `half` at `at` as f32 (a bf16 is the top half of its f32).
#[inline(always)]
unsafe fn half16(at: *const u8, half: Half) -> __m512 {
    match half {
        Half::F16 => f16x16(at),
        Half::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
            at as *const __m256i,
        )))),
    }
}

/// Quad `q` of the 4-bit codes at `codes`.
#[inline(always)]
unsafe fn nibble_quad(codes: *const u8, q: usize) -> __m512i {
    _mm512_loadu_si512(codes.add(64 * q) as *const __m512i)
}

/// Step `S` of a quad's nibbles as pairs: lane j = lo | hi << 16.
#[inline(always)]
unsafe fn nibble_pairs<const S: usize>(quad: __m512i) -> __m512i {
    let shifted = match S {
        0 => quad,
        1 => _mm512_srli_epi32::<4>(quad),
        2 => _mm512_srli_epi32::<8>(quad),
        _ => _mm512_srli_epi32::<12>(quad),
    };
    _mm512_and_si512(shifted, _mm512_set1_epi32(0x000F_000F))
}

/// The high-bit word (16 rows' u32) that holds step `p` of the `bits`-wide codes at `codes`,
/// and the shift that brings the step's fields down to bits 0 and 16.
#[inline(always)]
pub(super) unsafe fn high_word(codes: *const u8, bits: u32, p: usize) -> (*const u8, i32) {
    let at = codes.add(STEPS * 16 + 64 * (p / steps_per_word(bits)));
    (at, (high_bits(bits) * (p % steps_per_word(bits)) as u32) as i32)
}

/// Each lane's field mask of the high bits at bits 0 and 16.
pub(super) const fn high_mask(bits: u32) -> i32 {
    ((1 << high_bits(bits)) - 1) * 0x0001_0001
}

/// `v` (step `p`'s pairs of nibbles) with the codes' high bits set.
#[inline(always)]
unsafe fn with_high<const BITS: u32>(v: __m512i, codes: *const u8, p: usize) -> __m512i {
    let (at, shift) = high_word(codes, BITS, p);
    let word = _mm512_loadu_si512(at as *const __m512i);
    let field = _mm512_and_si512(_mm512_srl_epi32(word, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(high_mask(BITS)));
    _mm512_or_si512(v, _mm512_slli_epi32::<4>(field))
}

/// A legacy 32-value block format's packing: `BITS`-wide codes `v + OFFSET`.
pub(super) trait LegacyCodes: Legacy {
    const BITS: u32;
    const OFFSET: i16;
}

impl LegacyCodes for Q4_0 {
    const BITS: u32 = 4;
    const OFFSET: i16 = 8;
}
impl LegacyCodes for Q4_1 {
    const BITS: u32 = 4;
    const OFFSET: i16 = 0;
}
impl LegacyCodes for Q5_0 {
    const BITS: u32 = 5;
    const OFFSET: i16 = 16;
}
impl LegacyCodes for Q5_1 {
    const BITS: u32 = 5;
    const OFFSET: i16 = 0;
}
impl LegacyCodes for Q8_0 {
    const BITS: u32 = 8;
    const OFFSET: i16 = 0;
}

impl<F: LegacyCodes> Packing for F {
    const SB: usize = B;
    const GGUF_BYTES: usize = <F as Legacy>::BYTES;
    const WITH_MIN: bool = <F as Legacy>::AFFINE;
    const HEADER: usize = if Self::WITH_MIN { 64 } else { 32 };
    const BLOCK: usize = block_bytes(F::BITS);
    type Block = *const u8;
    type Quad = __m512i;

    fn pack(src: &[u8], j: usize, dst: &mut [u8]) {
        // `d` (and `m`) are the block's first f16s.
        dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
        if Self::WITH_MIN {
            dst[32 + 2 * j..32 + 2 * j + 2].copy_from_slice(&src[2..4]);
        }
        let codes = F::values(src).map(|v| (v + i32::from(F::OFFSET)) as u8);
        put_codes(&codes, j, F::BITS, &mut dst[Self::HEADER..]);
    }

    #[inline(always)]
    unsafe fn scales(sb: *const u8, _: usize, _: Half) -> (__m512, __m512) {
        (f16x16(sb), if Self::WITH_MIN { f16x16(sb.add(32)) } else { _mm512_setzero_ps() })
    }

    #[inline(always)]
    unsafe fn block(sb: *const u8, _: usize) -> *const u8 {
        sb.add(Self::HEADER)
    }

    #[inline(always)]
    unsafe fn quad(codes: *const u8, q: usize) -> __m512i {
        if F::BITS == 8 {
            return _mm512_setzero_si512();
        }
        nibble_quad(codes, q)
    }

    #[inline(always)]
    unsafe fn pairs<const S: usize>(codes: *const u8, quad: __m512i, q: usize) -> __m512i {
        let p = QUAD * q + S;
        if F::BITS == 8 {
            return _mm512_cvtepi8_epi16(_mm256_loadu_si256(codes.add(32 * p) as *const __m256i));
        }
        let mut v = nibble_pairs::<S>(quad);
        if F::BITS == 5 {
            v = with_high::<5>(v, codes, p);
        }
        if F::OFFSET != 0 {
            v = _mm512_sub_epi16(v, _mm512_set1_epi16(F::OFFSET));
        }
        v
    }
}

/// Q4_K (`Q5 = false`) and Q5_K: `ws = d * sc`, `wm = -dmin * mn` per 32-value block.
pub(super) struct K4K5<const Q5: bool>;

impl<const Q5: bool> Packing for K4K5<Q5> {
    const SB: usize = 256;
    const GGUF_BYTES: usize = if Q5 { 176 } else { 144 };
    const WITH_MIN: bool = true;
    const HEADER: usize = 64 + 2 * 128;
    const BLOCK: usize = block_bytes(if Q5 { 5 } else { 4 });
    type Block = *const u8;
    type Quad = __m512i;

    fn pack(src: &[u8], j: usize, dst: &mut [u8]) {
        dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
        dst[32 + 2 * j..32 + 2 * j + 2].copy_from_slice(&src[2..4]);
        for s in 0..8 {
            let (sc, mn) = scale_min_k4(s, &src[4..16]);
            dst[64 + 16 * s + j] = sc;
            dst[192 + 16 * s + j] = mn;
        }
        let codes = if Q5 { k4_k5_codes(&src[16..48], &src[48..176]) } else { k4_k5_codes(&[0; 32], &src[16..144]) };
        put_codes(&codes, j, if Q5 { 5 } else { 4 }, &mut dst[Self::HEADER..]);
    }

    #[inline(always)]
    unsafe fn scales(sb: *const u8, s: usize, _: Half) -> (__m512, __m512) {
        let byte = |at: usize| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(sb.add(at) as *const __m128i)));
        let neg_dmin = _mm512_sub_ps(_mm512_setzero_ps(), f16x16(sb.add(32)));
        (_mm512_mul_ps(f16x16(sb), byte(64 + 16 * s)), _mm512_mul_ps(neg_dmin, byte(192 + 16 * s)))
    }

    #[inline(always)]
    unsafe fn block(sb: *const u8, s: usize) -> *const u8 {
        sb.add(Self::HEADER + s * Self::BLOCK)
    }

    #[inline(always)]
    unsafe fn quad(codes: *const u8, q: usize) -> __m512i {
        nibble_quad(codes, q)
    }

    #[inline(always)]
    unsafe fn pairs<const S: usize>(codes: *const u8, quad: __m512i, q: usize) -> __m512i {
        let v = nibble_pairs::<S>(quad);
        if Q5 {
            with_high::<5>(v, codes, QUAD * q + S)
        } else {
            v
        }
    }
}

/// Q6_K: `v = (code - 32) * sc` with one scale per 16 values (|v| ≤ 4096), `ws = d`.
pub(super) struct Q6K;

impl Packing for Q6K {
    const SB: usize = 256;
    const GGUF_BYTES: usize = 210;
    const WITH_MIN: bool = false;
    const HEADER: usize = 32 + 256;
    const BLOCK: usize = block_bytes(6);
    /// The codes, and the scales (as i16 pairs) of steps 0..8 and 8..16.
    type Block = (*const u8, __m512i, __m512i);
    type Quad = __m512i;

    fn pack(src: &[u8], j: usize, dst: &mut [u8]) {
        dst[2 * j..2 * j + 2].copy_from_slice(&src[208..210]);
        for g in 0..16 {
            dst[32 + 16 * g + j] = src[192 + g];
        }
        put_codes(&q6_k_codes(&src[..128], &src[128..192]), j, 6, &mut dst[Self::HEADER..]);
    }

    #[inline(always)]
    unsafe fn scales(sb: *const u8, _: usize, _: Half) -> (__m512, __m512) {
        (f16x16(sb), _mm512_setzero_ps())
    }

    #[inline(always)]
    unsafe fn block(sb: *const u8, s: usize) -> Self::Block {
        // Lane j = sc | sc << 16 for row j's scale of group g.
        let scale = |g: usize| {
            let x = _mm512_cvtepi8_epi32(_mm_loadu_si128(sb.add(32 + 16 * g) as *const __m128i));
            _mm512_ternarylogic_epi32::<0xEC>(x, _mm512_slli_epi32::<16>(x), _mm512_set1_epi32(0xFFFF))
        };
        (sb.add(Self::HEADER + s * Self::BLOCK), scale(2 * s), scale(2 * s + 1))
    }

    #[inline(always)]
    unsafe fn quad((codes, _, _): Self::Block, q: usize) -> __m512i {
        nibble_quad(codes, q)
    }

    #[inline(always)]
    unsafe fn pairs<const S: usize>((codes, lo, hi): Self::Block, quad: __m512i, q: usize) -> __m512i {
        let v = with_high::<6>(nibble_pairs::<S>(quad), codes, QUAD * q + S);
        let v = _mm512_sub_epi16(v, _mm512_set1_epi16(32));
        _mm512_mullo_epi16(v, if q < QUADS / 2 { lo } else { hi })
    }
}

/// MLX's affine groups of `G` values with `BITS`-wide unsigned codes and a 16-bit scale and
/// bias (`quant::mlx`): `ws = scale`, `wm = bias` for every 32-value block of the group.
pub(super) struct Mlx<const BITS: u32, const G: usize>;

impl<const BITS: u32, const G: usize> Packing for Mlx<BITS, G> {
    const SB: usize = G;
    const GGUF_BYTES: usize = 4 + G * BITS as usize / 8;
    const WITH_MIN: bool = true;
    const HEADER: usize = 64;
    const BLOCK: usize = block_bytes(BITS);
    type Block = *const u8;
    type Quad = __m512i;

    fn pack(src: &[u8], j: usize, dst: &mut [u8]) {
        dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
        dst[32 + 2 * j..32 + 2 * j + 2].copy_from_slice(&src[2..4]);
        let mut codes = [0u8; 128];
        for (i, c) in codes.iter_mut().take(G).enumerate() {
            *c = code(BITS, &src[4..], i);
        }
        put_codes(&codes[..G], j, BITS, &mut dst[Self::HEADER..]);
    }

    #[inline(always)]
    unsafe fn scales(sb: *const u8, _: usize, half: Half) -> (__m512, __m512) {
        (half16(sb, half), half16(sb.add(32), half))
    }

    #[inline(always)]
    unsafe fn block(sb: *const u8, s: usize) -> *const u8 {
        sb.add(Self::HEADER + s * Self::BLOCK)
    }

    #[inline(always)]
    unsafe fn quad(codes: *const u8, q: usize) -> __m512i {
        if BITS == 8 {
            return _mm512_setzero_si512();
        }
        nibble_quad(codes, q)
    }

    #[inline(always)]
    unsafe fn pairs<const S: usize>(codes: *const u8, quad: __m512i, q: usize) -> __m512i {
        if BITS == 8 {
            return _mm512_cvtepu8_epi16(_mm256_loadu_si256(codes.add(32 * (QUAD * q + S)) as *const __m256i));
        }
        nibble_pairs::<S>(quad)
    }
}

/// Whether `igemm` multiplies `dtype` (packed).
pub(super) fn packs(dtype: DType) -> bool {
    match dtype {
        DType::Mlx(f) => f.scale() != MlxScale::F32,
        d => matches!(
            d,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::Q4K | DType::Q5K | DType::Q6K
        ),
    }
}

/// A computation generic over one packed format (its `Packing` and its AVX2 reader
/// `Halves`), run for a dtype by `with_format`.
pub(super) trait FormatFn {
    type Out;
    /// # Safety
    /// As the implementor documents.
    unsafe fn call<F: Packing + Halves>(self) -> Self::Out;
}

/// `f` for the packed format of `dtype` (one that `packs` accepts): the one place that maps a
/// dtype to its `Packing`.
///
/// # Safety
/// As `f.call` requires.
pub(super) unsafe fn with_format<R: FormatFn>(dtype: DType, f: R) -> R::Out {
    match dtype {
        DType::Q4_0 => f.call::<Q4_0>(),
        DType::Q4_1 => f.call::<Q4_1>(),
        DType::Q5_0 => f.call::<Q5_0>(),
        DType::Q5_1 => f.call::<Q5_1>(),
        DType::Q8_0 => f.call::<Q8_0>(),
        DType::Q4K => f.call::<K4K5<false>>(),
        DType::Q5K => f.call::<K4K5<true>>(),
        DType::Mlx(m) => match (m.bits(), m.group()) {
            (4, 32) => f.call::<Mlx<4, 32>>(),
            (4, 64) => f.call::<Mlx<4, 64>>(),
            (4, _) => f.call::<Mlx<4, 128>>(),
            (_, 32) => f.call::<Mlx<8, 32>>(),
            (_, 64) => f.call::<Mlx<8, 64>>(),
            _ => f.call::<Mlx<8, 128>>(),
        },
        _ => f.call::<Q6K>(),
    }
}

/// `w`'s packed copy (built on first use and kept with the tensor); `w.dtype()` is one that
/// `packs` accepts.
pub(super) fn packed(w: &Tensor) -> &[u8] {
    struct Build<'a>(&'a Tensor);
    impl<'a> FormatFn for Build<'a> {
        type Out = &'a [u8];
        unsafe fn call<F: Packing + Halves>(self) -> &'a [u8] {
            packed_as::<F>(self.0)
        }
    }
    // SAFETY: `Build::call` has no requirements.
    unsafe { with_format(w.dtype(), Build(w)) }
}

/// Bytes of one packed group of 16 rows of `k` values.
pub(super) fn group_bytes<F: Packing>(k: usize) -> usize {
    k / F::SB * F::PACKED
}

fn packed_as<F: Packing>(w: &Tensor) -> &[u8] {
    let (n, k, rb) = (w.rows(), w.row_len(), w.row_bytes());
    w.derived(n.div_ceil(GROUP) * group_bytes::<F>(k), |out| {
        out.par_chunks_mut(group_bytes::<F>(k)).enumerate().for_each(|(g, dst)| {
            // The group's rows (an MLX matrix's assembled here, a group at a time).
            let mut scratch = Vec::new();
            let rows = w.row_blocks(g * GROUP..((g + 1) * GROUP).min(n), &mut scratch);
            for (j, row) in rows.chunks_exact(rb).enumerate() {
                for (src, dst) in row.chunks_exact(F::GGUF_BYTES).zip(dst.chunks_exact_mut(F::PACKED)) {
                    F::pack(src, j, dst);
                }
            }
        });
    })
}
