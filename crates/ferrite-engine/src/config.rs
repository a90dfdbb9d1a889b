//! `EngineConfig` (scheduler budgets, KV cache size, prefix cache) and `Limits`, the facts a
//! caller needs to validate a request without touching the engine thread.

use std::sync::Arc;

use ferrite_models::embedding::EmbeddingSpec;
use ferrite_models::model::CausalLm;
use ferrite_runtime::{KvLayout, KvScheme};

use crate::error::EngineError;
use crate::fill::{FillMode, ToolScaffold};
use crate::kv_precision::KvChoices;
use crate::request::Request;
use crate::sampling::MAX_TOP_LOGPROBS;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Query tokens per step over all rows (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: usize,
    /// Rows per step (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Longest sequence (prompt + output); default the model's context.
    pub max_model_len: Option<usize>,
    /// Positions per KV block.
    pub block_size: usize,
    /// KV cache bytes (`--kv-cache-memory`); default: this fraction of the free memory of a
    /// model that keeps its KV on a device, else `max_model_len × max_num_seqs` positions.
    pub kv_cache_memory: Option<usize>,
    /// Fraction of the device's free memory (after weights and workspaces) the KV cache of a
    /// device model takes (`--gpu-memory-utilization`).
    pub gpu_memory_utilization: f32,
    pub prefix_cache: bool,
    /// Prefix-cache namespace: model fingerprint and adapter set, hashed (the engine mixes
    /// in `kv_scheme`).
    pub namespace: u64,
    /// The host-RAM tier of the prefix cache: bytes of host memory for the blocks the pool
    /// evicts (`--host-cache-memory`; the CLI takes it for GPU models only).
    pub host_cache_memory: Option<usize>,
    /// The SSD tier of the prefix cache (`--prefix-cache-dir`, `--prefix-cache-disk-bytes`).
    pub disk_cache: Option<crate::kv::disk::DiskConfig>,
    /// Resumable generations: record every N generated tokens, and when cut off
    /// (`--generation-checkpoint N`).
    pub generation_checkpoint: Option<usize>,
    /// What the host KV pools hold (`--kv-cache-dtype`, `--kv-group-size`,
    /// `--kv-cache-skip-layers`).
    pub kv_scheme: KvScheme,
    /// Rows of a quantized cache keep full-precision KV for their first N positions
    /// (`--quantized-kv-start`; 0: quantized from the first; `kv_precision`).
    pub quantized_kv_start: usize,
    /// Speculative decoding (`--spec ngram`, `--draft-model`).
    pub speculation: Speculation,
    /// Most tokens drafted per row per step (`--num-draft-tokens`).
    pub num_draft_tokens: usize,
    /// Fill mode of requests that do not choose one (`--fill`).
    pub fill: FillMode,
    /// The chat template's tool-call scaffold, for `FillMode::Strict` and up.
    pub tool_scaffold: Option<Arc<ToolScaffold>>,
    /// Queue the next step while the model's device runs this one, when the model can
    /// (`--no-overlap` turns it off).
    pub overlap: bool,
    /// LoRA adapters loaded at once, at most (`--max-loras`).
    pub max_loras: usize,
    /// Positions between the recurrent-state snapshots the prefix cache keeps, for hybrid
    /// linear-attention models (`--state-snapshot-interval`; rounded up to whole blocks). None:
    /// as many blocks as make a snapshot no bigger than the KV of the positions it covers.
    pub state_snapshot_interval: Option<usize>,
}

/// How the engine drafts tokens for verification.
#[derive(Clone, Default)]
pub enum Speculation {
    #[default]
    Off,
    /// Prompt lookup over each request's own prompt and output.
    Ngram,
    /// A draft model sharing the target's tokenizer; it gets its own KV cache.
    Draft(Arc<dyn CausalLm>),
}

impl std::fmt::Debug for Speculation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Speculation::Off => f.write_str("Off"),
            Speculation::Ngram => f.write_str("Ngram"),
            Speculation::Draft(m) => write!(f, "Draft({} layers)", m.config().num_layers),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_batched_tokens: 2048,
            max_num_seqs: 64,
            max_model_len: None,
            block_size: 16,
            kv_cache_memory: None,
            gpu_memory_utilization: 0.9,
            prefix_cache: true,
            namespace: 0,
            host_cache_memory: None,
            disk_cache: None,
            generation_checkpoint: None,
            kv_scheme: KvScheme::default(),
            quantized_kv_start: 0,
            speculation: Speculation::Off,
            num_draft_tokens: 4,
            fill: FillMode::Off,
            tool_scaffold: None,
            overlap: true,
            max_loras: 8,
            state_snapshot_interval: None,
        }
    }
}

impl EngineConfig {
    /// Blocks between the state snapshots of `layout`'s recurrent group (1 without one), whose
    /// blocks take `block_bytes` per group (a recurrent group's: one state slot).
    pub fn snapshot_stride(&self, layout: &KvLayout, block_bytes: &[usize]) -> usize {
        let Some(g) = layout.recurrent_group() else { return 1 };
        if let Some(positions) = self.state_snapshot_interval {
            return positions.div_ceil(self.block_size.max(1)).max(1);
        }
        let kv: usize = block_bytes.iter().enumerate().filter(|&(i, _)| i != g).map(|(_, b)| b).sum();
        block_bytes[g].div_ceil(kv.max(1)).max(1)
    }

    /// Blocks per KV group for `layout`, whose blocks take `block_bytes` per group; `free`
    /// is the free memory of a device that holds the cache (None: host memory).
    ///
    /// A recurrent group's slots are sized apart: a snapshot per `snapshot_stride` blocks of
    /// the other groups (its bytes counted against the budget), plus, outside the budget, the
    /// live states (about two a sequence), the snapshots one step's chunks write and a verify
    /// span per sequence.
    pub fn group_blocks(
        &self,
        layout: &KvLayout,
        block_bytes: &[usize],
        free: Option<usize>,
        max_model_len: usize,
    ) -> Result<Vec<usize>, EngineError> {
        let recurrent = layout.recurrent_group();
        let stride = self.snapshot_stride(layout, block_bytes);
        // Bytes a block of the attention groups takes, with its share of a snapshot.
        let amortized = |bytes: &[usize]| -> usize {
            (bytes.iter().enumerate()).map(|(g, &b)| if Some(g) == recurrent { b / stride } else { b }).sum()
        };
        let per_block = amortized(block_bytes);
        let u = self.gpu_memory_utilization;
        if !(u > 0.0 && u <= 1.0) {
            return Err(EngineError::Config(format!("--gpu-memory-utilization must be in (0, 1], got {u}")));
        }
        let blocks = match (self.kv_cache_memory, free) {
            (Some(bytes), _) => bytes / per_block.max(1),
            (None, Some(free)) => (free as f64 * u as f64) as usize / per_block.max(1),
            // Host memory: the bytes of `max_model_len × max_num_seqs` positions at the default
            // precision, so a smaller KV type holds proportionally more positions.
            (None, None) => {
                let default_blocks = (max_model_len * self.max_num_seqs).div_ceil(self.block_size);
                default_blocks * amortized(&layout.block_bytes(self.block_size)) / per_block.max(1)
            }
        };
        if blocks == 0 {
            return Err(EngineError::Config(format!(
                "the KV cache holds no block: one block of {} positions takes {per_block} bytes",
                self.block_size
            )));
        }
        let mut out = vec![blocks; layout.groups.len()];
        if let Some(g) = recurrent {
            let chunk_snapshots = self.max_num_batched_tokens.div_ceil(self.block_size * stride);
            out[g] = blocks / stride + self.max_num_seqs * (3 + self.num_draft_tokens) + chunk_snapshots;
        }
        Ok(out)
    }
}

/// What a request is checked against.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    pub max_model_len: usize,
    pub vocab_size: usize,
    /// The longest sequence the KV cache can hold at once.
    pub kv_capacity_tokens: usize,
    /// KV bytes a token of context takes (every group's).
    #[serde(default)]
    pub kv_bytes_per_token: usize,
    /// What the KV pools hold, for reports (`KvScheme`'s display).
    #[serde(default)]
    pub kv_scheme: String,
    pub has_tokenizer: bool,
    pub max_n: usize,
    /// Query tokens per step: an embedding input runs whole in one step.
    pub max_step_tokens: usize,
    /// What the model's embeddings are, when it makes them.
    pub embedding: Option<EmbeddingSpec>,
    /// Whether the model generates (false: it only embeds).
    pub generates: bool,
    /// What a request may choose of the KV cache's precision.
    #[serde(default)]
    pub kv: KvChoices,
}

impl Limits {
    /// Check `req`; the error says what is wrong. Returns the resolved max_tokens.
    pub fn validate(&self, req: &Request) -> Result<usize, EngineError> {
        let p = &req.params;
        let prompt = req.prompt.len();
        if prompt == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        if p.embed {
            return self.validate_embed(req).map(|()| 0);
        }
        if !self.generates {
            return Err(EngineError::CannotGenerate);
        }
        let start = self.kv.resolve(p)?;
        if prompt >= self.max_model_len {
            return Err(EngineError::PromptTooLong { prompt, context: self.max_model_len });
        }
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(EngineError::TokenOutOfRange { token: t, vocab: self.vocab_size });
        }
        let max_tokens = match p.max_tokens {
            Some(0) => return Err(EngineError::ZeroMaxTokens),
            // `prompt < max_model_len` above, so this cannot wrap (`prompt + m` could).
            Some(m) if m > self.max_model_len - prompt => {
                return Err(EngineError::MaxTokensTooLarge { prompt, max_tokens: m, context: self.max_model_len })
            }
            Some(m) => m,
            None => self.max_model_len - prompt,
        };
        self.kv.check_fits(prompt + max_tokens, start, self.kv_capacity_tokens)?;
        if p.n == 0 || p.n > self.max_n {
            return Err(EngineError::BadN { n: p.n, max: self.max_n });
        }
        if p.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            return Err(EngineError::TooManyLogprobs(MAX_TOP_LOGPROBS));
        }
        if !p.stop.is_empty() && !self.has_tokenizer {
            return Err(EngineError::StopWithoutTokenizer);
        }
        if p.min_tokens > max_tokens {
            return Err(EngineError::MinTokens { min_tokens: p.min_tokens, max_tokens });
        }
        p.sampling.validate(self.vocab_size)?;
        Ok(max_tokens)
    }

    /// The longest input an embedding request may have: it runs whole in one step.
    pub fn max_embed_tokens(&self) -> usize {
        self.max_model_len.min(self.max_step_tokens).min(self.kv_capacity_tokens)
    }

    /// Check an embedding request (`RequestParams::embed`, non-empty prompt).
    fn validate_embed(&self, req: &Request) -> Result<(), EngineError> {
        if self.embedding.is_none() {
            return Err(EngineError::CannotEmbed);
        }
        let (input, max) = (req.prompt.len(), self.max_embed_tokens());
        if input > max {
            return Err(EngineError::EmbedInputTooLong { input, max });
        }
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(EngineError::TokenOutOfRange { token: t, vocab: self.vocab_size });
        }
        if req.params.n != 1 || req.params.max_tokens.is_some() {
            return Err(EngineError::EmbedParams);
        }
        Ok(())
    }
}
