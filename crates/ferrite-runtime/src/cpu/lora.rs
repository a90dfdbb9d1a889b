//! LoRA on the CPU: the low-rank update `out[t] += B · (A · x[t])` of each token `t` that runs
//! through an adapter, added to a base projection's output (`B` holds the adapter's scale).
//! The tokens are grouped by adapter, up to `GROUP` of them a task, and the tasks of every
//! adapter that has this projection share one parallel loop: a task reads its adapter's A and
//! B once for all its tokens (not once a token, which made a 64-row decode step read the
//! matrices 64 times). The shrink (`s = A · x[t]`) is a dot product per rank row; the expand
//! runs over `B` stored transposed (`[rank, out]`, in panels of 32 columns): the update row
//! is `Σ_r s[r] · Bᵀ[r]`, `rank` contiguous multiply-adds over the output width (no
//! horizontal sums), summed in rank order and then added to the output row. With AVX2 or
//! AVX-512 both are tiled in registers (`x86`): several rank rows × tokens of dot products at
//! once, so their adds overlap, and the expand's sums kept in registers over the rank. Each
//! token's arithmetic is the same in the same order whatever its group, tile or vector width,
//! so a token's result never depends on the batch it is in.

use super::SharedMut;
use crate::error::{Result, RuntimeError};
use crate::threads;

/// Tokens of one adapter a task computes together.
const GROUP: usize = 8;

/// Columns of a panel of `Bᵀ`.
const PANEL: usize = 32;

/// One adapted projection: `A` (`[rank, in]`, row-major) and `Bᵀ` (`[rank, out]`, times the
/// scale) in panels of `PANEL` columns (the last may be narrower), each panel's `rank` rows
/// contiguous: the expand, which runs over one panel's columns for all its tokens, reads it
/// as one stream, not `rank` streams `out` values apart. All f32.
#[derive(Debug, Clone)]
pub struct LoraPair {
    a: Vec<f32>,
    bt: Vec<f32>,
    rank: usize,
    in_features: usize,
    out_features: usize,
}

impl LoraPair {
    /// `a` is `[rank, in_features]`, `b` is `[out_features, rank]`; `b` is multiplied by
    /// `scale` here.
    pub fn new(a: Vec<f32>, mut b: Vec<f32>, rank: usize, in_features: usize, scale: f32) -> Result<LoraPair> {
        if rank == 0 || a.len() != rank * in_features || !b.len().is_multiple_of(rank) {
            return Err(RuntimeError::Shape(format!(
                "LoRA A of {} values for rank {rank} × {in_features}, B of {} values",
                a.len(),
                b.len()
            )));
        }
        let out_features = b.len() / rank;
        b.iter_mut().for_each(|v| *v *= scale);
        let mut bt = Vec::with_capacity(rank * out_features);
        for c0 in (0..out_features).step_by(PANEL) {
            let c1 = (c0 + PANEL).min(out_features);
            for r in 0..rank {
                bt.extend((c0..c1).map(|c| b[c * rank + r]));
            }
        }
        Ok(LoraPair { a, bt, rank, in_features, out_features })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn in_features(&self) -> usize {
        self.in_features
    }
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// The panels of `Bᵀ`: (first column, width, the panel's `[rank, width]` values).
    fn panels(&self) -> impl Iterator<Item = (usize, usize, &[f32])> {
        (0..self.out_features).step_by(PANEL).map(|c0| {
            let w = PANEL.min(self.out_features - c0);
            (c0, w, &self.bt[c0 * self.rank..(c0 + w) * self.rank])
        })
    }
}

/// Lanes of the shrink's dot products (16 measured slower: 0.69 of the base against 0.83 in
/// the LoRA bench).
const LANES: usize = 8;

/// A dot product's end: its lanes summed in order, then its tail (`a` and `b`'s last
/// `len % LANES` values) summed in order.
#[inline(always)]
fn dot_finish(acc: &[f32; LANES], a_tail: &[f32], b_tail: &[f32]) -> f32 {
    let tail: f32 = a_tail.iter().zip(b_tail).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// `a · b` over equal lengths: lane `i` sums `a[j] * b[j]` over `j ≡ i (mod LANES)` in
/// order, then `dot_finish`.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    dot_finish(&acc, ta, tb)
}

/// The update without SIMD: token by token, `sk[k][r] = A[r] · x[tokens[k]]` by `dot`, then
/// per panel of columns the update `Σ_r sk[k][r] · Bᵀ[r]` summed from 0 in rank order and
/// added to the output row. The SIMD kernels (`x86`) compute every value in the same order.
///
/// # Safety
/// Each of `outs` is valid for writes of `out_features` values, and no other thread touches
/// them.
unsafe fn update_plain(p: &LoraPair, x: &[f32], tokens: &[usize], sk: &mut [f32], outs: &[*mut f32]) {
    let (rank, inp, outw) = (p.rank, p.in_features, p.out_features);
    for ((&t, s), &o) in tokens.iter().zip(sk.chunks_exact_mut(rank)).zip(outs) {
        let xt = &x[t * inp..(t + 1) * inp];
        for (s, a) in s.iter_mut().zip(p.a.chunks_exact(inp)) {
            *s = dot(a, xt);
        }
        // SAFETY: the caller's.
        let o = unsafe { std::slice::from_raw_parts_mut(o, outw) };
        for (c0, w, panel) in p.panels() {
            let mut u = [0f32; PANEL];
            for (&s, bt) in s.iter().zip(panel.chunks_exact(w)) {
                u.iter_mut().zip(bt).for_each(|(u, b)| *u += s * b);
            }
            o[c0..c0 + w].iter_mut().zip(u).for_each(|(o, u)| *o += u);
        }
    }
}

/// The update with AVX2 or AVX-512, tiled in registers: the shrink computes `RS` rank rows ×
/// `KS` tokens of dot products at once (`RS × KS` independent chains of 8-lane adds, where
/// one dot product at a time waits on each add), the expand `KE` tokens × `CE` vectors of
/// columns, summing over the rank in registers and adding to the output row once (no update
/// rows in memory). Every value gets the multiplies and adds of `update_plain` in the same
/// order, so the same bits.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{dot_finish, LoraPair, LANES};

    /// An f32 vector of the expand (its width changes no value: each column is its own sum).
    pub(super) trait Wide: Copy {
        const N: usize;
        unsafe fn zero() -> Self;
        unsafe fn splat(v: f32) -> Self;
        unsafe fn load(p: *const f32) -> Self;
        unsafe fn store(self, p: *mut f32);
        unsafe fn mul(self, o: Self) -> Self;
        unsafe fn add(self, o: Self) -> Self;
    }

    /// `Wide` for a vector type from its intrinsics.
    macro_rules! wide {
        ($ty:ty, $n:expr, $zero:ident, $splat:ident, $load:ident, $store:ident, $mul:ident, $add:ident) => {
            impl Wide for $ty {
                const N: usize = $n;
                #[inline(always)]
                unsafe fn zero() -> Self {
                    unsafe { $zero() }
                }
                #[inline(always)]
                unsafe fn splat(v: f32) -> Self {
                    unsafe { $splat(v) }
                }
                #[inline(always)]
                unsafe fn load(p: *const f32) -> Self {
                    unsafe { $load(p) }
                }
                #[inline(always)]
                unsafe fn store(self, p: *mut f32) {
                    unsafe { $store(p, self) }
                }
                #[inline(always)]
                unsafe fn mul(self, o: Self) -> Self {
                    unsafe { $mul(self, o) }
                }
                #[inline(always)]
                unsafe fn add(self, o: Self) -> Self {
                    unsafe { $add(self, o) }
                }
            }
        };
    }
    wide!(
        __m256,
        8,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_mul_ps,
        _mm256_add_ps
    );
    wide!(
        __m512,
        16,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_mul_ps,
        _mm512_add_ps
    );

    /// `sk[k * rank + r0 + i]` = `A[r0 + i] · xs[k]` for `i < R`, `k < K`, `xs` the tokens'
    /// input rows: lane `l` of each sums `A[r][j] * x[j]` over `j ≡ l (mod 8)` in order, as
    /// `dot`.
    ///
    /// # Safety
    /// AVX; rows `r0..r0 + R` of A exist.
    #[inline(always)]
    unsafe fn shrink_tile<const R: usize, const K: usize>(p: &LoraPair, r0: usize, xs: [&[f32]; K], sk: &mut [f32]) {
        let inp = p.in_features;
        let body = inp - inp % LANES;
        let a: [&[f32]; R] = std::array::from_fn(|i| &p.a[(r0 + i) * inp..(r0 + i + 1) * inp]);
        // SAFETY: AVX (the caller's); every load reads 8 values of a row of `inp` below `body`.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); K]; R];
            let mut j = 0;
            while j < body {
                let av: [__m256; R] = std::array::from_fn(|i| _mm256_loadu_ps(a[i].as_ptr().add(j)));
                let xv: [__m256; K] = std::array::from_fn(|k| _mm256_loadu_ps(xs[k].as_ptr().add(j)));
                for i in 0..R {
                    for k in 0..K {
                        acc[i][k] = _mm256_add_ps(acc[i][k], _mm256_mul_ps(av[i], xv[k]));
                    }
                }
                j += LANES;
            }
            for i in 0..R {
                for k in 0..K {
                    let lanes: [f32; LANES] = std::mem::transmute(acc[i][k]);
                    sk[k * p.rank + r0 + i] = dot_finish(&lanes, &a[i][body..], &xs[k][body..]);
                }
            }
        }
    }

    /// Rank rows `r0..r0 + R`'s shrink for every token, `KS` tokens at a time (fewer for the
    /// last): the rows' slice of A stays in L1 while the tokens pass.
    ///
    /// # Safety
    /// AVX; rows `r0..r0 + R` of A exist.
    #[inline(always)]
    unsafe fn shrink_rows<const R: usize, const KS: usize>(
        p: &LoraPair,
        r0: usize,
        x: &[f32],
        tokens: &[usize],
        sk: &mut [f32],
    ) {
        let inp = p.in_features;
        let row = |t: usize| &x[t * inp..(t + 1) * inp];
        let (n, rank) = (tokens.len(), p.rank);
        let mut k = 0;
        while k < n {
            let left = n - k;
            let s = &mut sk[k * rank..];
            // SAFETY: the caller's.
            unsafe {
                if left >= KS {
                    shrink_tile::<R, KS>(p, r0, std::array::from_fn(|i| row(tokens[k + i])), s);
                    k += KS;
                } else if left >= 2 {
                    shrink_tile::<R, 2>(p, r0, std::array::from_fn(|i| row(tokens[k + i])), s);
                    k += 2;
                } else {
                    shrink_tile::<R, 1>(p, r0, [row(tokens[k])], s);
                    k += 1;
                }
            }
        }
    }

    /// The expand of `K` tokens (their intermediates `sk`, `[K, rank]`) over columns `c..c + C
    /// · V::N` of a panel of `Bᵀ` (`[rank, w]` from `panel`, its first column `c0` of the
    /// output) into their output rows `outs`: the update summed from 0 over the rank in
    /// order, then added to the row.
    ///
    /// # Safety
    /// The vector's instructions; `outs` as `update_plain`'s; the columns exist.
    #[inline(always)]
    unsafe fn expand_tile<V: Wide, const K: usize, const C: usize>(
        panel: *const f32,
        w: usize,
        rank: usize,
        sk: &[f32],
        c0: usize,
        c: usize,
        outs: [*mut f32; K],
    ) {
        // SAFETY: the caller's; the panel has `rank` rows of `w`, `sk` K rows of `rank`.
        unsafe {
            let mut acc = [[V::zero(); C]; K];
            for r in 0..rank {
                let b: [V; C] = std::array::from_fn(|i| V::load(panel.add(r * w + c + i * V::N)));
                for (k, acc) in acc.iter_mut().enumerate() {
                    let s = V::splat(*sk.get_unchecked(k * rank + r));
                    for (acc, &b) in acc.iter_mut().zip(&b) {
                        *acc = acc.add(s.mul(b));
                    }
                }
            }
            for (acc, &o) in acc.iter().zip(&outs) {
                for (i, &acc) in acc.iter().enumerate() {
                    let o = o.add(c0 + c + i * V::N);
                    V::load(o).add(acc).store(o);
                }
            }
        }
    }

    /// A panel's columns `c..c + C · V::N`, expanded for every token, `KE` tokens at a time
    /// (fewer for the last): the columns' slice of the panel stays in L1 while the tokens
    /// pass.
    ///
    /// # Safety
    /// As `expand_tile`.
    #[inline(always)]
    unsafe fn expand_columns<V: Wide, const KE: usize, const C: usize>(
        panel: *const f32,
        w: usize,
        rank: usize,
        sk: &[f32],
        c0: usize,
        c: usize,
        outs: &[*mut f32],
    ) {
        let n = outs.len();
        let mut k = 0;
        while k < n {
            let left = n - k;
            let s = &sk[k * rank..];
            // SAFETY: the caller's.
            unsafe {
                if left >= KE {
                    expand_tile::<V, KE, C>(panel, w, rank, s, c0, c, std::array::from_fn(|i| outs[k + i]));
                    k += KE;
                } else if left >= 4 {
                    expand_tile::<V, 4, C>(panel, w, rank, s, c0, c, std::array::from_fn(|i| outs[k + i]));
                    k += 4;
                } else if left >= 2 {
                    expand_tile::<V, 2, C>(panel, w, rank, s, c0, c, std::array::from_fn(|i| outs[k + i]));
                    k += 2;
                } else {
                    expand_tile::<V, 1, C>(panel, w, rank, s, c0, c, [outs[k]]);
                    k += 1;
                }
            }
        }
    }

    /// `update_plain`'s values, tiled: the shrink `RS` rank rows × `KS` tokens at a time
    /// (rank rows outside, tokens inside), the expand `KE` tokens × `CE` vectors of columns
    /// (columns outside, tokens inside), so each slice of A and Bᵀ is read from memory once
    /// for all the tokens.
    ///
    /// # Safety
    /// The vector's instructions, and `update_plain`'s.
    #[inline(always)]
    unsafe fn update<V: Wide, const RS: usize, const KS: usize, const KE: usize, const CE: usize>(
        p: &LoraPair,
        x: &[f32],
        tokens: &[usize],
        sk: &mut [f32],
        outs: &[*mut f32],
    ) {
        let rank = p.rank;
        let mut r = 0;
        // SAFETY (the loops): the caller's; each tile's rows and columns exist.
        while r < rank {
            let left = rank - r;
            unsafe {
                if left >= RS {
                    shrink_rows::<RS, KS>(p, r, x, tokens, sk);
                    r += RS;
                } else if left >= 2 {
                    shrink_rows::<2, KS>(p, r, x, tokens, sk);
                    r += 2;
                } else {
                    shrink_rows::<1, KS>(p, r, x, tokens, sk);
                    r += 1;
                }
            }
        }
        for (c0, w, panel) in p.panels() {
            let (panel, mut c) = (panel.as_ptr(), 0);
            // SAFETY: the caller's; each tile's columns lie inside the panel.
            unsafe {
                while c + CE * V::N <= w {
                    expand_columns::<V, KE, CE>(panel, w, rank, sk, c0, c, outs);
                    c += CE * V::N;
                }
                while c + V::N <= w {
                    expand_columns::<V, KE, 1>(panel, w, rank, sk, c0, c, outs);
                    c += V::N;
                }
                for c in c..w {
                    for (k, &o) in outs.iter().enumerate() {
                        let mut u = 0f32;
                        for r in 0..rank {
                            u += sk[k * rank + r] * *panel.add(r * w + c);
                        }
                        *o.add(c0 + c) += u;
                    }
                }
            }
        }
    }

    /// `update` on AVX2's sixteen 256-bit registers.
    ///
    /// # Safety
    /// AVX2, and `update_plain`'s.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn update_avx2(p: &LoraPair, x: &[f32], tokens: &[usize], sk: &mut [f32], outs: &[*mut f32]) {
        // SAFETY: the caller's.
        unsafe { update::<__m256, 2, 4, 4, 2>(p, x, tokens, sk, outs) }
    }

    /// `update` on AVX-512's thirty-two registers (VL: the shrink's 256-bit vectors use all
    /// of them too).
    ///
    /// # Safety
    /// AVX-512 F and VL, and `update_plain`'s.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub(super) unsafe fn update_avx512(p: &LoraPair, x: &[f32], tokens: &[usize], sk: &mut [f32], outs: &[*mut f32]) {
        // SAFETY: the caller's.
        unsafe { update::<__m512, 4, 4, 8, 2>(p, x, tokens, sk, outs) }
    }
}

/// The vector width the update is compiled for on this machine. The arithmetic is the same
/// multiplies and adds in the same order at every width and tiling (no fused multiply-adds),
/// so the bits are too.
#[derive(Clone, Copy)]
enum Simd {
    Plain,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

fn simd_width() -> Simd {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl") {
            return Simd::Avx512;
        }
        if is_x86_feature_detected!("avx2") {
            return Simd::Avx2;
        }
    }
    Simd::Plain
}

/// The tasks of `runs` (each one adapter's work items): each run cut into near-equal pieces of
/// at most `max_group` items, and the longest pieces cut further while there are fewer tasks
/// than `threads` (every thread gets work, where the tokens allow).
fn split_runs<'a, T>(runs: &[&'a [T]], max_group: usize, threads: usize) -> Vec<&'a [T]> {
    let mut pieces: Vec<usize> = runs.iter().map(|r| r.len().div_ceil(max_group.max(1))).collect();
    while pieces.iter().sum::<usize>() < threads {
        // The run whose pieces are longest, if any can be cut further.
        let Some(i) =
            (0..runs.len()).filter(|&i| pieces[i] < runs[i].len()).max_by_key(|&i| runs[i].len().div_ceil(pieces[i]))
        else {
            break;
        };
        pieces[i] += 1;
    }
    let mut tasks = Vec::with_capacity(pieces.iter().sum());
    for (run, &n) in runs.iter().zip(&pieces) {
        let (len, mut at) = (run.len(), 0);
        for k in 0..n {
            let end = (k + 1) * len / n;
            tasks.push(&run[at..end]);
            at = end;
        }
    }
    tasks
}

/// For each `(token, pair)` of `work` (tokens strictly increasing): row `token` of `out`
/// (`[t, out_features]`) gains `pair`'s update of row `token` of `x` (`[t, in_features]`).
/// Every pair must have the same in and out features.
pub fn lora_add(x: &[f32], work: &[(usize, &LoraPair)], out: &mut [f32]) -> Result<()> {
    let Some(&(_, first)) = work.first() else { return Ok(()) };
    let (inp, outw) = (first.in_features, first.out_features);
    let rows = |len: usize, width: usize| len.checked_div(width).unwrap_or(0);
    let (x_rows, out_rows) = (rows(x.len(), inp), rows(out.len(), outw));
    let mut last = None;
    for &(t, p) in work {
        if p.in_features != inp || p.out_features != outw {
            return Err(RuntimeError::Shape(format!(
                "LoRA pairs of one projection differ: {}→{} and {inp}→{outw}",
                p.in_features, p.out_features
            )));
        }
        if last.is_some_and(|l| t <= l) || t >= x_rows || t >= out_rows {
            return Err(RuntimeError::Shape(format!("LoRA token {t} out of order or past {x_rows} rows")));
        }
        last = Some(t);
    }
    // Work items by adapter (its pair's address), in token order within each; a task is a
    // piece of one adapter's run of at most GROUP of them.
    let mut order: Vec<(usize, usize)> =
        work.iter().enumerate().map(|(i, (_, p))| (std::ptr::from_ref::<LoraPair>(p) as usize, i)).collect();
    order.sort_unstable();
    let runs: Vec<&[(usize, usize)]> = order.chunk_by(|a, b| a.0 == b.0).collect();
    let tasks = split_runs(&runs, GROUP, rayon::current_num_threads());
    let dst = SharedMut(out.as_mut_ptr());
    let wide = simd_width();
    threads::for_each_claimed(
        tasks.len(),
        || (Vec::new(), Vec::new(), Vec::new()),
        |(s, tokens, outs): &mut (Vec<f32>, Vec<usize>, Vec<*mut f32>), task| {
            let items = tasks[task];
            let p = work[items[0].1].1;
            tokens.clear();
            tokens.extend(items.iter().map(|&(_, i)| work[i].0));
            // SAFETY: tokens are distinct (checked above) and each is in one task, so each
            // output row is written by one task; row `t` lies inside `out` (checked above),
            // which outlives the loop.
            outs.clear();
            outs.extend(tokens.iter().map(|&t| unsafe { dst.ptr().add(t * outw) }));
            // The rank-wide intermediates of the task's tokens.
            s.clear();
            s.resize(tokens.len() * p.rank, 0.0);
            let (s, tokens, outs) = (&mut s[..], &tokens[..], &outs[..]);
            match wide {
                // SAFETY: the features were detected (`simd_width`); the rows as above.
                #[cfg(target_arch = "x86_64")]
                Simd::Avx512 => unsafe { x86::update_avx512(p, x, tokens, s, outs) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                Simd::Avx2 => unsafe { x86::update_avx2(p, x, tokens, s, outs) },
                // SAFETY: the rows as above.
                Simd::Plain => unsafe { update_plain(p, x, tokens, s, outs) },
            }
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_the_scaled_low_rank_update_to_the_listed_tokens() {
        // rank 2, 3 → 2; A = [[1,0,1],[0,2,0]], B = [[1,1],[0,-1]], scale 0.5.
        let p = LoraPair::new(vec![1., 0., 1., 0., 2., 0.], vec![1., 1., 0., -1.], 2, 3, 0.5).unwrap();
        let x = [1., 2., 3., 10., 20., 30.];
        let mut out = [1., 1., 1., 1.];
        lora_add(&x, &[(1, &p)], &mut out).unwrap();
        // token 1: A·x = [40, 40]; B·s·0.5 = [40, -20]; token 0 untouched.
        assert_eq!(out, [1., 1., 41., -19.]);
        assert!(lora_add(&x, &[(1, &p), (1, &p)], &mut out).is_err());
        assert!(lora_add(&x, &[(2, &p)], &mut out).is_err());
    }

    /// The update as it was first written (one dot product at a time, the update rows summed
    /// in memory, then added), from `a` (`[rank, in]`) and `b` (`[out, rank]`) times `scale`:
    /// the tiled kernels must give its bits at every width.
    #[allow(clippy::too_many_arguments)]
    fn reference(a: &[f32], b: &[f32], scale: f32, rank: usize, x: &[f32], tokens: &[usize], out: &mut [f32]) {
        let dot = |a: &[f32], b: &[f32]| {
            let mut acc = [0f32; LANES];
            let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
            let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
            for (x, y) in ca.zip(cb) {
                for i in 0..LANES {
                    acc[i] += x[i] * y[i];
                }
            }
            acc.iter().sum::<f32>() + tail
        };
        let (inp, outw) = (a.len() / rank, b.len() / rank);
        for &t in tokens {
            let s: Vec<f32> = a.chunks_exact(inp).map(|a| dot(a, &x[t * inp..(t + 1) * inp])).collect();
            let mut u = vec![0f32; outw];
            for (r, &s) in s.iter().enumerate() {
                u.iter_mut().enumerate().for_each(|(c, u)| *u += s * (b[c * rank + r] * scale));
            }
            out[t * outw..(t + 1) * outw].iter_mut().zip(&u).for_each(|(o, u)| *o += u);
        }
    }

    #[test]
    fn tiles_give_the_bits_of_the_plain_update_at_every_width() {
        let val = |i: usize, salt: usize| ((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.0 - 1.0;
        for (rank, inp, outw) in
            [(16, 64, 48), (1, 7, 5), (3, 37, 29), (5, 40, 33), (17, 91, 70), (64, 24, 17), (16, 576, 192)]
        {
            let a: Vec<f32> = (0..rank * inp).map(|i| val(i, rank)).collect();
            let b: Vec<f32> = (0..outw * rank).map(|i| val(i, rank + 1)).collect();
            let p = LoraPair::new(a.clone(), b.clone(), rank, inp, 0.75).unwrap();
            let t = 13;
            let x: Vec<f32> = (0..t * inp).map(|i| val(i, 11)).collect();
            let base: Vec<f32> = (0..t * outw).map(|i| val(i, 12)).collect();
            for n in 1..=t {
                let tokens: Vec<usize> = (0..n).map(|k| (k * 5 + 2) % t).collect();
                let mut want = base.clone();
                reference(&a, &b, 0.75, rank, &x, &tokens, &mut want);
                let mut widths: Vec<Simd> = vec![Simd::Plain];
                #[cfg(target_arch = "x86_64")]
                {
                    if is_x86_feature_detected!("avx2") {
                        widths.push(Simd::Avx2);
                    }
                    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl") {
                        widths.push(Simd::Avx512);
                    }
                }
                for wide in widths {
                    let mut got = base.clone();
                    let rows = got.as_mut_ptr();
                    // SAFETY: each row lies inside `got`.
                    let outs: Vec<*mut f32> = tokens.iter().map(|&t| unsafe { rows.add(t * outw) }).collect();
                    let mut sk = vec![0f32; n * rank];
                    // SAFETY: distinct rows of `got`, features detected.
                    unsafe {
                        match wide {
                            #[cfg(target_arch = "x86_64")]
                            Simd::Avx512 => x86::update_avx512(&p, &x, &tokens, &mut sk, &outs),
                            #[cfg(target_arch = "x86_64")]
                            Simd::Avx2 => x86::update_avx2(&p, &x, &tokens, &mut sk, &outs),
                            Simd::Plain => update_plain(&p, &x, &tokens, &mut sk, &outs),
                        }
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "rank {rank}, {inp} → {outw}, {n} tokens");
                }
            }
        }
    }

    /// Tokens of three adapters interleaved, more than a group of each: every token gets the
    /// bits of its own update computed alone.
    #[test]
    fn grouped_tokens_get_the_bits_of_each_alone() {
        let (inp, outw, t) = (37, 29, 41);
        let val = |i: usize, salt: usize| ((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.0 - 1.0;
        let pairs: Vec<LoraPair> = [1usize, 5, 16]
            .iter()
            .enumerate()
            .map(|(k, &r)| {
                let a = (0..r * inp).map(|i| val(i, 3 * k)).collect();
                let b = (0..outw * r).map(|i| val(i, 3 * k + 1)).collect();
                LoraPair::new(a, b, r, inp, 0.5 + k as f32).unwrap()
            })
            .collect();
        let x: Vec<f32> = (0..t * inp).map(|i| val(i, 11)).collect();
        let base: Vec<f32> = (0..t * outw).map(|i| val(i, 12)).collect();
        let work: Vec<(usize, &LoraPair)> = (0..t).filter(|i| i % 4 != 3).map(|i| (i, &pairs[i % 3])).collect();
        let mut together = base.clone();
        lora_add(&x, &work, &mut together).unwrap();
        for &(tok, p) in &work {
            let mut alone = base.clone();
            lora_add(&x, &[(tok, p)], &mut alone).unwrap();
            assert_eq!(alone[tok * outw..(tok + 1) * outw], together[tok * outw..(tok + 1) * outw], "token {tok}");
        }
        assert_eq!(together[3 * outw..4 * outw], base[3 * outw..4 * outw], "a base token is untouched");
    }
}
