//! `KvCache`: the physical storage of the paged KV cache.
//!
//! Every KV-owning layer has a K and a V pool of `num_blocks` blocks; a block holds
//! `block_size` positions. The layout of one pool is `[block][kv_head][slot][head_dim]`, so
//! the attention loop reads one head's keys contiguously. Which blocks a sequence owns is the
//! engine's business (block tables); this type only stores values.

use crate::error::{Result, RuntimeError};

/// Shape of one layer's KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayerSpec {
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

pub struct LayerKv {
    pub spec: KvLayerSpec,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

pub struct KvCache {
    layers: Vec<LayerKv>,
    num_blocks: usize,
    block_size: usize,
}

impl KvCache {
    pub fn new(specs: &[KvLayerSpec], num_blocks: usize, block_size: usize) -> Result<KvCache> {
        if block_size == 0 || num_blocks == 0 {
            return Err(RuntimeError::Shape(format!(
                "KV cache needs blocks: {num_blocks} blocks of {block_size}"
            )));
        }
        let layers = specs
            .iter()
            .map(|&spec| {
                let n = num_blocks * block_size * spec.n_kv_heads * spec.head_dim;
                LayerKv { spec, k: vec![0.0; n], v: vec![0.0; n] }
            })
            .collect();
        Ok(KvCache { layers, num_blocks, block_size })
    }

    /// Bytes one token position takes across all layers.
    pub fn bytes_per_token(specs: &[KvLayerSpec]) -> usize {
        specs.iter().map(|s| 2 * s.n_kv_heads * s.head_dim * std::mem::size_of::<f32>()).sum()
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    pub fn layer(&self, i: usize) -> &LayerKv {
        &self.layers[i]
    }
    pub fn layer_mut(&mut self, i: usize) -> &mut LayerKv {
        &mut self.layers[i]
    }
}

impl LayerKv {
    /// Offset of (block, head, slot) in `k`/`v`.
    #[inline]
    pub fn offset(&self, block_size: usize, block: usize, head: usize, slot: usize) -> usize {
        ((block * self.spec.n_kv_heads + head) * block_size + slot) * self.spec.head_dim
    }
}
