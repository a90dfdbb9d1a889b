//! Rotary position embedding in the Hugging Face "rotate half" layout.
//!
//! The first `rotary_dim` dims of each head are rotated in pairs `(i, i + rotary_dim / 2)` by
//! the angle `position * inv_freq[i]`; cos and sin are scaled by `attention_scaling` (YaRN's
//! mscale, 1 otherwise). How `inv_freq` is derived from a config (default, linear, dynamic,
//! llama3, yarn) lives with the model configs.

use std::sync::RwLock;

use rayon::prelude::*;

#[derive(Debug)]
pub struct Rope {
    pub inv_freq: Vec<f32>,
    pub attention_scaling: f32,
    /// cos and sin of the angles of positions `0..n` (`[position][rotary_dim / 2]` each),
    /// grown on demand; `None` computes each call's angles afresh (a schedule that changes
    /// with the sequence length is built per call).
    table: Option<RwLock<Angles>>,
}

#[derive(Debug, Default)]
struct Angles {
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Clone for Rope {
    fn clone(&self) -> Rope {
        Rope {
            inv_freq: self.inv_freq.clone(),
            attention_scaling: self.attention_scaling,
            table: self.table.as_ref().map(|_| RwLock::default()),
        }
    }
}

/// Fewest positions a table holds (it grows to the next power of two past the highest
/// position seen).
const MIN_TABLE: usize = 256;

impl Rope {
    /// A schedule used once or for a few calls: each call computes its tokens' angles.
    pub fn new(inv_freq: Vec<f32>, attention_scaling: f32) -> Rope {
        Rope { inv_freq, attention_scaling, table: None }
    }

    /// A schedule shared by many calls (every layer of a model): the angles of each position
    /// are computed once and kept (SmolLM2 recomputed them in each of its 30 layers, 8–17 ms
    /// of a 1,024-token prefill).
    pub fn tabled(inv_freq: Vec<f32>, attention_scaling: f32) -> Rope {
        Rope { inv_freq, attention_scaling, table: Some(RwLock::default()) }
    }

    pub fn rotary_dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    /// cos and sin of position `pos`'s angles into `cos`, `sin`.
    fn angles(&self, pos: u32, cos: &mut [f32], sin: &mut [f32]) {
        for ((c, s), f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let a = pos as f32 * f;
            (*c, *s) = (a.cos() * self.attention_scaling, a.sin() * self.attention_scaling);
        }
    }

    /// Rotate `x` (`[tokens, n_heads * head_dim]`) in place, token `t` at `positions[t]`.
    pub fn apply(&self, x: &mut [f32], positions: &[u32], n_heads: usize, head_dim: usize) {
        self.apply_all(&mut [(x, n_heads)], positions, head_dim)
    }

    /// `apply` to several tensors at the same positions (a layer's queries and keys, each
    /// `(x, n_heads)`): each token's angles are looked up (or computed) once for all of them.
    pub fn apply_all(&self, xs: &mut [(&mut [f32], usize)], positions: &[u32], head_dim: usize) {
        let half = self.inv_freq.len();
        for (x, n_heads) in xs.iter() {
            assert!(2 * half <= head_dim && x.len() == positions.len() * n_heads * head_dim, "rope shapes");
        }
        let parallel = positions.len() >= PARALLEL_TOKENS;
        let Some(table) = &self.table else {
            // cos and sin of every token's angles, `[tokens, half]` each.
            let (mut cos, mut sin) = (vec![0f32; positions.len() * half], vec![0f32; positions.len() * half]);
            let angles = |((cos, sin), &pos): ((&mut [f32], &mut [f32]), &u32)| self.angles(pos, cos, sin);
            if parallel {
                cos.par_chunks_mut(half).zip(sin.par_chunks_mut(half)).zip(positions.par_iter()).for_each(angles);
            } else {
                cos.chunks_mut(half).zip(sin.chunks_mut(half)).zip(positions).for_each(angles);
            }
            let row = |t: usize| (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
            return rotate_all(xs, head_dim, half, parallel, row);
        };
        let need = positions.iter().max().map_or(0, |&p| p as usize + 1);
        if table.read().unwrap_or_else(|e| e.into_inner()).cos.len() < need * half {
            let mut t = table.write().unwrap_or_else(|e| e.into_inner());
            let have = t.cos.len() / half;
            if have < need {
                let n = need.next_power_of_two().max(MIN_TABLE);
                t.cos.resize(n * half, 0.0);
                t.sin.resize(n * half, 0.0);
                let Angles { cos, sin } = &mut *t;
                let rows = cos[have * half..].chunks_mut(half).zip(sin[have * half..].chunks_mut(half));
                rows.zip(have as u32..).for_each(|((c, s), pos)| self.angles(pos, c, s));
            }
        }
        let t = table.read().unwrap_or_else(|e| e.into_inner());
        let row = |i: usize| {
            let at = positions[i] as usize * half;
            (&t.cos[at..at + half], &t.sin[at..at + half])
        };
        rotate_all(xs, head_dim, half, parallel, row);
    }
}

/// Rotate every head of token `t` of each `(x, heads)` by the cos and sin `row(t)` gives.
fn rotate_all<'a>(
    xs: &mut [(&mut [f32], usize)],
    head_dim: usize,
    half: usize,
    parallel: bool,
    row: impl Fn(usize) -> (&'a [f32], &'a [f32]) + Sync,
) {
    let rotate = |(t, tok): (usize, &mut [f32])| {
        let (cos, sin) = row(t);
        for head in tok.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos[i] - b * sin[i];
                head[i + half] = b * cos[i] + a * sin[i];
            }
        }
    };
    // A decode batch's few tokens are cheaper on the calling thread than a parallel loop.
    for (x, n_heads) in xs.iter_mut() {
        if parallel {
            x.par_chunks_mut(*n_heads * head_dim).enumerate().for_each(rotate);
        } else {
            x.chunks_mut(*n_heads * head_dim).enumerate().for_each(rotate);
        }
    }
}

/// From this many tokens on, the angles and rotations run as parallel loops.
const PARALLEL_TOKENS: usize = 64;

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    /// The table gives exactly the angles computed afresh, while it grows (positions past it,
    /// then below it again), in the serial and the parallel loop; and the rotation is the
    /// "rotate half" one.
    #[test]
    fn tabled_angles_equal_fresh_ones() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::rng().random());
        let (heads, hd) = (3, 16);
        let inv_freq: Vec<f32> = (0..6).map(|i| 10000f32.powf(-(i as f32) / 6.0)).collect();
        let (fresh, tabled) = (Rope::new(inv_freq.clone(), 0.9), Rope::tabled(inv_freq.clone(), 0.9));
        for positions in [vec![3u32, 0, 17], (0..100).map(|_| rng.random_range(0..2000)).collect(), vec![5, 1999, 600]]
        {
            let x: Vec<f32> = (0..positions.len() * heads * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            let (mut a, mut b) = (x.clone(), x.clone());
            fresh.apply(&mut a, &positions, heads, hd);
            tabled.apply(&mut b, &positions, heads, hd);
            assert!(a == b, "tabled rotation differs at positions {positions:?}");
            let (t, h, i) = (positions.len() - 1, heads - 1, 2);
            let at = (t * heads + h) * hd;
            let ang = positions[t] as f32 * inv_freq[i];
            let (c, s) = (ang.cos() * 0.9, ang.sin() * 0.9);
            let want = x[at + i] * c - x[at + i + 6] * s;
            assert!((a[at + i] - want).abs() < 1e-6, "{} vs {want}", a[at + i]);
            assert_eq!(a[at + 13], x[at + 13], "dims past the rotary ones move");
        }
    }
}
