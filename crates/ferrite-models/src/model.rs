//! `CausalLm`: what the engine needs from any architecture — its config, its KV layout, and
//! one forward pass over a flat `ForwardBatch` that returns the requested logits.

use ferrite_runtime::{ForwardBatch, KvCache, KvLayout};

use crate::config::ModelConfig;

pub trait CausalLm: Send + Sync {
    fn config(&self) -> &ModelConfig;

    /// The KV groups and KV-owning layers, in the order `forward` addresses them.
    fn kv_layout(&self) -> KvLayout;

    /// Run the batch: write its tokens' K/V into `kv` and return the logits of the
    /// positions in `batch.logits_indices`, row-major `[logits_indices.len(), vocab]`.
    fn forward(&self, batch: &ForwardBatch, kv: &mut KvCache) -> ferrite_runtime::Result<Vec<f32>>;
}
