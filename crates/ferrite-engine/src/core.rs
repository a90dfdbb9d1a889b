//! `EngineCore`: the step loop, synchronous and single-threaded — `schedule()`, build one
//! `ForwardBatch`, `model.forward()`, sample each row that reached the end of its tokens, then
//! append, detokenize, check stops, stream, and free what finished. Constrained rows compute
//! their token masks while the model runs and sample under them. The engine thread
//! (`engine.rs`) drives it; tests drive it directly.

use std::sync::Arc;

use ferrite_models::model::CausalLm;
use ferrite_models::tokenizer::{IncrementalDecoder, Tokenizer};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::{ForwardBatch, KvCache};
use tokio::sync::mpsc::UnboundedSender;

use crate::config::{EngineConfig, Limits};
use crate::error::EngineError;
use crate::kv::KvManager;
use crate::metrics::Metrics;
use crate::request::{FinishReason, Finished, Output, Request, RequestId, Usage};
use crate::sampling::{apply_processors, sample, token_logprobs};
use crate::scheduler::Scheduler;
use crate::sequence::Sequence;
use crate::stop::StopStrings;
use crate::structured::{Grammars, Guide};

pub struct EngineCore {
    model: Arc<dyn CausalLm>,
    tokenizer: Option<Arc<Tokenizer>>,
    eos: Vec<u32>,
    kv: KvCache,
    kvm: KvManager,
    sched: Scheduler,
    limits: Limits,
    metrics: Arc<Metrics>,
    grammars: Arc<Grammars>,
}

/// The seed of choice `i` of a request seeded with `seed`.
fn choice_seed(seed: u64, choice: usize) -> u64 {
    seed ^ (choice as u64).wrapping_mul(0xA24B_AED4_963E_E407)
}

impl EngineCore {
    pub fn new(
        model: Arc<dyn CausalLm>,
        tokenizer: Option<Arc<Tokenizer>>,
        eos: Vec<u32>,
        cfg: &EngineConfig,
    ) -> Result<EngineCore, EngineError> {
        let mcfg = model.config();
        let max_model_len = cfg.max_model_len.unwrap_or(mcfg.max_context()).min(mcfg.max_context());
        if cfg.block_size == 0 || cfg.max_num_batched_tokens == 0 || cfg.max_num_seqs == 0 {
            return Err(EngineError::Config("block size, batch tokens and batch rows must be at least 1".into()));
        }
        let layout = model.kv_layout();
        let group_blocks = cfg.group_blocks(&layout, max_model_len)?;
        let kv = KvCache::new(&layout, &group_blocks, cfg.block_size)?;
        let kvm = KvManager::new(&layout, &group_blocks, cfg.block_size, cfg.prefix_cache.then_some(cfg.namespace));
        let limits = Limits {
            max_model_len,
            vocab_size: mcfg.vocab_size,
            kv_capacity_tokens: kvm.capacity_tokens(),
            has_tokenizer: tokenizer.is_some(),
            max_n: 64,
        };
        let metrics = Arc::new(Metrics::default());
        metrics.set_kv(kvm.free_blocks());
        let grammars = Arc::new(Grammars::new(tokenizer.clone(), mcfg.vocab_size, eos.clone()));
        Ok(EngineCore {
            model,
            tokenizer,
            eos,
            kv,
            kvm,
            sched: Scheduler::new(cfg.max_num_batched_tokens, cfg.max_num_seqs),
            limits,
            metrics,
            grammars,
        })
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }
    pub fn has_work(&self) -> bool {
        self.sched.has_work()
    }
    pub fn kv_manager(&self) -> &KvManager {
        &self.kvm
    }
    /// What output constraints compile against (shared with the `Engine` front).
    pub fn grammars(&self) -> Arc<Grammars> {
        self.grammars.clone()
    }

    /// Queue a validated request; its outputs go to `sink`.
    pub fn add_request(
        &mut self,
        id: RequestId,
        req: Request,
        sink: UnboundedSender<Output>,
    ) -> Result<(), EngineError> {
        let guide = req.params.constraint.as_ref().map(|c| self.grammars.compile(c)).transpose()?;
        self.add_guided(id, req, guide, sink)
    }

    /// Queue a request whose constraint, if it has one, is already compiled into `guide`.
    pub fn add_guided(
        &mut self,
        id: RequestId,
        req: Request,
        guide: Option<Guide>,
        sink: UnboundedSender<Output>,
    ) -> Result<(), EngineError> {
        let max_tokens = self.limits.validate(&req)?;
        let n = req.params.n;
        let seed = choice_seed(req.params.sampling.seed, 0);
        let seq = Sequence {
            request: id,
            choice: 0,
            seed,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            num_computed: 0,
            kv: self.kvm.new_seq(),
            looked_up: false,
            cached_tokens: 0,
            max_tokens,
            counts: Default::default(),
            detok: IncrementalDecoder::new(true),
            stops: StopStrings::new(req.params.stop.clone()),
            params: Arc::new(req.params),
            sink,
            pending_children: n - 1,
            guide,
        };
        self.metrics.requests_added();
        self.sched.waiting.push_back(seq);
        self.metrics.set_queue(self.sched.running.len(), self.sched.waiting.len());
        Ok(())
    }

    /// Cancel every choice of request `id`; its blocks are freed now.
    pub fn abort(&mut self, id: RequestId) {
        let mut aborted = Vec::new();
        self.sched.running.retain_mut(|s| {
            let hit = s.request == id;
            if hit {
                aborted.push(std::mem::take(&mut s.kv));
            }
            !hit
        });
        self.sched.waiting.retain_mut(|s| {
            let hit = s.request == id;
            if hit {
                aborted.push(std::mem::take(&mut s.kv));
            }
            !hit
        });
        for mut kv in aborted {
            self.kvm.free(&mut kv);
        }
        self.after_step_bookkeeping();
    }

    /// One engine iteration. A model failure ends the requests of this step with an error.
    pub fn step(&mut self) -> Result<(), EngineError> {
        let rows = self.sched.schedule(&mut self.kvm);
        if rows.is_empty() {
            self.after_step_bookkeeping();
            return Ok(());
        }
        let mut batch = ForwardBatch::default();
        let mut sampled = Vec::new();
        for r in &rows {
            let s = &self.sched.running[r.index];
            let end = s.num_computed + r.tokens;
            let wants = end == s.tokens.len();
            batch.push_row(
                &s.tokens[s.num_computed..end],
                end,
                s.kv.tables.clone(),
                if wants { RowLogits::Last } else { RowLogits::None },
            );
            if wants {
                sampled.push(r.index);
            }
        }
        self.metrics.add_batch(batch.num_tokens());
        let logits = match self.forward_guided(&batch, &sampled) {
            Ok(l) => l,
            Err(e) => {
                let msg = e.to_string();
                for r in rows.iter().rev() {
                    let mut seq = self.sched.running.remove(r.index);
                    self.finish(&mut seq, FinishReason::Error, None, None, Some(msg.clone()));
                }
                self.after_step_bookkeeping();
                return Err(e.into());
            }
        };
        for r in &rows {
            let s = &mut self.sched.running[r.index];
            s.num_computed += r.tokens;
            self.kvm.after_step(&mut s.kv, &s.tokens, s.num_computed);
        }
        let vocab = self.limits.vocab_size;
        let mut done = Vec::new();
        let mut disconnected = Vec::new();
        let mut children = Vec::new();
        for (k, &idx) in sampled.iter().enumerate() {
            let row = &logits[k * vocab..(k + 1) * vocab];
            if self.sched.running[idx].pending_children > 0 {
                children.extend(self.fork(idx));
            }
            match self.sample_and_emit(idx, row) {
                Emitted::Running => {}
                Emitted::Finished => done.push(idx),
                Emitted::Disconnected => disconnected.push(self.sched.running[idx].request),
            }
        }
        for idx in done.into_iter().rev() {
            let mut seq = self.sched.running.remove(idx);
            self.kvm.free(&mut seq.kv);
        }
        for child in children.into_iter().rev() {
            self.sched.waiting.push_front(child);
        }
        for id in disconnected {
            self.abort(id);
        }
        self.after_step_bookkeeping();
        Ok(())
    }

    /// Run the model on `batch`; meanwhile, on a helper thread, the constrained rows about to
    /// sample (`sampled`) compute their token masks.
    fn forward_guided(&mut self, batch: &ForwardBatch, sampled: &[usize]) -> ferrite_runtime::Result<Vec<f32>> {
        let guides: Vec<&mut Guide> = (self.sched.running.iter_mut().enumerate())
            .filter(|(i, _)| sampled.contains(i))
            .filter_map(|(_, s)| s.guide.as_mut())
            .collect();
        if guides.is_empty() {
            return self.model.forward(batch, &mut self.kv);
        }
        let (model, kv) = (&self.model, &mut self.kv);
        std::thread::scope(|scope| {
            scope.spawn(move || guides.into_iter().for_each(Guide::prepare_mask));
            model.forward(batch, kv)
        })
    }

    fn after_step_bookkeeping(&mut self) {
        self.metrics.set_queue(self.sched.running.len(), self.sched.waiting.len());
        self.metrics.set_kv(self.kvm.free_blocks());
        if let Some(c) = self.kvm.prefix_cache() {
            self.metrics.set_prefix(c.queried_tokens, c.hit_tokens);
        }
        self.metrics.set_preemptions(self.sched.preemptions);
        #[cfg(debug_assertions)]
        if let Err(e) = self.kvm.check_invariants() {
            panic!("KV block pool invariant broken: {e}");
        }
    }

    /// Children 1..n of the request at `running[idx]`, sharing its prompt's full blocks; each
    /// recomputes the prompt's last partial block itself.
    fn fork(&mut self, idx: usize) -> Vec<Sequence> {
        let bs = self.kvm.block_size();
        let parent = &mut self.sched.running[idx];
        let n = std::mem::take(&mut parent.pending_children);
        let shared = (parent.prompt_len - 1) / bs;
        let (kv_parent, base_seed) = (parent.kv.clone(), parent.params.sampling.seed);
        let mut out = Vec::with_capacity(n);
        for choice in 1..=n {
            let kv = self.kvm.share_prefix(&kv_parent, shared);
            let p = &self.sched.running[idx];
            out.push(Sequence {
                request: p.request,
                choice,
                params: p.params.clone(),
                seed: choice_seed(base_seed, choice),
                tokens: p.tokens[..p.prompt_len].to_vec(),
                prompt_len: p.prompt_len,
                num_computed: kv.tables.first().map_or(0, |t| t.len()) * bs,
                looked_up: true,
                kv,
                cached_tokens: p.cached_tokens,
                max_tokens: p.max_tokens,
                counts: Default::default(),
                detok: IncrementalDecoder::new(true),
                stops: StopStrings::new(p.params.stop.clone()),
                sink: p.sink.clone(),
                pending_children: 0,
                guide: p.guide.clone(),
            });
        }
        out
    }

    /// Sample the next token of `running[idx]` from `row` and stream it.
    fn sample_and_emit(&mut self, idx: usize, row: &[f32]) -> Emitted {
        let eos = &self.eos;
        let seq = &mut self.sched.running[idx];
        let p = seq.params.clone();
        let sp = &p.sampling;
        let generated = seq.generated();
        let mut banned = Vec::new();
        if generated < p.min_tokens {
            banned.extend(eos.iter().chain(&p.stop_token_ids).copied());
        }
        let needs_processing =
            sp.has_penalties() || !sp.logit_bias.is_empty() || !banned.is_empty() || seq.guide.is_some();
        let mut processed;
        // A grammar failure ends the row with an error (after this token).
        let mut guide_error = None;
        let logits = if needs_processing {
            processed = row.to_vec();
            apply_processors(&mut processed, sp, &seq.tokens[..seq.prompt_len], &seq.counts, &banned);
            if let Some(guide) = seq.guide.as_mut() {
                guide_error = guide.constrain(&mut processed, row).err();
            }
            &processed[..]
        } else {
            row
        };
        let step_params = crate::sampling::SamplingParams { seed: seq.seed, ..sp.clone() };
        let token = sample(logits, &step_params, generated as u64);
        let logprobs = p.logprobs.map(|k| token_logprobs(logits, token, k)).into_iter().collect();
        seq.tokens.push(token);
        *seq.counts.entry(token).or_insert(0) += 1;
        self.metrics.add_generated(1);
        let generated = generated + 1;
        let mut complete = false;
        if let (Some(guide), None) = (seq.guide.as_mut(), &guide_error) {
            match guide.commit(&[token]) {
                Ok(()) => complete = guide.is_finished(),
                Err(e) => guide_error = Some(e),
            }
        }

        let is_end = (!p.ignore_eos && eos.contains(&token)) || p.stop_token_ids.contains(&token);
        let mut text = String::new();
        let mut reason = None;
        let (mut stop_string, mut stop_token, mut error) = (None, None, None);
        if is_end {
            reason = Some(FinishReason::Stop);
            stop_token = Some(token);
        } else if let Some(tok) = &self.tokenizer {
            match seq.detok.push(tok, token) {
                Ok(piece) => {
                    let (emit, hit) = seq.stops.push(&piece);
                    text = emit;
                    if hit.is_some() {
                        reason = Some(FinishReason::Stop);
                        stop_string = hit;
                    }
                }
                Err(e) => {
                    reason = Some(FinishReason::Error);
                    error = Some(format!("detokenize: {e}"));
                }
            }
        }
        if let Some(e) = guide_error {
            reason = Some(FinishReason::Error);
            error = Some(e.to_string());
        }
        // The grammar is complete: nothing more may follow.
        complete &= reason.is_none();
        if complete {
            reason = Some(FinishReason::Stop);
        }
        if reason.is_none() && (generated >= seq.max_tokens || seq.tokens.len() >= self.limits.max_model_len) {
            reason = Some(FinishReason::Length);
        }
        if complete || reason == Some(FinishReason::Length) {
            if let Some(tok) = &self.tokenizer {
                let tail = seq.detok.finish(tok).unwrap_or_default();
                text.push_str(&seq.stops.push(&tail).0);
                text.push_str(&seq.stops.flush());
            }
        }
        let finished = reason.map(|reason| Finished { reason, stop_string, stop_token, error, usage: usage(seq) });
        let done = finished.is_some();
        let out = Output { choice: seq.choice, token_ids: vec![token], text, logprobs, finished };
        if seq.sink.send(out).is_err() {
            // The receiver is gone: the caller disconnected.
            return Emitted::Disconnected;
        }
        if done {
            self.metrics.request_finished();
            Emitted::Finished
        } else {
            Emitted::Running
        }
    }

    /// Send a final output for `seq` with no new token.
    fn finish(
        &mut self,
        seq: &mut Sequence,
        reason: FinishReason,
        stop_string: Option<String>,
        stop_token: Option<u32>,
        error: Option<String>,
    ) {
        let out = Output {
            choice: seq.choice,
            token_ids: vec![],
            text: String::new(),
            logprobs: vec![],
            finished: Some(Finished { reason, stop_string, stop_token, error, usage: usage(seq) }),
        };
        let _ = seq.sink.send(out);
        self.kvm.free(&mut seq.kv);
        self.metrics.request_finished();
    }
}

/// What became of a sequence after its token was sampled.
enum Emitted {
    Running,
    Finished,
    /// Its receiver was dropped: the request is aborted.
    Disconnected,
}

fn usage(seq: &Sequence) -> Usage {
    Usage { prompt_tokens: seq.prompt_len, cached_tokens: seq.cached_tokens, completion_tokens: seq.generated() }
}
