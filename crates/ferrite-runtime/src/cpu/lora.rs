//! LoRA on the CPU: the low-rank update `out[t] += B · (A · x[t])` of each token `t` that runs
//! through an adapter, added to a base projection's output (`B` holds the adapter's scale).
//! The tokens are grouped by adapter, up to `GROUP` of them a task, and the tasks of every
//! adapter that has this projection share one parallel loop: a task reads each row of its
//! adapter's A and B once for all its tokens (not once a token, which made a 64-row decode
//! step read the matrices 64 times). The shrink (`s = A · x[t]`) is a dot product per rank row;
//! the expand runs over `B` stored transposed (`[rank, out]`): the update row is
//! `Σ_r s[r] · Bᵀ[r]`, `rank` contiguous multiply-adds over the output width (vectorised, no
//! horizontal sums), summed in rank order and then added to the output row. Each token's
//! arithmetic is the same in the same order whatever its group, so a token's result never
//! depends on the batch it is in.

use super::SharedMut;
use crate::error::{Result, RuntimeError};
use crate::threads;

/// Tokens of one adapter a task computes together.
const GROUP: usize = 8;

/// One adapted projection: `A` (`[rank, in]`) and `Bᵀ` (`[rank, out]`, times the scale),
/// row-major f32.
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
        let bt = (0..rank * out_features).map(|i| b[(i % out_features) * rank + i / out_features]).collect();
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
}

/// Lanes of `dot` (16 measured slower: 0.69 of the base against 0.83 in the LoRA bench).
const LANES: usize = 8;

/// `a · b` over equal lengths, in `LANES` lanes summed in a fixed order.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The vector width the update is compiled for on this machine. The arithmetic is the same
/// multiplies and adds in the same order at every width (no fused multiply-adds), so the bits
/// are too.
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
        if is_x86_feature_detected!("avx512f") {
            return Simd::Avx512;
        }
        if is_x86_feature_detected!("avx2") {
            return Simd::Avx2;
        }
    }
    Simd::Plain
}

/// `sk[k]` = `A · x[tokens[k]]` (rank values) and `upd[k]` = `Σ_r sk[k][r] · Bᵀ[r]`.
#[inline(always)]
fn update(p: &LoraPair, x: &[f32], tokens: &[usize], sk: &mut [f32], upd: &mut [f32]) {
    let (rank, inp, outw) = (p.rank, p.in_features, p.out_features);
    for (r, a) in p.a.chunks_exact(inp).enumerate() {
        for (k, &t) in tokens.iter().enumerate() {
            sk[k * rank + r] = dot(a, &x[t * inp..(t + 1) * inp]);
        }
    }
    for (r, bt) in p.bt.chunks_exact(outw).enumerate() {
        for (k, u) in upd.chunks_exact_mut(outw).enumerate() {
            let w = sk[k * rank + r];
            u.iter_mut().zip(bt).for_each(|(u, b)| *u += w * b);
        }
    }
}

/// `update` vectorised eight wide.
///
/// # Safety
/// AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn update_avx2(p: &LoraPair, x: &[f32], tokens: &[usize], sk: &mut [f32], upd: &mut [f32]) {
    update(p, x, tokens, sk, upd)
}

/// `update` vectorised sixteen wide.
///
/// # Safety
/// AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn update_avx512(p: &LoraPair, x: &[f32], tokens: &[usize], sk: &mut [f32], upd: &mut [f32]) {
    update(p, x, tokens, sk, upd)
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
    // run of at most GROUP of them.
    let mut order: Vec<(usize, usize)> =
        work.iter().enumerate().map(|(i, (_, p))| (std::ptr::from_ref::<LoraPair>(p) as usize, i)).collect();
    order.sort_unstable();
    let tasks: Vec<&[(usize, usize)]> = order.chunk_by(|a, b| a.0 == b.0).flat_map(|run| run.chunks(GROUP)).collect();
    let dst = SharedMut(out.as_mut_ptr());
    let wide = simd_width();
    threads::for_each_claimed(
        tasks.len(),
        || vec![0f32; 0],
        |s, task| {
            let items = tasks[task];
            let p = work[items[0].1].1;
            let tokens: [usize; GROUP] = std::array::from_fn(|k| items.get(k).map_or(0, |&(_, i)| work[i].0));
            let tokens = &tokens[..items.len()];
            // The rank-wide intermediates of the task's tokens, then their update rows.
            s.clear();
            s.resize(tokens.len() * (p.rank + outw), 0.0);
            let (sk, upd) = s.split_at_mut(tokens.len() * p.rank);
            match wide {
                // SAFETY: the features were detected (`simd_width`).
                #[cfg(target_arch = "x86_64")]
                Simd::Avx512 => unsafe { update_avx512(p, x, tokens, sk, upd) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                Simd::Avx2 => unsafe { update_avx2(p, x, tokens, sk, upd) },
                Simd::Plain => update(p, x, tokens, sk, upd),
            }
            for (&t, u) in tokens.iter().zip(upd.chunks_exact(outw)) {
                // SAFETY: tokens are distinct (checked above) and each is in one task, so each
                // output row is written by one task; row `t` lies inside `out` (checked above),
                // which outlives the loop.
                let row = unsafe { std::slice::from_raw_parts_mut(dst.ptr().add(t * outw), outw) };
                row.iter_mut().zip(u).for_each(|(o, u)| *o += u);
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
