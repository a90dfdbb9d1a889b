//! `Sequence`: one choice of one request as the scheduler sees it — its tokens, how many are
//! in the KV cache (`num_computed`), its blocks, and its streaming state.

use std::sync::Arc;

use ferrite_models::tokenizer::IncrementalDecoder;

use crate::fill::FillState;
use crate::kv::SeqKv;
use crate::request::{RequestId, RequestParams};
use crate::sampling::TokenCounts;
use crate::spec::SpecState;
use crate::stop::StopStrings;
use crate::stream::Sink;
use crate::structured::Guide;

pub(crate) struct Sequence {
    pub request: RequestId,
    pub choice: usize,
    pub params: Arc<RequestParams>,
    pub seed: u64,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Positions whose KV is in the cache; the rest of `tokens` is the next query.
    pub num_computed: usize,
    pub kv: SeqKv,
    /// The id of the LoRA adapter it runs through (None: the base model).
    pub adapter: Option<u32>,
    /// Whether the prefix cache was consulted for the current admission.
    pub looked_up: bool,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
    /// Resolved generation budget.
    pub max_tokens: usize,
    pub counts: TokenCounts,
    pub detok: IncrementalDecoder,
    pub stops: StopStrings,
    pub sink: Sink,
    /// For the first choice of an n > 1 request: children still to fork once the prompt is in.
    pub pending_children: usize,
    pub fill: FillState,
    pub spec: SpecState,
    /// Its position in the output grammar, for a constrained request.
    pub guide: Option<Guide>,
    /// Its dealings with the tiers below the pool and with resumption (`core/tiers.rs`).
    pub tier: TierState,
}

/// A sequence's state towards the KV tiers below the pool and its resumable generation.
#[derive(Debug, Default)]
pub(crate) struct TierState {
    /// A tier below the pool held part of its prefix at arrival: restore before admission.
    pub restore: bool,
    /// The SSD tier's read-ahead of its prefix, not installed yet.
    pub read_ahead: Option<std::sync::mpsc::Receiver<crate::kv::Restored>>,
    /// The blocks installed for it from each tier (indexed by `TierKind`).
    pub restored: [std::ops::Range<usize>; 2],
    /// Full blocks already handed to the SSD tier (or found there).
    pub published: usize,
    /// Prompt tokens served from each tier (indexed by `TierKind`) at first admission.
    pub tier_tokens: [usize; 2],
    /// The digest of (prompt, parameters) a resumable generation is recorded under.
    pub resume_key: Option<u64>,
    /// Tokens replayed from the record of an interrupted run of the same request.
    pub resumed: usize,
    /// Generated tokens at the last checkpoint.
    pub checkpointed: usize,
    /// Whether a record of this generation may exist (deleted when it finishes).
    pub recorded: bool,
}

impl Sequence {
    /// At first admission, with `num_computed` positions found cached: the prompt tokens
    /// served from the prefix cache, and the parts of them each tier below the pool restored.
    pub fn note_first_hit(&mut self, block_size: usize) {
        self.cached_tokens = self.num_computed.min(self.prompt_len);
        let hit = self.num_computed / block_size;
        for (tokens, r) in self.tier.tier_tokens.iter_mut().zip(&self.tier.restored) {
            *tokens = (hit.min(r.end) * block_size).min(self.prompt_len).saturating_sub(r.start * block_size);
        }
    }

    /// Whether this is the sequence's first admission (nothing generated since it arrived).
    pub fn first_admission(&self) -> bool {
        self.generated() == self.tier.resumed && self.cached_tokens == 0
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to run through the model before the next sample.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Query tokens this row asks for in the next step: the remaining ones plus, when only
    /// the pending token remains, the tokens it proposes after it.
    pub fn wanted(&self) -> usize {
        let r = self.remaining();
        if r == 1 {
            r + self.spec.reserve
        } else {
            r
        }
    }

    /// Tokens that end this sequence: the model's end tokens (unless ignored) and the
    /// request's stop tokens.
    pub fn end_tokens(&self, eos: &[u32]) -> Vec<u32> {
        let eos = if self.params.ignore_eos { &[][..] } else { eos };
        eos.iter().chain(&self.params.stop_token_ids).copied().collect()
    }

    /// Tokens that may follow the pending one before `max_tokens` or the context runs out,
    /// the pending one's successor included.
    pub fn room(&self, max_model_len: usize) -> usize {
        (self.max_tokens.saturating_sub(self.generated())).min(max_model_len.saturating_sub(self.tokens.len()))
    }
}
