//! Instruction-set levels of the fast kernels and the few SIMD primitives that differ between
//! them.
//!
//! A kernel is written once as an `#[inline(always)]` function generic over `Simd`, and
//! instantiated per level inside a `#[target_feature]` entry point (`simd_entry!`), so each
//! instantiation is compiled for exactly the instructions its level guarantees. Levels are
//! ordered: a machine that has one has the ones below it, except that the two VNNI flavours
//! (VEX-encoded AVX-VNNI, EVEX-encoded AVX-512 VNNI) are siblings above AVX2.

/// The instruction sets a kernel may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Portable Rust; the same integer math as the SIMD kernels.
    Scalar,
    /// AVX2 + FMA + F16C: 16-bit products through `vpmaddwd`.
    Avx2,
    /// AVX2 plus AVX-VNNI (`vpdpwssd` on 256-bit registers, VEX encoded).
    AvxVnni,
    /// AVX-512 F/BW/VL plus AVX-512 VNNI (the same 256-bit products, EVEX encoded; and the
    /// AVX-512 f32 GEMM of the panel path).
    Avx512Vnni,
}

impl Level {
    /// Every level, lowest first.
    pub const ALL: [Level; 4] = [Level::Scalar, Level::Avx2, Level::AvxVnni, Level::Avx512Vnni];

    /// Whether this CPU can run kernels of this level.
    pub fn available(self) -> bool {
        match self {
            Level::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Level::AvxVnni => Level::Avx2.available() && is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Level::Avx512Vnni => {
                Level::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The best level this CPU has (AVX-512 VNNI also brings the AVX-512 f32 GEMM of the
    /// panel path).
    pub fn best() -> Level {
        Level::ALL.into_iter().rev().find(|l| l.available()).unwrap_or(Level::Scalar)
    }

    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::AvxVnni => "avxvnni",
            Level::Avx512Vnni => "avx512vnni",
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::*;

/// Pick `level`'s function (as a `$ty` pointer) among a scalar function and the entry points
/// of a `simd_entry!` module.
macro_rules! by_level {
    ($level:expr, $ty:ty, $scalar:expr, $($entries:ident)::+) => {
        match $level {
            $crate::cpu::qmatmul::isa::Level::Scalar => $scalar as $ty,
            #[cfg(target_arch = "x86_64")]
            $crate::cpu::qmatmul::isa::Level::Avx2 => $($entries)::+::avx2 as $ty,
            #[cfg(target_arch = "x86_64")]
            $crate::cpu::qmatmul::isa::Level::AvxVnni => $($entries)::+::avxvnni as $ty,
            #[cfg(target_arch = "x86_64")]
            $crate::cpu::qmatmul::isa::Level::Avx512Vnni => $($entries)::+::avx512vnni as $ty,
            #[cfg(not(target_arch = "x86_64"))]
            _ => $scalar as $ty,
        }
    };
}
pub(crate) use by_level;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The integer dot-product primitive, per level. Every method is `#[inline(always)]` so
    /// it is compiled inside the caller's `#[target_feature]` context.
    pub(crate) trait Simd {
        /// `acc + (w[2i] * a[2i] + w[2i+1] * a[2i+1])` per i32 lane, for i16 lanes `w`, `a`
        /// (`vpmaddwd` + add, or one `vpdpwssd` with VNNI; exact for the kernels' ranges).
        unsafe fn dot_i16(acc: __m256i, w: __m256i, a: __m256i) -> __m256i;
    }

    pub(crate) struct Avx2;
    pub(crate) struct AvxVnni;
    pub(crate) struct Avx512Vnni;

    impl Simd for Avx2 {
        #[inline(always)]
        unsafe fn dot_i16(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
            _mm256_add_epi32(acc, _mm256_madd_epi16(w, a))
        }
    }

    impl Simd for AvxVnni {
        #[inline(always)]
        unsafe fn dot_i16(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
            _mm256_dpwssd_avx_epi32(acc, w, a)
        }
    }

    impl Simd for Avx512Vnni {
        #[inline(always)]
        unsafe fn dot_i16(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
            _mm256_dpwssd_epi32(acc, w, a)
        }
    }

    /// Sixteen i16 activation codes at `p`.
    #[inline(always)]
    pub(crate) unsafe fn load_i16x16(p: *const i16) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    /// `e^x` for 8 lanes with `x ≤ 88`: `x = n·ln2 + r` with `|r| ≤ ln2 / 2` (ln2 split in
    /// two for an exact reduction), `e^r` by its degree-6 Taylor polynomial (relative error
    /// < 2e-7), times `2^n` built in the exponent bits. Inputs are clamped at -87, so the
    /// smallest result is `e^-87 ≈ 1.6e-38` rather than a denormal or 0.
    #[inline(always)]
    pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
        const LN2_HI: f32 = 0.693_145_75;
        const LN2_LO: f32 = 1.428_606_8e-6;
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        _mm256_mul_ps(p, _mm256_castsi256_ps(scale))
    }

    /// Sum of the 8 f32 lanes.
    #[inline(always)]
    pub(crate) unsafe fn hsum_ps(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Sum of the 4 i32 lanes.
    #[inline(always)]
    pub(crate) unsafe fn hsum_epi32_128(v: __m128i) -> i32 {
        let s = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    /// Two little-endian f16 values at `p` (`p[0..2]`, `p[2..4]`) as f32.
    #[inline(always)]
    pub(crate) unsafe fn f16x2(p: *const u8) -> (f32, f32) {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }

    /// The unaligned little-endian u32 at `p`.
    #[inline(always)]
    pub(crate) unsafe fn read_u32(p: *const u8) -> u32 {
        u32::from_le(std::ptr::read_unaligned(p as *const u32))
    }

    /// The 32 4-bit codes of 16 packed bytes as two i16 vectors: values `0..16` (the low
    /// nibbles) and `16..32` (the high nibbles) — the ggml 32-block packing.
    #[inline(always)]
    pub(crate) unsafe fn nibbles_i16(p: *const u8) -> (__m256i, __m256i) {
        let bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
        (_mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(bytes, 4))
    }

    /// `0x10` in i16 lane `j` where bit `j` of `bits` is set (the fifth bit of 16 codes).
    #[inline(always)]
    pub(crate) unsafe fn fifth_bits_i16(bits: u16) -> __m256i {
        let mask = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, i16::MIN);
        let set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(bits as i16), mask), mask);
        _mm256_and_si256(set, _mm256_set1_epi16(0x10))
    }

    /// How far ahead of the current block the row kernels prefetch weight bytes.
    pub(crate) const PREFETCH_AHEAD: usize = 2048;

    /// Prefetch the cache lines of `len` bytes at `p` (`p` may lie past the data: prefetches
    /// never fault).
    #[inline(always)]
    pub(crate) unsafe fn prefetch(p: *const u8, len: usize) {
        let mut off = 0;
        while off < len {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off) as *const i8);
            off += 64;
        }
    }

    /// Stamp out one `#[target_feature]` entry point per level for a kernel generic over
    /// `Simd` (as its last type parameter): `simd_entry!(name, generic_fn<Types..>, (args) -> ret)`
    /// defines the functions `name::avx2`, `name::avxvnni` and `name::avx512vnni`.
    macro_rules! simd_entry {
        ($name:ident, $generic:ident $(< $($tp:tt),* >)?, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
            pub(crate) mod $name {
                #[allow(unused_imports)]
                use super::*;
                /// # Safety
                /// The CPU must have AVX2, FMA and F16C.
                #[target_feature(enable = "avx2,fma,f16c")]
                pub(crate) unsafe fn avx2($($arg: $ty),*) -> $ret {
                    super::$generic::<$($($tp,)*)? $crate::cpu::qmatmul::isa::Avx2>($($arg),*)
                }
                /// # Safety
                /// The CPU must have AVX2, FMA, F16C and AVX-VNNI.
                #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
                pub(crate) unsafe fn avxvnni($($arg: $ty),*) -> $ret {
                    super::$generic::<$($($tp,)*)? $crate::cpu::qmatmul::isa::AvxVnni>($($arg),*)
                }
                /// # Safety
                /// The CPU must have AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI.
                #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
                pub(crate) unsafe fn avx512vnni($($arg: $ty),*) -> $ret {
                    super::$generic::<$($($tp,)*)? $crate::cpu::qmatmul::isa::Avx512Vnni>($($arg),*)
                }
            }
        };
    }
    pub(crate) use simd_entry;
}
