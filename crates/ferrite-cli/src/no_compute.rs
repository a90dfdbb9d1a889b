//! A model that computes nothing, for measuring the engine's own time per step (`bench
//! throughput --no-compute`, the host's share of a GPU step): each step hands back one pick
//! per logits row at once, queued the way a device model's argmax step comes back — a token
//! drawn from the row's last query token, so detokenizing sees varied text — and everything
//! else the engine does (scheduling, block tables, the batch, landing the picks, detokenizing,
//! stop checks, streaming) runs as it does for the real model it wraps.

use std::sync::Arc;

use ferrite_models::config::ModelConfig;
use ferrite_models::model::{CausalLm, Pending, QueuedStep, StepLimits, StepOutput, Want};
use ferrite_runtime::{ForwardBatch, KvCache, KvLayout, KvScheme, Result, RuntimeError};

pub struct NoCompute {
    inner: Arc<dyn CausalLm>,
}

impl NoCompute {
    pub fn wrap(inner: Arc<dyn CausalLm>) -> Arc<dyn CausalLm> {
        Arc::new(NoCompute { inner })
    }
}

/// The picks of a step, handed back when its handle is resolved.
struct Picks(Vec<u32>);

impl QueuedStep for Picks {
    fn wait(self: Box<Self>) -> Result<StepOutput> {
        Ok(StepOutput::Ids(self.0))
    }
}

impl CausalLm for NoCompute {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout()
    }

    fn step(&self, batch: &ForwardBatch, _kv: &mut KvCache, want: Want<'_>) -> Result<Pending> {
        if !matches!(want, Want::Argmax) {
            return Err(RuntimeError::Shape("a model that computes nothing picks greedy tokens only".into()));
        }
        let vocab = self.inner.config().vocab_size as u64;
        let pick = |t: u32| ((u64::from(t) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 17) % vocab;
        let ids = batch.logits_indices.iter().map(|&i| pick(batch.tokens[i]) as u32).collect();
        Ok(Pending::queued(Picks(ids)))
    }

    fn prepare(&self, limits: &StepLimits) -> Result<()> {
        self.inner.prepare(limits)
    }

    fn free_kv_memory(&self) -> Result<Option<usize>> {
        self.inner.free_kv_memory()
    }

    fn kv_block_bytes(&self, block_size: usize, scheme: &KvScheme) -> Result<Vec<usize>> {
        self.inner.kv_block_bytes(block_size, scheme)
    }

    fn new_kv_cache(&self, group_blocks: &[usize], block_size: usize, scheme: &KvScheme) -> Result<KvCache> {
        self.inner.new_kv_cache(group_blocks, block_size, scheme)
    }
}
