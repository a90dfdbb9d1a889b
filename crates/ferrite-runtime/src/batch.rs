//! `ForwardBatch`: one flat batch of query tokens for a model step.
//!
//! Rows (sequences) contribute any number of query tokens: 1 for decode, a chunk for prefill,
//! k+1 for verification. Their tokens are concatenated; each row carries its span, the KV
//! length after the step and its block table into the paged KV cache. A device model may
//! also take some input ids from the previous step's picks without the host seeing them
//! (`carried`). A row may run through a LoRA adapter (`RowSpan::adapter`, the id the engine
//! attached it under); rows of one step may use different adapters or none. A row of a
//! quantized cache may still keep full-precision KV (`RowSpan::full_precision`: its block ids
//! are in the cache's full-precision twin pools, before its delayed start). A device model
//! that replays a captured step pads a batch to the step's shape (`Padding`).

/// One row's part of a `ForwardBatch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowSpan {
    /// Index of the row's first query token in `ForwardBatch::tokens`.
    pub query_start: usize,
    /// Number of query tokens the row contributes this step.
    pub query_len: usize,
    /// KV length of the row once this step's tokens are written (last position + 1).
    pub context_len: usize,
    /// Per KV group, the physical block ids holding positions
    /// `[i * block_size, (i + 1) * block_size)`; `NO_BLOCK` where a sliding window freed it.
    pub block_tables: Vec<Vec<u32>>,
    /// The LoRA adapter the row runs through (its id with the model), or the base model.
    pub adapter: Option<u32>,
    /// Its block ids are in the full-precision twin pools of a quantized cache (a row before
    /// its quantized start), not in the cache's own pools.
    pub full_precision: bool,
    /// A verify (or drafting) row of a model with recurrent state: slot `i` receives the state
    /// after the row's first `i + 1` query tokens, so a rejected tail can be rolled back
    /// (`kv_state`). Empty otherwise.
    pub span_states: Vec<u32>,
}

/// How a row runs besides its tokens: the LoRA adapter (None: the base model) and which pools
/// its block ids index (`RowSpan::full_precision`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RowOptions {
    pub adapter: Option<u32>,
    pub full_precision: bool,
}

/// A block-table entry whose block was released (it fell out of a sliding window).
pub const NO_BLOCK: u32 = u32::MAX;

impl RowSpan {
    /// Position of the row's first query token.
    pub fn first_position(&self) -> usize {
        self.context_len - self.query_len
    }
}

#[derive(Debug, Clone, Default)]
pub struct ForwardBatch {
    /// Query tokens of all rows, concatenated.
    pub tokens: Vec<u32>,
    /// Position of each query token.
    pub positions: Vec<u32>,
    pub rows: Vec<RowSpan>,
    /// Flat indices into `tokens` whose logits the caller wants, in output order.
    pub logits_indices: Vec<usize>,
    /// (token index, logits row of the step run just before) pairs: that token's id is the
    /// earlier step's pick, still on the device (its id in `tokens` is a placeholder). Only a
    /// device model that queued the earlier step can read them.
    pub carried: Vec<(usize, usize)>,
}

impl ForwardBatch {
    /// Append a row whose query tokens continue a sequence that already has
    /// `context_len - tokens.len()` tokens in the KV cache; `block_tables` has one table per
    /// KV group.
    pub fn push_row(&mut self, tokens: &[u32], context_len: usize, block_tables: Vec<Vec<u32>>, logits: RowLogits) {
        self.push_row_with(tokens, context_len, block_tables, logits, RowOptions::default())
    }

    /// `push_row` for a row that runs as `options` say (an adapter, full-precision KV).
    pub fn push_row_with(
        &mut self,
        tokens: &[u32],
        context_len: usize,
        block_tables: Vec<Vec<u32>>,
        logits: RowLogits,
        options: RowOptions,
    ) {
        let query_start = self.tokens.len();
        let first = context_len - tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.positions.extend((first..context_len).map(|p| p as u32));
        match logits {
            RowLogits::None => {}
            RowLogits::Last => {
                if !tokens.is_empty() {
                    self.logits_indices.push(query_start + tokens.len() - 1)
                }
            }
            RowLogits::All => self.logits_indices.extend(query_start..query_start + tokens.len()),
        }
        let RowOptions { adapter, full_precision } = options;
        self.rows.push(RowSpan {
            query_start,
            query_len: tokens.len(),
            context_len,
            block_tables,
            adapter,
            full_precision,
            span_states: Vec::new(),
        });
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Whether any row runs through a LoRA adapter.
    pub fn has_adapters(&self) -> bool {
        self.rows.iter().any(|r| r.adapter.is_some())
    }

    /// Whether any row keeps full-precision KV in a quantized cache's twin pools.
    pub fn has_full_precision_rows(&self) -> bool {
        self.rows.iter().any(|r| r.full_precision)
    }
}

/// The shape a device model pads a step to (a captured graph's): `rows` rows, the rows added
/// after the batch's own each `query` tokens long and empty — ids and positions 0, no context,
/// no KV slot written, no recurrent state read or written, no adapter — with logits wanted at
/// each of their tokens. A batch already `rows` rows long is not padded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Padding {
    pub rows: usize,
    pub query: usize,
}

impl Padding {
    /// No padding: `batch` as it is.
    pub fn none(batch: &ForwardBatch) -> Padding {
        Padding { rows: batch.rows.len(), query: 1 }
    }

    /// Rows added after `batch`'s own.
    pub fn extra_rows(&self, batch: &ForwardBatch) -> usize {
        self.rows.saturating_sub(batch.rows.len())
    }

    /// Tokens added after `batch`'s own.
    pub fn extra_tokens(&self, batch: &ForwardBatch) -> usize {
        self.extra_rows(batch) * self.query
    }

    /// Tokens of the padded step.
    pub fn tokens(&self, batch: &ForwardBatch) -> usize {
        batch.num_tokens() + self.extra_tokens(batch)
    }
}

/// Which of a row's query positions need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowLogits {
    None,
    Last,
    All,
}
