//! `Generator`: runs one request at a time through the model — chunked prefill over the
//! paged KV cache, then one decode step per token — streaming each token to a callback.

use std::sync::Arc;
use std::time::Instant;

use ferrite_models::model::CausalLm;
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::{ForwardBatch, KvCache};

use crate::error::EngineError;
use crate::kv::BlockPool;
use crate::sampling::{sample, SamplingParams};

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Tokens that end generation (the model's EOS set plus any the caller adds).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub prompt_secs: f64,
    pub generated_tokens: usize,
    pub decode_secs: f64,
    pub finish_reason: FinishReason,
}

pub struct Generator {
    model: Arc<dyn CausalLm>,
    kv: KvCache,
    pool: BlockPool,
    context_len: usize,
    prefill_chunk: usize,
}

impl Generator {
    /// A generator whose KV cache holds `context_len` positions in blocks of `block_size`.
    pub fn new(model: Arc<dyn CausalLm>, context_len: usize, block_size: usize, prefill_chunk: usize) -> Result<Generator, EngineError> {
        let num_blocks = context_len.div_ceil(block_size);
        let kv = KvCache::new(&model.kv_layout(), num_blocks, block_size)?;
        Ok(Generator { model, kv, pool: BlockPool::new(num_blocks, block_size), context_len, prefill_chunk: prefill_chunk.max(1) })
    }

    pub fn context_len(&self) -> usize {
        self.context_len
    }

    /// Check a request before any work: the caller gets a typed error, nothing runs.
    pub fn validate(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if req.prompt.len() >= self.context_len {
            return Err(EngineError::PromptTooLong { prompt: req.prompt.len(), context: self.context_len });
        }
        if req.max_tokens == 0 {
            return Err(EngineError::ZeroMaxTokens);
        }
        req.sampling.validate()?;
        Ok(())
    }

    /// Generate for `req`, calling `on_token` with each new token; it returns `false` to stop.
    pub fn generate(&mut self, req: &GenerateRequest, on_token: &mut dyn FnMut(u32) -> bool) -> Result<GenerationStats, EngineError> {
        self.validate(req)?;
        let mut table = Vec::new();
        let result = self.run(req, &mut table, on_token);
        self.pool.release_all(&mut table);
        result
    }

    fn step(&mut self, tokens: &[u32], context_len: usize, table: &mut Vec<u32>, logits: RowLogits) -> Result<Vec<f32>, EngineError> {
        if !self.pool.grow(table, context_len) {
            return Err(EngineError::OutOfBlocks(self.pool.blocks_for(context_len)));
        }
        let mut batch = ForwardBatch::default();
        batch.push_row(tokens, context_len, table.clone(), logits);
        Ok(self.model.forward(&batch, &mut self.kv)?)
    }

    fn run(&mut self, req: &GenerateRequest, table: &mut Vec<u32>, on_token: &mut dyn FnMut(u32) -> bool) -> Result<GenerationStats, EngineError> {
        let t0 = Instant::now();
        let mut done = 0;
        let mut logits = Vec::new();
        while done < req.prompt.len() {
            let end = (done + self.prefill_chunk).min(req.prompt.len());
            let want = if end == req.prompt.len() { RowLogits::Last } else { RowLogits::None };
            logits = self.step(&req.prompt[done..end], end, table, want)?;
            done = end;
        }
        let prompt_secs = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut generated = 0;
        let mut context = req.prompt.len();
        let finish = loop {
            let tok = sample(&logits, &req.sampling, generated as u64);
            generated += 1;
            if !req.ignore_eos && req.stop_token_ids.contains(&tok) {
                break FinishReason::Stop;
            }
            if !on_token(tok) {
                break FinishReason::Cancelled;
            }
            if generated >= req.max_tokens || context + 1 >= self.context_len {
                break FinishReason::Length;
            }
            context += 1;
            logits = self.step(&[tok], context, table, RowLogits::Last)?;
        };
        Ok(GenerationStats {
            prompt_tokens: req.prompt.len(),
            prompt_secs,
            generated_tokens: generated,
            decode_secs: t1.elapsed().as_secs_f64(),
            finish_reason: finish,
        })
    }
}
