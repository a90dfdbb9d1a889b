//! LoRA on the CPU: the low-rank update `out[t] += B · (A · x[t])` of each token `t` that runs
//! through an adapter, added to a base projection's output (`B` holds the adapter's scale).
//! The tokens of every adapter that has this projection share one parallel loop; each
//! token's shrink (`A · x`) and expand (`B · s`) run serially in a fixed order, so a token's
//! result never depends on the batch it is in.

use super::SharedMut;
use crate::error::{Result, RuntimeError};
use crate::threads;

/// One adapted projection: `A` (`[rank, in]`) and `B` (`[out, rank]`, times the scale),
/// row-major f32.
#[derive(Debug, Clone)]
pub struct LoraPair {
    a: Vec<f32>,
    b: Vec<f32>,
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
        Ok(LoraPair { a, b, rank, in_features, out_features })
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

/// `a · b` over equal lengths, in eight lanes summed in a fixed order.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
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
    let dst = SharedMut(out.as_mut_ptr());
    threads::for_each_claimed(
        work.len(),
        || vec![0f32; 0],
        |s, i| {
            let (t, p) = work[i];
            s.clear();
            let xt = &x[t * inp..(t + 1) * inp];
            s.extend(p.a.chunks_exact(inp).map(|a| dot(a, xt)));
            // SAFETY: tokens are distinct (checked above), so each item writes its own row,
            // which lies inside `out` (checked above); `out` outlives the loop.
            let base = dst;
            let row = unsafe { std::slice::from_raw_parts_mut(base.ptr().add(t * outw), outw) };
            for (o, b) in row.iter_mut().zip(p.b.chunks_exact(p.rank)) {
                *o += dot(b, s);
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
}
