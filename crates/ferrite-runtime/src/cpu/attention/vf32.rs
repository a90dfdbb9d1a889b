//! The f32 vector primitives of the attention kernels, as a trait with a portable, an AVX2+FMA
//! and an AVX-512 implementation. Kernels are generic over it and instantiated inside
//! `#[target_feature]` entry points, like the quantized kernels.
//!
//! Besides the per-vector primitives (dot product, axpy, exponentials, max), the trait has the
//! two loops of decode attention over a set of cache rows (`Rows`, of a `KvValue` type): every
//! query head's scores against every key, and the score-weighted sum of the values. Their
//! default bodies call `dot` and `axpy` once per (head, row); the AVX-512 ones widen each cache
//! row once for several query heads of a group and keep the work in registers (8 keys' dot
//! products per head reduced together, 64 output values per head accumulated across rows).
//!
//! Every method is `#[inline(always)]`: the bodies must compile inside the callers'
//! `#[target_feature]` functions, or their intrinsics become calls.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::kv_quant::QuantPool;

/// A value type of the KV cache: written from f32, read back as f32.
pub(super) trait KvValue: Copy + Send + Sync {
    /// `dst = src`, rounded to this type.
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// `dst = src` as f32.
    fn widen(src: &[Self], dst: &mut [f32]);
    /// 16 values at `p` as f32 (AVX-512 F).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl KvValue for f32 {
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
}

impl KvValue for f16 {
    fn narrow(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src)
    }
    fn widen(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

/// A K or V pool as the kernels read it, by value offset: a float slice, or quantized codes
/// dequantized as they are read (`QuantPool`).
pub(super) trait KvSource: Copy + Send + Sync {
    /// Values held.
    fn len(&self) -> usize;
    /// `dst` = values `off..off + dst.len()` as f32 (whole rows; the caller checked the range).
    fn widen(&self, off: usize, dst: &mut [f32]);
    /// Ask for the cache lines of values `off..off + n`.
    fn prefetch(&self, off: usize, n: usize);
    /// Values `off..off + 16` as f32, `off` a multiple of 16 inside the pool.
    ///
    /// # Safety
    /// AVX-512 F; `off + 16 <= len()`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(&self, off: usize) -> std::arch::x86_64::__m512;
}

impl<T: KvValue> KvSource for &[T] {
    fn len(&self) -> usize {
        <[T]>::len(self)
    }
    #[inline(always)]
    fn widen(&self, off: usize, dst: &mut [f32]) {
        T::widen(&self[off..off + dst.len()], dst)
    }
    #[inline(always)]
    fn prefetch(&self, off: usize, n: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let row = self.as_ptr().wrapping_add(off) as *const i8;
            for b in (0..n * std::mem::size_of::<T>()).step_by(64) {
                // SAFETY: a prefetch has no architectural effect, whatever the address.
                unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(row.wrapping_add(b)) };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (off, n);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(&self, off: usize) -> std::arch::x86_64::__m512 {
        T::load16(self.as_ptr().add(off))
    }
}

impl KvSource for &QuantPool {
    fn len(&self) -> usize {
        QuantPool::len(self)
    }
    #[inline(always)]
    fn widen(&self, off: usize, dst: &mut [f32]) {
        QuantPool::widen(self, off, dst)
    }
    #[inline(always)]
    fn prefetch(&self, off: usize, n: usize) {
        QuantPool::prefetch(self, off, n)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(&self, off: usize) -> std::arch::x86_64::__m512 {
        QuantPool::load16(self, off)
    }
}

/// `len` cache rows of `hd` values: row `j` is values `offs[j]..offs[j] + hd` of `data`, every
/// one inside it (checked on construction, so the kernels may read them unchecked).
pub(super) struct Rows<'a, S> {
    data: S,
    offs: &'a [usize],
    hd: usize,
}

impl<'a, S: KvSource> Rows<'a, S> {
    /// `None` if a row reaches past `data`.
    pub(super) fn new(data: S, offs: &'a [usize], hd: usize) -> Option<Rows<'a, S>> {
        offs.iter().all(|&o| o.checked_add(hd).is_some_and(|end| end <= data.len())).then_some(Rows { data, offs, hd })
    }

    fn len(&self) -> usize {
        self.offs.len()
    }

    /// Row `j` as f32, into `buf`.
    fn row_f32<'b>(&self, j: usize, buf: &'b mut Vec<f32>) -> &'b [f32] {
        buf.resize(self.hd, 0.0);
        self.data.widen(self.offs[j], buf);
        buf
    }

    /// Ask for the cache lines of row `j` (nothing past the end): rows are scattered over
    /// cache blocks, so the hardware prefetcher cannot run ahead across them.
    #[inline(always)]
    fn prefetch(&self, j: usize) {
        if let Some(&o) = self.offs.get(j) {
            self.data.prefetch(o, self.hd);
        }
    }
}

/// Rows ahead of the current one that the default loops prefetch.
const PREFETCH_ROWS: usize = 24;

/// f32 primitives over raw slices of equal length.
pub(super) trait Vf32 {
    /// `Σ a[i] * b[i]`.
    fn dot(a: &[f32], b: &[f32]) -> f32;
    /// `y[i] += alpha * x[i]`.
    fn axpy(y: &mut [f32], alpha: f32, x: &[f32]);
    /// `x[i] = exp(x[i] - max)` in place; returns the sum of the new values.
    fn exp_sum(x: &mut [f32], max: f32) -> f32;
    /// The largest value of `x` (NaNs ignored; -inf when empty).
    #[inline(always)]
    fn max(x: &[f32]) -> f32 {
        x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }
    /// `exp_sum` from `x`'s own max: softmax numerators in place, returns `(max, sum)`.
    #[inline(always)]
    fn max_exp_sum(x: &mut [f32]) -> (f32, f32) {
        let max = Self::max(x);
        (max, Self::exp_sum(x, max))
    }

    /// `out[h * n + j] = scale * (q_h · row j)` for the query heads `q_h` (`q` is
    /// `[heads, hd]`, `out` is `[heads, n]`, `n = keys.len()`).
    #[inline(always)]
    fn scores<S: KvSource>(q: &[f32], keys: &Rows<'_, S>, scale: f32, out: &mut [f32]) {
        scores_by_dot::<Self, S>(q, keys, scale, out)
    }

    /// `out[h] += Σ_j w[h * n + j] * row j` for each head `h` (`out` is `[heads, hd]`).
    #[inline(always)]
    fn weighted_sum<S: KvSource>(w: &[f32], values: &Rows<'_, S>, out: &mut [f32]) {
        weighted_sum_by_axpy::<Self, S>(w, values, out)
    }
}

#[inline(always)]
fn scores_by_dot<V: Vf32 + ?Sized, S: KvSource>(q: &[f32], keys: &Rows<'_, S>, scale: f32, out: &mut [f32]) {
    let n = keys.len();
    let mut buf = Vec::new();
    for j in 0..n {
        keys.prefetch(j + PREFETCH_ROWS);
        let key = keys.row_f32(j, &mut buf);
        for (qh, o) in q.chunks_exact(keys.hd).zip(out.chunks_exact_mut(n)) {
            o[j] = V::dot(qh, key) * scale;
        }
    }
}

#[inline(always)]
fn weighted_sum_by_axpy<V: Vf32 + ?Sized, S: KvSource>(w: &[f32], values: &Rows<'_, S>, out: &mut [f32]) {
    let n = values.len();
    let mut buf = Vec::new();
    for j in 0..n {
        values.prefetch(j + PREFETCH_ROWS);
        let v = values.row_f32(j, &mut buf);
        for (wh, o) in w.chunks_exact(n).zip(out.chunks_exact_mut(values.hd)) {
            V::axpy(o, wh[j], v);
        }
    }
}

pub(super) struct Scalar;

impl Vf32 for Scalar {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        crate::cpu::matmul::dot(a, b)
    }
    #[inline(always)]
    fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
        y.iter_mut().zip(x).for_each(|(y, x)| *y += alpha * x);
    }
    #[inline(always)]
    fn exp_sum(x: &mut [f32], max: f32) -> f32 {
        let mut sum = 0.0;
        for v in x.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        sum
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{scores_by_dot, weighted_sum_by_axpy, KvSource, Rows, Vf32};
    use crate::cpu::qmatmul::isa::{exp8, hsum_ps};

    /// AVX2 + FMA. Only used inside functions compiled with those features.
    pub(in super::super) struct Avx2;

    impl Vf32 for Avx2 {
        #[inline(always)]
        fn dot(a: &[f32], b: &[f32]) -> f32 {
            let n = a.len().min(b.len());
            // SAFETY: callers are compiled with AVX2/FMA (see the type's docs); every load
            // reads 8 values below `n`.
            unsafe {
                let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut i = 0;
                while i + 16 <= n {
                    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i)), s0);
                    s1 = _mm256_fmadd_ps(
                        _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                        _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                        s1,
                    );
                    i += 16;
                }
                if i + 8 <= n {
                    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i)), s0);
                    i += 8;
                }
                let tail: f32 = a[i..n].iter().zip(&b[i..n]).map(|(x, y)| x * y).sum();
                hsum_ps(_mm256_add_ps(s0, s1)) + tail
            }
        }

        #[inline(always)]
        fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
            let n = y.len().min(x.len());
            // SAFETY: as in `dot`.
            unsafe {
                let a = _mm256_set1_ps(alpha);
                let mut i = 0;
                while i + 8 <= n {
                    let p = y.as_mut_ptr().add(i);
                    _mm256_storeu_ps(p, _mm256_fmadd_ps(a, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(p)));
                    i += 8;
                }
                y[i..n].iter_mut().zip(&x[i..n]).for_each(|(y, x)| *y += alpha * x);
            }
        }

        #[inline(always)]
        fn max(x: &[f32]) -> f32 {
            // SAFETY: callers are compiled with AVX2 (see the type's docs).
            unsafe { crate::cpu::reduce::max_avx2(x) }
        }

        #[inline(always)]
        fn exp_sum(x: &mut [f32], max: f32) -> f32 {
            // SAFETY: as in `dot`.
            unsafe {
                let m = _mm256_set1_ps(max);
                let mut acc = _mm256_setzero_ps();
                let mut i = 0;
                while i + 8 <= x.len() {
                    let p = x.as_mut_ptr().add(i);
                    let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p), m));
                    _mm256_storeu_ps(p, e);
                    acc = _mm256_add_ps(acc, e);
                    i += 8;
                }
                let mut sum = hsum_ps(acc);
                if i < x.len() {
                    let mut tail = [f32::NEG_INFINITY; 8];
                    tail[..x.len() - i].copy_from_slice(&x[i..]);
                    let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(tail.as_ptr()), m));
                    _mm256_storeu_ps(tail.as_mut_ptr(), e);
                    let rest = x.len() - i;
                    x[i..].copy_from_slice(&tail[..rest]);
                    sum += tail[..rest].iter().sum::<f32>();
                }
                sum
            }
        }
    }

    /// AVX-512 F for the decode loops (the per-vector primitives are AVX2's). Only used inside
    /// functions compiled with AVX-512 F and VL, AVX2 and FMA.
    pub(in super::super) struct Avx512;

    /// Rows per tile of the value loop: the next tile is prefetched meanwhile.
    const VALUE_TILE: usize = 32;
    /// Keys per tile of the score loop (`KEY_TILE` keys times up to `SCORE_HEADS` heads of
    /// accumulators stay in registers).
    const KEY_TILE: usize = 8;
    /// Most query heads that share one pass over the keys, and over the values.
    const SCORE_HEADS: usize = 3;
    const VALUE_HEADS: usize = 4;

    /// Lane `i < 8` = the sum of the lanes of `a[i]` (a transposing reduction tree: 24 shuffles
    /// and adds for eight sums instead of eight horizontal reductions).
    #[inline(always)]
    unsafe fn reduce8(a: &[__m512; KEY_TILE]) -> __m256 {
        // Per 128-bit lane: [x0 + x2, y0 + y2, x1 + x3, y1 + y3] of each pair (x, y).
        let b: [__m512; 4] = std::array::from_fn(|i| {
            _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]))
        });
        // Per 128-bit lane: one partial sum of each of four consecutive inputs.
        let c: [__m512; 2] = std::array::from_fn(|i| {
            let (x, y) = (_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
            _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)))
        });
        // Lanes: [c0.0 + c0.1, c0.2 + c0.3, c1.0 + c1.1, c1.2 + c1.3], then pairs summed.
        let d = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(c[0], c[1]),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(c[0], c[1]),
        );
        let e = _mm512_add_ps(d, _mm512_shuffle_f32x4::<0b10_11_00_01>(d, d));
        _mm512_castps512_ps256(_mm512_shuffle_f32x4::<0b00_00_10_00>(e, e))
    }

    /// `scores` for `G` query heads (`q` is `[G, hd]`, `out` rows `h * n`), `hd` a multiple of
    /// 16: each key tile is widened once for all `G` heads.
    #[inline(always)]
    unsafe fn scores_heads<S: KvSource, const G: usize>(q: &[f32], keys: &Rows<'_, S>, scale: f32, out: *mut f32) {
        let (n, hd) = (keys.len(), keys.hd);
        for t0 in (0..n).step_by(KEY_TILE) {
            let valid = (n - t0).min(KEY_TILE);
            // A short last tile repeats its last key; those lanes are not stored.
            let rows: [usize; KEY_TILE] = std::array::from_fn(|j| keys.offs[t0 + j.min(valid - 1)]);
            for j in t0 + 2 * KEY_TILE..(t0 + 3 * KEY_TILE).min(n) {
                keys.prefetch(j);
            }
            let mut acc = [[_mm512_setzero_ps(); KEY_TILE]; G];
            for d in (0..hd).step_by(16) {
                let qv: [__m512; G] = std::array::from_fn(|h| _mm512_loadu_ps(q.as_ptr().add(h * hd + d)));
                for (j, r) in rows.iter().enumerate() {
                    let k = keys.data.load16(r + d);
                    for h in 0..G {
                        acc[h][j] = _mm512_fmadd_ps(qv[h], k, acc[h][j]);
                    }
                }
            }
            for (h, acc) in acc.iter().enumerate() {
                let s = _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale));
                _mm256_mask_storeu_ps(out.add(h * n + t0), ((1u32 << valid) - 1) as u8, s);
            }
        }
    }

    /// `weighted_sum` for `G` heads (`w` rows `h * n`, `out` `[G, hd]`), `hd` a multiple of 64:
    /// each value row is widened once for all `G` heads.
    #[inline(always)]
    unsafe fn weighted_sum_heads<S: KvSource, const G: usize>(w: *const f32, values: &Rows<'_, S>, out: &mut [f32]) {
        let (n, hd) = (values.len(), values.hd);
        for d in (0..hd).step_by(64) {
            let mut acc: [[__m512; 4]; G] = std::array::from_fn(|h| {
                std::array::from_fn(|i| _mm512_loadu_ps(out.as_ptr().add(h * hd + d + 16 * i)))
            });
            for t0 in (0..n).step_by(VALUE_TILE) {
                let t1 = (t0 + VALUE_TILE).min(n);
                for j in t1..(t1 + VALUE_TILE).min(n) {
                    values.prefetch(j);
                }
                for j in t0..t1 {
                    let v = values.offs[j] + d;
                    // Not `array::from_fn`: a closure does not inherit this function's target
                    // features, so a quantized pool's `load16` inside one was not inlined and
                    // called its intrinsics out of line (int8 decode at 4k: 4.3× slower than f16).
                    let d = &values.data;
                    let vals = [d.load16(v), d.load16(v + 16), d.load16(v + 32), d.load16(v + 48)];
                    for (h, acc) in acc.iter_mut().enumerate() {
                        let s = _mm512_set1_ps(*w.add(h * n + j));
                        for (a, v) in acc.iter_mut().zip(&vals) {
                            *a = _mm512_fmadd_ps(s, *v, *a);
                        }
                    }
                }
            }
            for (h, acc) in acc.iter().enumerate() {
                for (i, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(out.as_mut_ptr().add(h * hd + d + 16 * i), *a);
                }
            }
        }
    }

    impl Vf32 for Avx512 {
        #[inline(always)]
        fn dot(a: &[f32], b: &[f32]) -> f32 {
            Avx2::dot(a, b)
        }

        #[inline(always)]
        fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
            Avx2::axpy(y, alpha, x)
        }

        #[inline(always)]
        fn exp_sum(x: &mut [f32], max: f32) -> f32 {
            Avx2::exp_sum(x, max)
        }

        #[inline(always)]
        fn max(x: &[f32]) -> f32 {
            Avx2::max(x)
        }

        #[inline(always)]
        fn scores<S: KvSource>(q: &[f32], keys: &Rows<'_, S>, scale: f32, out: &mut [f32]) {
            let (n, hd) = (keys.len(), keys.hd);
            if !hd.is_multiple_of(16) || !q.len().is_multiple_of(hd) || out.len() != q.len() / hd * n {
                return scores_by_dot::<Self, S>(q, keys, scale, out);
            }
            let heads = q.len() / hd;
            for h0 in (0..heads).step_by(SCORE_HEADS) {
                let (q, out) = (&q[h0 * hd..], out[h0 * n..].as_mut_ptr());
                // SAFETY: AVX-512 F (see the type's docs); every row is inside `keys.data`
                // (`Rows`), `q` holds the heads from `h0` on and `out` their `n` scores each.
                unsafe {
                    match (heads - h0).min(SCORE_HEADS) {
                        3 => scores_heads::<S, 3>(q, keys, scale, out),
                        2 => scores_heads::<S, 2>(q, keys, scale, out),
                        _ => scores_heads::<S, 1>(q, keys, scale, out),
                    }
                }
            }
        }

        #[inline(always)]
        fn weighted_sum<S: KvSource>(w: &[f32], values: &Rows<'_, S>, out: &mut [f32]) {
            let (n, hd) = (values.len(), values.hd);
            if !hd.is_multiple_of(64) || !out.len().is_multiple_of(hd) || w.len() != out.len() / hd * n {
                return weighted_sum_by_axpy::<Self, S>(w, values, out);
            }
            let heads = out.len() / hd;
            for h0 in (0..heads).step_by(VALUE_HEADS) {
                let (w, out) = (w[h0 * n..].as_ptr(), &mut out[h0 * hd..]);
                // SAFETY: as in `scores`; `w` holds `n` weights per head from `h0` on, `out`
                // those heads' outputs.
                unsafe {
                    match (heads - h0).min(VALUE_HEADS) {
                        4 => weighted_sum_heads::<S, 4>(w, values, out),
                        3 => weighted_sum_heads::<S, 3>(w, values, out),
                        2 => weighted_sum_heads::<S, 2>(w, values, out),
                        _ => weighted_sum_heads::<S, 1>(w, values, out),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_exp_is_accurate() {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn run(x: &mut [f32]) -> f32 {
                Avx2::exp_sum(x, 0.0)
            }
            let inputs: Vec<f32> = (0..2001).map(|i| -90.0 + i as f32 * 0.0475).collect();
            let mut got = inputs.clone();
            // SAFETY: AVX2 and FMA were detected above.
            let sum = unsafe { run(&mut got) };
            let mut want_sum = 0f64;
            for (x, g) in inputs.iter().zip(&got) {
                let want = f64::from(*x).exp();
                want_sum += want;
                let tol = 4e-7 * want + 1e-37;
                assert!((f64::from(*g) - want).abs() <= tol, "exp({x}) = {g}, want {want}");
            }
            assert!((f64::from(sum) - want_sum).abs() <= 1e-5 * want_sum);
        }
    }
}
