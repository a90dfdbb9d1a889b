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
        let half = self.inv_freq.len();
        assert!(2 * half <= head_dim && x.len() == positions.len() * n_heads * head_dim, "rope shapes");
        let token = |(tok, &pos): (&mut [f32], &u32)| {
            let (cos, sin): (Vec<f32>, Vec<f32>) = self
                .inv_freq
                .iter()
                .map(|f| {
                    let a = pos as f32 * f;
                    (a.cos() * self.attention_scaling, a.sin() * self.attention_scaling)
                })
                .unzip();
            for head in tok.chunks_exact_mut(head_dim) {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = b * cos[i] + a * sin[i];
                }
            }
        };
        // A few tokens (decode) are cheaper on the calling thread than a parallel loop.
        if positions.len() >= 8 {
            x.par_chunks_mut(n_heads * head_dim).zip(positions.par_iter()).for_each(token);
        } else {
            x.chunks_mut(n_heads * head_dim).zip(positions).for_each(token);
        }
    }
}
