//! Group-affine quantized KV pools (int8 / int4), read in place by the attention kernels.
//!
//! A pool holds the same `[block][kv_head][slot][head_dim]` values as a float pool, addressed
//! by the same value offsets, in two regions: the codes (one byte a value for int8, two
//! values a byte for int4: value `2j` in the low nibble of byte `j`, `2j + 1` in the high
//! one) and, per group of `group` consecutive values of a row (a token's head), an f16 scale
//! and bias (`x ≈ scale * code + bias`, `bias` the group's minimum, `scale` its range over
//! the largest code). A group never spans two rows (`group` divides `head_dim`), so a
//! token's quantized values depend only on that token's keys or values: a position is
//! written once, the same way in any batch, chunk or prefix-cache hit.
//!
//! A quantized K pool may store each key less a fixed offset per KV head and channel
//! (`KvCache::set_key_offsets`): a query's scores over every key it sees then shift by the
//! same amount, `q · offset`, which the softmax cancels, so attention reads the stored keys as
//! they are. The offset takes out what every key of a layer shares — Qwen2's k bias puts
//! values of ±150 in a few channels that barely rotate, which would set the range of every
//! group they fall in (a step of ~1 for keys whose other channels are ~±10) — and leaves the
//! codes to what differs. A model sets it only where scores are plain dot products (no
//! softcap).
//!
//! Value offset `o` has its code at byte `o * bits / 8` and its group's parameters at
//! `2 * (o / group)` of the f16 region; a block of `block_size` slots takes
//! `block_size * n_kv_heads * head_dim * (bits / 8 + 4 / group)` bytes of both regions.

use half::f16;

use crate::error::{Result, RuntimeError};
use crate::hugemem::HugeVec;
use crate::kv::{KvCache, KvPool, Storage};

/// The group sizes a quantized pool takes (each must divide the head dim).
pub const KV_GROUP_SIZES: [usize; 4] = [16, 32, 64, 128];

/// Code width of a quantized pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvBits {
    Int8,
    Int4,
}

impl KvBits {
    pub fn bits(self) -> usize {
        match self {
            KvBits::Int8 => 8,
            KvBits::Int4 => 4,
        }
    }

    /// The largest code.
    fn max_code(self) -> f32 {
        ((1u32 << self.bits()) - 1) as f32
    }
}

/// One quantized pool (K or V of a layer).
pub struct QuantPool {
    bits: KvBits,
    /// log2 of the group size.
    shift: u32,
    len: usize,
    codes: HugeVec<u8>,
    /// `(scale, bias)` per group.
    params: HugeVec<f16>,
}

impl QuantPool {
    /// `len` values (a multiple of `group`, one of `KV_GROUP_SIZES`), all zero.
    pub fn zeroed(bits: KvBits, group: usize, len: usize) -> QuantPool {
        debug_assert!(KV_GROUP_SIZES.contains(&group) && len.is_multiple_of(group));
        QuantPool {
            bits,
            shift: group.trailing_zeros(),
            len,
            codes: HugeVec::zeroed(len * bits.bits() / 8),
            params: HugeVec::zeroed(2 * (len >> group.trailing_zeros())),
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bits(&self) -> KvBits {
        self.bits
    }

    pub fn group(&self) -> usize {
        1 << self.shift
    }

    /// The two regions, as byte ranges of their memory, of values `range` (for `madvise`).
    pub(crate) fn regions_mut(&mut self, range: std::ops::Range<usize>) -> [(*mut u8, std::ops::Range<usize>); 2] {
        let bits = self.bits.bits();
        let g = |v: usize| 4 * (v >> self.shift);
        [
            (self.codes.as_mut_ptr(), range.start * bits / 8..range.end * bits / 8),
            (self.params.as_mut_ptr() as *mut u8, g(range.start)..g(range.end)),
        ]
    }

    /// The bytes of values `range` (whole groups): their codes, then their groups' (scale,
    /// bias).
    pub(crate) fn bytes(&self, range: std::ops::Range<usize>) -> [&[u8]; 2] {
        let bits = self.bits.bits();
        let g = |v: usize| 2 * (v >> self.shift);
        [
            &self.codes[range.start * bits / 8..range.end * bits / 8],
            bytemuck::cast_slice(&self.params[g(range.start)..g(range.end)]),
        ]
    }

    /// The bytes of values `range`, to overwrite, as `bytes` gives them.
    pub(crate) fn bytes_mut(&mut self, range: std::ops::Range<usize>) -> [&mut [u8]; 2] {
        let bits = self.bits.bits();
        let g = |v: usize| 2 * (v >> self.shift);
        [
            &mut self.codes[range.start * bits / 8..range.end * bits / 8],
            bytemuck::cast_slice_mut(&mut self.params[g(range.start)..g(range.end)]),
        ]
    }

    /// Quantize `src` (whole groups) into values `off..off + src.len()` (`off` a multiple of
    /// the group size). False if the range is outside the pool or not whole groups.
    pub fn write(&mut self, off: usize, src: &[f32]) -> bool {
        let group = self.group();
        if !off.is_multiple_of(group) || !src.len().is_multiple_of(group) || off + src.len() > self.len {
            return false;
        }
        let max_code = self.bits.max_code();
        for (i, x) in src.chunks_exact(group).enumerate() {
            let (lo, hi) = x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            let (scale, bias) = (f16::from_f32((hi - lo) / max_code), f16::from_f32(lo));
            let at = 2 * ((off >> self.shift) + i);
            self.params[at] = scale;
            self.params[at + 1] = bias;
            let (s, b) = (scale.to_f32(), bias.to_f32());
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            let code = |v: f32| ((v - b) * inv).round().clamp(0.0, max_code) as u8;
            let start = off + i * group;
            match self.bits {
                KvBits::Int8 => {
                    for (c, &v) in self.codes[start..start + group].iter_mut().zip(x) {
                        *c = code(v);
                    }
                }
                KvBits::Int4 => {
                    for (c, pair) in self.codes[start / 2..(start + group) / 2].iter_mut().zip(x.chunks_exact(2)) {
                        *c = code(pair[0]) | (code(pair[1]) << 4);
                    }
                }
            }
        }
        true
    }

    /// `dst` = values `off..off + dst.len()` (whole groups from a group start), dequantized;
    /// the caller has checked the range.
    pub fn widen(&self, off: usize, dst: &mut [f32]) {
        let group = self.group();
        for (i, d) in dst.chunks_mut(group).enumerate() {
            let at = 2 * ((off >> self.shift) + i);
            let (s, b) = (self.params[at].to_f32(), self.params[at + 1].to_f32());
            let (start, n) = (off + i * group, d.len());
            match self.bits {
                KvBits::Int8 => {
                    for (d, &c) in d.iter_mut().zip(&self.codes[start..start + n]) {
                        *d = f32::from(c) * s + b;
                    }
                }
                KvBits::Int4 => {
                    for (j, d) in d.iter_mut().enumerate() {
                        let byte = self.codes[(start + j) / 2];
                        let c = if (start + j) % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                        *d = f32::from(c) * s + b;
                    }
                }
            }
        }
    }

    /// Ask for the cache lines of values `off..off + n` (codes and parameters).
    #[inline(always)]
    pub fn prefetch(&self, off: usize, n: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let codes = self.codes.as_ptr().wrapping_add(off * self.bits.bits() / 8) as *const i8;
            for b in (0..n * self.bits.bits() / 8).step_by(64) {
                // SAFETY: a prefetch has no architectural effect, whatever the address.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(codes.wrapping_add(b)) };
            }
            let params = self.params.as_ptr().wrapping_add(2 * (off >> self.shift)) as *const i8;
            // SAFETY: as above.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(params) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (off, n);
    }

    /// Values `off..off + 16` (`off` a multiple of 16, inside the pool) as f32.
    ///
    /// # Safety
    /// AVX-512 F; `off + 16 <= len`.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub unsafe fn load16(&self, off: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let bytes = match self.bits {
            KvBits::Int8 => _mm_loadu_si128(self.codes.as_ptr().add(off) as *const __m128i),
            KvBits::Int4 => {
                let x = _mm_loadl_epi64(self.codes.as_ptr().add(off / 2) as *const __m128i);
                let nib = _mm_set1_epi8(0x0F);
                _mm_unpacklo_epi8(_mm_and_si128(x, nib), _mm_and_si128(_mm_srli_epi16::<4>(x), nib))
            }
        };
        let codes = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
        // The group's (scale, bias) pair as lanes 0 and 1, then each broadcast.
        let pair = (self.params.as_ptr().add(2 * (off >> self.shift)) as *const i32).read_unaligned();
        let sb = _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_cvtsi32_si128(pair)));
        let scale = _mm512_permutexvar_ps(_mm512_setzero_si512(), sb);
        let bias = _mm512_permutexvar_ps(_mm512_set1_epi32(1), sb);
        // Not fused: the same roundings as `widen`.
        _mm512_add_ps(_mm512_mul_ps(codes, scale), bias)
    }
}

impl KvCache {
    /// Set the key offset of each KV layer `i` to `offsets[i]` (`[n_kv_heads][head_dim]`;
    /// None, or a missing entry: none); it is kept only by layers whose K pool is quantized
    /// (a device cache keeps none). Set before anything is written.
    pub fn set_key_offsets(&mut self, offsets: &[Option<Vec<f32>>]) -> Result<()> {
        let Storage::Host(layers) = &mut self.storage else { return Ok(()) };
        for (l, offset) in layers.iter_mut().zip(offsets) {
            let want = l.spec.n_kv_heads * l.spec.head_dim;
            match offset {
                Some(o) if o.len() != want => {
                    return Err(RuntimeError::Shape(format!("a key offset of {} values for {want}", o.len())))
                }
                Some(o) if matches!(l.k, KvPool::Quant(_)) => l.key_offset = Some(o.clone()),
                _ => l.key_offset = None,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Each value comes back within half a step of its group (plus the f16 rounding of the
    /// parameters), the extremes of a group nearly exactly, and the AVX-512 loads agree with
    /// `widen` bit for bit.
    #[test]
    fn values_round_trip_within_half_a_step() {
        let mut rng = StdRng::seed_from_u64(rand::rng().random());
        for bits in [KvBits::Int8, KvBits::Int4] {
            for group in KV_GROUP_SIZES {
                let n = 4 * 128;
                let x: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..5.0)).collect();
                let mut pool = QuantPool::zeroed(bits, group, n + 128);
                assert!(pool.write(128, &x));
                assert!(!pool.write(1, &x[..group]), "an offset inside a group is refused");
                assert!(!pool.write(n + 128, &x[..group]), "a write past the end is refused");
                let mut back = vec![0f32; n];
                pool.widen(128, &mut back);
                for (xs, bs) in x.chunks(group).zip(back.chunks(group)) {
                    let (lo, hi) = xs.iter().fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
                    let step = (hi - lo) / bits.max_code();
                    for (a, b) in xs.iter().zip(bs) {
                        assert!(
                            (a - b).abs() <= 0.5 * step + 4e-3 * (hi - lo).max(lo.abs()),
                            "{bits:?} g{group}: {a} vs {b}"
                        );
                    }
                }
                #[cfg(target_arch = "x86_64")]
                if is_x86_feature_detected!("avx512f") {
                    #[target_feature(enable = "avx512f")]
                    unsafe fn load(pool: &QuantPool, off: usize) -> [f32; 16] {
                        std::mem::transmute(pool.load16(off))
                    }
                    for off in (0..n).step_by(16) {
                        // SAFETY: AVX-512 F was detected; `off + 16` is inside the pool.
                        let got = unsafe { load(&pool, 128 + off) };
                        assert_eq!(got[..], back[off..off + 16], "{bits:?} g{group} load16 at {off}");
                    }
                }
            }
        }
    }
}
