//! Shared by the attention tests (`cuda_attention`, `cuda_kv_quant`): head shapes, the
//! attention variants each shape runs, and batches over shuffled block tables.

use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::cpu::AttentionParams;
use ferrite_runtime::ForwardBatch;
use rand::rngs::StdRng;
use rand::Rng;

/// Query heads, KV heads and head dim of one case.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub nh: usize,
    pub nkv: usize,
    pub hd: usize,
}

pub fn params(h: Heads, window: Option<usize>, softcap: Option<f32>) -> AttentionParams {
    AttentionParams {
        n_heads: h.nh,
        n_kv_heads: h.nkv,
        head_dim: h.hd,
        scale: 1.0 / (h.hd as f32).sqrt(),
        window,
        softcap,
        causal: true,
    }
}

/// (params, query amplitude): plain, sliding window, and a soft cap with scores large enough
/// for the cap to bend them.
pub fn variants(h: Heads) -> [(AttentionParams, f32); 3] {
    [(params(h, None, None), 2.0), (params(h, Some(100), None), 2.0), (params(h, None, Some(5.0)), 8.0)]
}

/// A batch of rows `(context, query tokens)` over shuffled blocks of `block` positions of a
/// pool of `pool` blocks.
pub fn shuffled_batch(rng: &mut StdRng, shapes: &[(usize, usize)], pool: usize, block: usize) -> ForwardBatch {
    let mut ids: Vec<u32> = (0..pool as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.random_range(0..=i));
    }
    let mut batch = ForwardBatch::default();
    for &(ctx, len) in shapes {
        let table: Vec<u32> = ids.drain(..ctx.div_ceil(block)).collect();
        batch.push_row(&vec![0; len], ctx, vec![table], RowLogits::None);
    }
    batch
}
