//! `KvCache`: the physical storage of the paged KV cache.
//!
//! Every KV-owning layer has a K and a V pool of `num_blocks` blocks; a block holds
//! `block_size` positions. The layout of one pool is `[block][kv_head][slot][head_dim]`, so
//! the attention loop reads one head's keys contiguously. Which blocks a sequence owns is the
//! engine's business (block tables); this type only stores values.

use crate::error::{Result, RuntimeError};

/// Shape of one KV-owning layer and the KV group whose blocks it uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayerSpec {
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub group: usize,
}

/// How a KV group keeps its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvGroupKind {
    /// Every position stays.
    Full,
    /// Only the last `window` positions are read; older blocks are released.
    Sliding { window: usize },
}

/// The KV layout of a model: its groups and its KV-owning layers. Layers that read another
/// layer's KV (shared / donor layers) own nothing and are not listed; the model maps them to
/// their donor's index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    pub groups: Vec<KvGroupKind>,
    pub layers: Vec<KvLayerSpec>,
}

impl KvLayout {
    /// One full-attention group for `n` identical layers.
    pub fn uniform(n: usize, n_kv_heads: usize, head_dim: usize, kind: KvGroupKind) -> KvLayout {
        KvLayout { groups: vec![kind], layers: vec![KvLayerSpec { n_kv_heads, head_dim, group: 0 }; n] }
    }

    /// f32 bytes one block of `block_size` positions takes, per group.
    pub fn block_bytes(&self, block_size: usize) -> Vec<usize> {
        let mut out = vec![0; self.groups.len()];
        for l in &self.layers {
            out[l.group] += 2 * l.n_kv_heads * l.head_dim * block_size * std::mem::size_of::<f32>();
        }
        out
    }
}

pub struct LayerKv {
    pub spec: KvLayerSpec,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

pub struct KvCache {
    layers: Vec<LayerKv>,
    group_blocks: Vec<usize>,
    block_size: usize,
}

impl KvCache {
    /// Storage for `layout` with `group_blocks[g]` blocks of `block_size` in group `g`.
    pub fn new(layout: &KvLayout, group_blocks: &[usize], block_size: usize) -> Result<KvCache> {
        if block_size == 0 || group_blocks.len() != layout.groups.len() || group_blocks.contains(&0) {
            return Err(RuntimeError::Shape(format!(
                "KV cache needs blocks for each of its {} groups: {group_blocks:?} blocks of {block_size}",
                layout.groups.len()
            )));
        }
        let layers = layout
            .layers
            .iter()
            .map(|&spec| {
                let n = group_blocks[spec.group] * block_size * spec.n_kv_heads * spec.head_dim;
                LayerKv { spec, k: vec![0.0; n], v: vec![0.0; n] }
            })
            .collect();
        Ok(KvCache { layers, group_blocks: group_blocks.to_vec(), block_size })
    }

    pub fn group_blocks(&self) -> &[usize] {
        &self.group_blocks
    }

    /// Copy block `src` to `dst` in every layer of `group` (copy-on-write of a shared block).
    pub fn copy_block(&mut self, group: usize, src: u32, dst: u32) {
        let bs = self.block_size;
        for l in self.layers.iter_mut().filter(|l| l.spec.group == group) {
            let n = bs * l.spec.n_kv_heads * l.spec.head_dim;
            let (s, d) = (src as usize * n, dst as usize * n);
            l.k.copy_within(s..s + n, d);
            l.v.copy_within(s..s + n, d);
        }
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
