//! Rotary position embedding in the Hugging Face "rotate half" layout.
//!
//! The first `rotary_dim` dims of each head are rotated in pairs `(i, i + rotary_dim / 2)` by
//! the angle `position * inv_freq[i]`; cos and sin are scaled by `attention_scaling` (YaRN's
//! mscale, 1 otherwise). How `inv_freq` is derived from a config (default, linear, dynamic,
//! llama3, yarn) lives with the model configs.

use rayon::prelude::*;

#[derive(Debug, Clone)]
pub struct Rope {
    pub inv_freq: Vec<f32>,
    pub attention_scaling: f32,
}

impl Rope {
    pub fn rotary_dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    /// Rotate `x` (`[tokens, n_heads * head_dim]`) in place, token `t` at `positions[t]`.
    pub fn apply(&self, x: &mut [f32], positions: &[u32], n_heads: usize, head_dim: usize) {
        self.apply_all(&mut [(x, n_heads)], positions, head_dim)
    }

    /// `apply` to several tensors at the same positions (a layer's queries and keys, each
    /// `(x, n_heads)`): each token's angles are computed once for all of them.
    pub fn apply_all(&self, xs: &mut [(&mut [f32], usize)], positions: &[u32], head_dim: usize) {
        let half = self.inv_freq.len();
        for (x, n_heads) in xs.iter() {
            assert!(2 * half <= head_dim && x.len() == positions.len() * n_heads * head_dim, "rope shapes");
        }
        // cos and sin of every token's angles, `[tokens, half]` each.
        let (mut cos, mut sin) = (vec![0f32; positions.len() * half], vec![0f32; positions.len() * half]);
        let angles = |((cos, sin), &pos): ((&mut [f32], &mut [f32]), &u32)| {
            for ((c, s), f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
                let a = pos as f32 * f;
                (*c, *s) = (a.cos() * self.attention_scaling, a.sin() * self.attention_scaling);
            }
        };
        let rotate = |(tok, (cos, sin)): (&mut [f32], (&[f32], &[f32]))| {
            for head in tok.chunks_exact_mut(head_dim) {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = b * cos[i] + a * sin[i];
                }
            }
        };
        // A decode batch's few tokens are cheaper on the calling thread than a parallel loop.
        if positions.len() >= PARALLEL_TOKENS {
            cos.par_chunks_mut(half).zip(sin.par_chunks_mut(half)).zip(positions.par_iter()).for_each(angles);
            for (x, n_heads) in xs.iter_mut() {
                let tables = cos.par_chunks(half).zip(sin.par_chunks(half));
                x.par_chunks_mut(*n_heads * head_dim).zip(tables).for_each(rotate);
            }
        } else {
            cos.chunks_mut(half).zip(sin.chunks_mut(half)).zip(positions).for_each(angles);
            for (x, n_heads) in xs.iter_mut() {
                x.chunks_mut(*n_heads * head_dim).zip(cos.chunks(half).zip(sin.chunks(half))).for_each(rotate);
            }
        }
    }
}

/// From this many tokens on, the angles and rotations run as parallel loops.
const PARALLEL_TOKENS: usize = 64;
