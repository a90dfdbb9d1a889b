//! `CausalLm`: what the engine needs from any architecture — its config, its KV layout and
//! storage, and one step call over a flat `ForwardBatch` (`CausalLm::step`); a model that
//! embeds (`CausalLm::embedding`) also runs whole inputs to one embedding each
//! (`CausalLm::embed`). The caller says
//! what the step's logits rows want back (`Want`: the logits themselves, the argmax, or a
//! sample drawn as each row's sampler says) and gets a `Pending` handle, which resolves to a
//! `StepOutput`.
//!
//! A model on the CPU keeps its KV cache in host memory (the defaults below) and resolves its
//! handles at once. A model on a CUDA device allocates its KV on the device, sizes it from the
//! device's free memory and picks tokens there; its argmax and sampled steps come back queued
//! (`Pending::is_queued`), so the engine schedules the next step — whose input ids may be the
//! picks still on the device (`ForwardBatch::carried`) — while the device runs this one. The
//! engine, scheduler and prefix cache are the same for both.

use ferrite_runtime::sampling::{RowSampler, SampledToken};
use ferrite_runtime::{cpu, threads, RuntimeError};
use ferrite_runtime::{ForwardBatch, KvCache, KvLayout, KvScheme};

use crate::config::ModelConfig;
use crate::embedding::EmbeddingSpec;
use crate::error::LoadError;
use crate::lora::LoraAdapter;

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

/// What every logits row of a step (`ForwardBatch::logits_indices`) wants back.
#[derive(Debug, Clone, Copy)]
pub enum Want<'a> {
    /// The logits on the host, for rows the host judges, masks or samples itself (verify
    /// proposals, output constraints, logit processors, logprobs of a host sampler).
    Logits,
    /// The argmax of each logits row (lowest id on ties; a verify row has one at each of its
    /// positions); only the ids come back.
    Argmax,
    /// Each row drawn as its sampler says (one per row, in order); only the picks and their
    /// requested logprobs come back. Only asked of a model that `samples_on_device`.
    Sample(&'a [RowSampler]),
}

/// What a step hands back for its logits rows, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutput {
    /// Row-major `[rows, vocab]`.
    Logits(Vec<f32>),
    /// The argmax of each row.
    Ids(Vec<u32>),
    /// Drawn as the step's row samplers said.
    Sampled(Vec<SampledToken>),
}

impl StepOutput {
    /// What `want` asks of `logits` (`[rows, vocab]`, on the host).
    pub fn from_logits(logits: Vec<f32>, vocab: usize, want: Want<'_>) -> ferrite_runtime::Result<StepOutput> {
        match want {
            Want::Logits => Ok(StepOutput::Logits(logits)),
            Want::Argmax => {
                // One row per task: the rows of a decode batch are independent (8 × 49,152
                // logits scanned serially were ~0.4 ms of a SmolLM2 step).
                let rows = logits.len() / vocab.max(1);
                let row = |i: usize| &logits[i * vocab..(i + 1) * vocab];
                Ok(StepOutput::Ids(threads::map_claimed(rows, || (), |_, i| cpu::argmax(row(i)) as u32)))
            }
            Want::Sample(_) => {
                let why = "this model does not sample on a device".into();
                Err(ferrite_runtime::cuda::CudaError::Unsupported(why).into())
            }
        }
    }

    /// How many logits rows it covers.
    pub fn rows(&self, vocab: usize) -> usize {
        match self {
            StepOutput::Logits(l) => l.len() / vocab.max(1),
            StepOutput::Ids(ids) => ids.len(),
            StepOutput::Sampled(s) => s.len(),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            StepOutput::Logits(_) => "logits",
            StepOutput::Ids(_) => "argmax ids",
            StepOutput::Sampled(_) => "sampled picks",
        }
    }

    fn mismatch(&self, wanted: &str) -> RuntimeError {
        RuntimeError::Shape(format!("a step that wanted {wanted} gave {}", self.kind()))
    }
}

/// A step queued on a device: waiting for it gives its outputs.
pub trait QueuedStep: Send {
    /// Wait until the step has run and read its outputs.
    fn wait(self: Box<Self>) -> ferrite_runtime::Result<StepOutput>;
}

/// The outputs of a step: there already (a CPU model), or once its device has run it.
pub struct Pending(Resolution);

enum Resolution {
    Ready(StepOutput),
    Queued(Box<dyn QueuedStep>),
}

impl Pending {
    /// A step that has already run.
    pub fn ready(out: StepOutput) -> Pending {
        Pending(Resolution::Ready(out))
    }

    /// A step still queued on a device.
    pub fn queued(step: impl QueuedStep + 'static) -> Pending {
        Pending(Resolution::Queued(Box::new(step)))
    }

    /// Whether the step was queued behind the caller's back: `wait` may block until the
    /// device has run it, and the caller can do other work (queue the next step) first.
    pub fn is_queued(&self) -> bool {
        matches!(self.0, Resolution::Queued(_))
    }

    /// The step's outputs, once it has run.
    pub fn wait(self) -> ferrite_runtime::Result<StepOutput> {
        match self.0 {
            Resolution::Ready(out) => Ok(out),
            Resolution::Queued(step) => step.wait(),
        }
    }

    /// The logits of a step that wanted them.
    pub fn logits(self) -> ferrite_runtime::Result<Vec<f32>> {
        match self.wait()? {
            StepOutput::Logits(l) => Ok(l),
            other => Err(other.mismatch("logits")),
        }
    }

    /// The argmax ids of a step that wanted them.
    pub fn ids(self) -> ferrite_runtime::Result<Vec<u32>> {
        match self.wait()? {
            StepOutput::Ids(ids) => Ok(ids),
            other => Err(other.mismatch("argmax ids")),
        }
    }
}

pub trait CausalLm: Send + Sync {
    fn config(&self) -> &ModelConfig;

    /// The KV groups and KV-owning layers, in the order `step` addresses them.
    fn kv_layout(&self) -> KvLayout;

    /// Run the batch: write its tokens' K/V into `kv` and hand back, for the positions in
    /// `batch.logits_indices` (in order), what `want` asks. A device model may return before
    /// the step has run (`Pending::is_queued`); a later step then sees its KV, and its picks
    /// stay on the device for the next step's `batch.carried` until another step runs. A
    /// model that cannot carry picks refuses a batch with `carried` ids.
    fn step(&self, batch: &ForwardBatch, kv: &mut KvCache, want: Want<'_>) -> ferrite_runtime::Result<Pending>;

    /// Attach `adapter` under `id`, so that rows of later steps whose `adapter` is `id` run
    /// through it; its shapes are checked against the model's projections. A model that
    /// cannot run adapters says so.
    fn attach_lora(&self, _id: u32, adapter: &LoraAdapter) -> Result<(), LoadError> {
        Err(LoadError::format(&adapter.path, "this model runs no LoRA adapters"))
    }

    /// Forget the adapter attached under `id` (no step may name it any more).
    fn detach_lora(&self, _id: u32) {}

    /// Per layer, the (in, out) features of each projection an adapter may adapt, in
    /// `LoraTarget` order (None: the layer has no such projection); empty for a model that
    /// runs no adapters.
    fn lora_shapes(&self) -> Vec<[Option<(usize, usize)>; 7]> {
        Vec::new()
    }

    /// What the model's embeddings are, when it makes them (`embed`).
    fn embedding(&self) -> Option<&EmbeddingSpec> {
        None
    }

    /// Whether the model generates text (false: a bidirectional encoder, which only embeds).
    fn generates(&self) -> bool {
        true
    }

    /// The embedding of each row of `batch`, in order; every row holds its whole input (from
    /// position 0), whose K/V go into `kv`.
    fn embed(&self, _batch: &ForwardBatch, _kv: &mut KvCache) -> ferrite_runtime::Result<Vec<Vec<f32>>> {
        Err(RuntimeError::Unsupported("this model does not make embeddings".into()))
    }

    /// Whether the model draws `Want::Sample` rows on its device.
    fn samples_on_device(&self) -> bool {
        false
    }

    /// Whether `step` runs its ops on the host's thread pool (a CPU model): the engine then
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
    /// storage under `scheme`; an error for a scheme the model's KV cannot hold.
    fn kv_block_bytes(&self, block_size: usize, scheme: &KvScheme) -> ferrite_runtime::Result<Vec<usize>> {
        let layout = self.kv_layout();
        Ok(layout.block_bytes_with(block_size, &layout.layer_dtypes(scheme)?))
    }

    /// Per KV layer, what every key shares, for a quantized K pool to store keys less it
    /// (`KvCache::set_key_offsets`); empty: none.
    fn kv_key_offsets(&self) -> Vec<Option<Vec<f32>>> {
        Vec::new()
    }

    /// What `new_kv_cache`'s pools hold under `scheme`, for reports.
    fn kv_description(&self, scheme: &KvScheme) -> String {
        scheme.to_string()
    }

    /// The KV storage `step` reads: `group_blocks[g]` blocks of `block_size` in group g, of
    /// the value types `scheme` gives each layer.
    fn new_kv_cache(
        &self,
        group_blocks: &[usize],
        block_size: usize,
        scheme: &KvScheme,
    ) -> ferrite_runtime::Result<KvCache> {
        let mut kv = KvCache::with_scheme(&self.kv_layout(), group_blocks, block_size, scheme)?;
        kv.set_key_offsets(&self.kv_key_offsets())?;
        Ok(kv)
    }
}

/// Run `f`, a step of `model`, where it runs best: on a pool worker for a model whose ops
/// use the host's thread pool (`CausalLm::uses_host_pool`), directly for a device model.
pub fn run_forward<R: Send>(model: &dyn CausalLm, f: impl FnOnce() -> R + Send) -> R {
    if model.uses_host_pool() {
        ferrite_runtime::threads::run(f)
    } else {
        f()
    }
}
