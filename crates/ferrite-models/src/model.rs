//! `CausalLm`: what the engine needs from any architecture — its config, its KV layout and
//! storage, and one forward pass over a flat `ForwardBatch` that returns the requested logits
//! (or, for greedy rows, just the chosen ids; a device model may also sample there).
//!
//! A model on the CPU keeps its KV cache in host memory (the defaults below); a model on a
//! CUDA device allocates it on the device, sizes it from the device's free memory, and picks
//! tokens there, so the engine, scheduler and prefix cache are the same for both. Such a
//! model may also queue a step and hand its picks back later (`queue_step`, `take_picks`), so
//! the engine schedules the next step while the device runs this one.

use ferrite_runtime::sampling::{RowSampler, SampledToken};
use ferrite_runtime::{cpu, threads};
use ferrite_runtime::{ForwardBatch, KvCache, KvLayout};

use crate::config::ModelConfig;

/// The largest step the engine will run, told to the model before the first one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLimits {
    /// Query tokens per step.
    pub max_tokens: usize,
    /// Rows (sequences) per step.
    pub max_rows: usize,
    /// Longest sequence.
    pub max_model_len: usize,
    /// Positions per KV block.
    pub block_size: usize,
}

/// The picks of a queued step (`CausalLm::take_picks`), one per logits row.
#[derive(Debug, Clone, PartialEq)]
pub enum Picks {
    /// The argmax of each row.
    Ids(Vec<u32>),
    /// Drawn as the step's row samplers said.
    Sampled(Vec<SampledToken>),
}

pub trait CausalLm: Send + Sync {
    fn config(&self) -> &ModelConfig;

    /// The KV groups and KV-owning layers, in the order `forward` addresses them.
    fn kv_layout(&self) -> KvLayout;

    /// Run the batch: write its tokens' K/V into `kv` and return the logits of the
    /// positions in `batch.logits_indices`, row-major `[logits_indices.len(), vocab]`.
    fn forward(&self, batch: &ForwardBatch, kv: &mut KvCache) -> ferrite_runtime::Result<Vec<f32>>;

    /// Like `forward`, but return the argmax token of each logits position (lowest id on
    /// ties). A device model picks them on the device and copies only the ids back.
    fn forward_greedy(&self, batch: &ForwardBatch, kv: &mut KvCache) -> ferrite_runtime::Result<Vec<u32>> {
        let vocab = self.config().vocab_size;
        let logits = self.forward(batch, kv)?;
        // One row per task: the rows of a decode batch are independent (8 × 49,152 logits
        // scanned serially were ~0.4 ms of a SmolLM2 step).
        let rows = logits.len() / vocab;
        Ok(threads::map_claimed(rows, || (), |_, i| cpu::argmax(&logits[i * vocab..(i + 1) * vocab]) as u32))
    }

    /// Whether `forward_sampled` picks tokens on the model's device.
    fn samples_on_device(&self) -> bool {
        false
    }

    /// Like `forward`, but pick the token of each logits position on the device as `rows`
    /// (one per position, in order) says, and hand back only the picks. Only called when
    /// `samples_on_device`.
    fn forward_sampled(
        &self,
        _batch: &ForwardBatch,
        _kv: &mut KvCache,
        _rows: &[RowSampler],
    ) -> ferrite_runtime::Result<Vec<SampledToken>> {
        let why = "this model does not sample on a device".into();
        Err(ferrite_runtime::cuda::CudaError::Unsupported(why).into())
    }

    /// Whether the model can queue a step and hand its picks back later (`queue_step`,
    /// `take_picks`).
    fn queues_steps(&self) -> bool {
        false
    }

    /// Queue `batch` and return before it has run. Its logits rows are picked on the device —
    /// the argmax, or as `samplers` says (one per row) — and handed back by `take_picks`.
    /// `carried` lists (token index in `batch`, logits row of the step queued just before):
    /// that token's id is the earlier step's pick, still on the device (the id in `batch` is
    /// a placeholder). Only called when `queues_steps`.
    fn queue_step(
        &self,
        _batch: &ForwardBatch,
        _kv: &mut KvCache,
        _samplers: Option<&[RowSampler]>,
        _carried: &[(usize, usize)],
    ) -> ferrite_runtime::Result<()> {
        let why = "this model does not queue steps".into();
        Err(ferrite_runtime::cuda::CudaError::Unsupported(why).into())
    }

    /// The picks of the oldest queued step, once it has run.
    fn take_picks(&self) -> ferrite_runtime::Result<Picks> {
        let why = "this model does not queue steps".into();
        Err(ferrite_runtime::cuda::CudaError::Unsupported(why).into())
    }

    /// Whether `forward` runs its ops on the host's thread pool (a CPU model): the engine then
    /// calls it from a pool worker (`ferrite_runtime::threads::run`), so each op forks within
    /// the pool. A device model only queues work and waits for its device; it is called
    /// directly, without a hop to a pool thread and back on every step.
    fn uses_host_pool(&self) -> bool {
        true
    }

    /// Reserve what steps up to `limits` need (device workspaces); called once before
    /// `kv_memory_budget`.
    fn prepare(&self, _limits: &StepLimits) -> ferrite_runtime::Result<()> {
        Ok(())
    }

    /// Free bytes of the memory the KV cache would live in, when the model sizes it (a
    /// device model: the device's free memory); None: the engine's default sizing.
    fn free_kv_memory(&self) -> ferrite_runtime::Result<Option<usize>> {
        Ok(None)
    }

    /// Bytes one block of `block_size` positions takes in each KV group of `new_kv_cache`'s
    /// storage.
    fn kv_block_bytes(&self, block_size: usize) -> Vec<usize> {
        self.kv_layout().block_bytes(block_size)
    }

    /// The KV storage `forward` reads: `group_blocks[g]` blocks of `block_size` in group g.
    fn new_kv_cache(&self, group_blocks: &[usize], block_size: usize) -> ferrite_runtime::Result<KvCache> {
        KvCache::new(&self.kv_layout(), group_blocks, block_size)
    }
}

/// Run `f`, a forward of `model`, where it runs best: on a pool worker for a model whose ops
/// use the host's thread pool (`CausalLm::uses_host_pool`), directly for a device model.
pub fn run_forward<R: Send>(model: &dyn CausalLm, f: impl FnOnce() -> R + Send) -> R {
    if model.uses_host_pool() {
        ferrite_runtime::threads::run(f)
    } else {
        f()
    }
}
