//! `EngineCore`: the step loop, synchronous and single-threaded — plan proposals,
//! `schedule()`, draft, build one `ForwardBatch`, `model.step()`, then for each row that
//! reached the end of its tokens decide its tokens (sample, or verify its proposal), append,
//! detokenize, check stops, stream, roll back rejected KV and free what finished. The engine
//! thread (`engine.rs`) drives it; tests drive it directly. Proposal planning lives in
//! `core/propose.rs`, token decisions and streaming in `core/emit.rs`. Constrained rows
//! (structured output) compute their token masks while the model runs and sample under them;
//! other rows are sampled by the model on its device when it can (only ids and requested
//! logprobs come back). A step the model hands back queued (the GPU's argmax and sampled
//! steps) is landed in the next iteration, which first queues the step after when it can
//! (`core/overlap.rs`), so the host's work for one step runs while the device computes the
//! next.

mod adapters;
mod embed;
mod emit;
mod overlap;
mod propose;
mod restore;
mod tiers;
mod turn;

pub use adapters::AdapterNames;

use std::sync::Arc;

use ferrite_models::model::{run_forward, CausalLm, Pending, StepLimits, StepOutput, Want};
use ferrite_models::tokenizer::{IncrementalDecoder, Tokenizer};
use ferrite_runtime::batch::{RowLogits, RowOptions};
use ferrite_runtime::sampling::{RowSampler, SampledToken};
use ferrite_runtime::{ForwardBatch, KvCache, RuntimeError};
use tokio::sync::mpsc::UnboundedSender;

use crate::config::Speculation;
use crate::config::{EngineConfig, Limits};
use crate::error::EngineError;
use crate::fill::{FillState, ToolScaffold};
use crate::kv::KvManager;
use crate::kv_precision::KvChoices;
use crate::metrics::Metrics;
use crate::request::{FinishReason, Output, Request, RequestId, Usage};
use crate::scheduler::Scheduler;
use crate::sequence::Sequence;
use crate::spec::{Drafter, Proposal, SpecState};
use crate::stop::StopStrings;
use crate::stream::{Sink, Streamer};
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
    /// Prompt lookup as the speculative method.
    ngram: bool,
    drafter: Option<Drafter>,
    num_draft_tokens: usize,
    fill: crate::fill::FillMode,
    scaffold: Option<Arc<ToolScaffold>>,
    grammars: Arc<Grammars>,
    /// Whether a step the model hands back queued is landed in the next iteration (after
    /// the step following it was queued) rather than waited for at once.
    overlap: bool,
    /// The step queued on the model's device and not landed yet (`overlap`).
    in_flight: Option<overlap::InFlight>,
    /// The prefix cache's namespace digest (`tiers::namespace`).
    namespace: u64,
    /// The host-RAM tier below the pool (`--host-cache-memory`).
    host: Option<crate::kv::host::HostTier>,
    /// The SSD tier below it (`--prefix-cache-dir`).
    disk: Option<crate::kv::disk::DiskTier>,
    /// The host slots the SSD tier's block copies go through (with `disk`).
    staging: Option<crate::kv::TierSlots>,
    /// Records of interrupted generations (`--generation-checkpoint`).
    resumes: Option<tiers::Resumes>,
    adapters: adapters::Adapters,
    /// The streaming thread outputs go through (`stream_from_thread`); None: sent at once.
    streamer: Option<Streamer>,
}

/// The streaming detokenizer of a sequence that continues `prompt`: its first token is
/// decoded in the prompt's context (a SentencePiece `▁word` keeps its space).
fn detokenizer(tokenizer: Option<&Tokenizer>, prompt: &[u32]) -> IncrementalDecoder {
    match tokenizer {
        Some(tok) => IncrementalDecoder::with_prompt(tok, prompt, true),
        None => IncrementalDecoder::new(true),
    }
}

/// KV bytes a token of context takes: every group's block over its positions, a recurrent
/// group's state snapshot shared by the positions between snapshots.
fn kv_bytes_per_token(cfg: &EngineConfig, layout: &ferrite_runtime::KvLayout, block_bytes: &[usize]) -> usize {
    let (stride, recurrent) = (cfg.snapshot_stride(layout, block_bytes), layout.recurrent_group());
    let bytes: usize =
        (block_bytes.iter().enumerate()).map(|(g, &b)| if Some(g) == recurrent { b / stride } else { b }).sum();
    bytes / cfg.block_size
}

/// The seed of choice `i` of a request seeded with `seed` (its draws are `uniform(seed, step)`).
pub fn choice_seed(seed: u64, choice: usize) -> u64 {
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
        model.prepare(&StepLimits {
            max_tokens: cfg.max_num_batched_tokens,
            max_rows: cfg.max_num_seqs,
            max_model_len,
            block_size: cfg.block_size,
        })?;
        let block_bytes = model.kv_block_bytes(cfg.block_size, &cfg.kv_scheme)?;
        let group_blocks = cfg.group_blocks(&layout, &block_bytes, model.free_kv_memory()?, max_model_len)?;
        let (kv, group_blocks, full_blocks) =
            crate::kv_precision::new_cache(&*model, cfg, &layout, &group_blocks, &block_bytes)?;
        // A bidirectional model's KV depends on the tokens after it: no prefix is shareable.
        let prefix_cache = cfg.prefix_cache && model.generates();
        // The namespace holds the KV scheme through the pools' own description (`tiers`); a
        // row's quantized start is in its chains' root (`kv::SeqKv`).
        let namespace = tiers::namespace(cfg.namespace, &kv, &layout, cfg.block_size);
        let mut kvm = KvManager::with_full_precision(
            &layout,
            &group_blocks,
            &full_blocks,
            cfg.block_size,
            prefix_cache.then_some(namespace),
        );
        let kv_choices = KvChoices::new(cfg, model.kv_description(&cfg.kv_scheme), &kvm);
        // Without a prefix cache a recurrent state needs no snapshots, only its live entry.
        kvm.set_snapshot_stride(if prefix_cache { cfg.snapshot_stride(&layout, &block_bytes) } else { usize::MAX });
        let limits = Limits {
            max_model_len,
            vocab_size: mcfg.vocab_size,
            kv_capacity_tokens: kvm.capacity_tokens(),
            kv_bytes_per_token: kv_bytes_per_token(cfg, &layout, &block_bytes),
            kv_scheme: kv_choices.describe(),
            kv: kv_choices,
            has_tokenizer: tokenizer.is_some(),
            max_n: 64,
            max_step_tokens: cfg.max_num_batched_tokens,
            embedding: model.embedding().cloned(),
            generates: model.generates(),
        };
        let drafter = match &cfg.speculation {
            Speculation::Draft(draft) => {
                let d = Drafter::new(draft.clone(), cfg, max_model_len)?;
                if d.vocab_size() != mcfg.vocab_size {
                    return Err(EngineError::Config(format!(
                        "the draft model's vocabulary ({}) differs from the target's ({}): they must share a tokenizer",
                        d.vocab_size(),
                        mcfg.vocab_size
                    )));
                }
                Some(d)
            }
            _ => None,
        };
        let speculates = !matches!(cfg.speculation, Speculation::Off);
        if speculates && cfg.num_draft_tokens == 0 {
            return Err(EngineError::Config("the number of draft tokens must be at least 1".into()));
        }
        let metrics = Arc::new(Metrics::default());
        metrics.set_kv(kvm.free_blocks());
        let stride = cfg.snapshot_stride(&layout, &block_bytes);
        let host = tiers::open_host(cfg, &kv, &mut kvm, stride, &metrics)?;
        let (disk, staging) = tiers::open_disk(cfg, &kv, &kvm, namespace, &metrics)?.unzip();
        let resumes = cfg.generation_checkpoint.map(tiers::Resumes::new).transpose()?;
        metrics.set_kv_size(limits.kv_bytes_per_token, limits.kv_capacity_tokens);
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
            ngram: matches!(cfg.speculation, Speculation::Ngram),
            drafter,
            num_draft_tokens: cfg.num_draft_tokens,
            fill: cfg.fill,
            scaffold: cfg.tool_scaffold.clone(),
            grammars,
            overlap: cfg.overlap,
            in_flight: None,
            namespace,
            host,
            disk,
            staging,
            resumes,
            adapters: adapters::Adapters::new(cfg.max_loras),
            streamer: None,
        })
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }
    pub fn has_work(&self) -> bool {
        self.sched.has_work() || self.in_flight.is_some()
    }
    pub fn kv_manager(&self) -> &KvManager {
        &self.kvm
    }
    /// What output constraints compile against (shared with the `Engine` front).
    pub fn grammars(&self) -> Arc<Grammars> {
        self.grammars.clone()
    }

    /// Send every output from now on through a streaming thread of its own, off the step's
    /// critical path (the threaded `Engine` does; a core driven on its caller's thread sends
    /// at once, so its outputs are in the channels when `step` returns).
    pub fn stream_from_thread(&mut self) -> Result<(), EngineError> {
        let streamer = Streamer::spawn().map_err(|e| EngineError::Config(format!("streaming thread: {e}")))?;
        self.streamer = Some(streamer);
        Ok(())
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
        let start = self.limits.kv.resolve(&req.params)?;
        let adapter = self.adapter_slot(req.params.adapter.as_deref())?;
        let n = req.params.n;
        let seed = choice_seed(req.params.sampling.seed, 0);
        let mode = req.params.fill.unwrap_or(self.fill);
        let cursor = match &self.scaffold {
            Some(s) if mode.asserts_scaffolds() => s.cursor_after(&req.prompt),
            _ => Default::default(),
        };
        let fill = FillState { mode, cursor, ..Default::default() };
        let detok = detokenizer(self.tokenizer.as_deref(), &req.prompt);
        let mut seq = Sequence {
            request: id,
            choice: 0,
            seed,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            num_computed: 0,
            kv: self.kvm.new_seq_from(adapter.map_or(0, |a| a.root), start),
            adapter: adapter.map(|a| a.id),
            looked_up: false,
            cached_tokens: 0,
            max_tokens,
            counts: Default::default(),
            detok,
            stops: StopStrings::new(req.params.stop.clone()),
            params: Arc::new(req.params),
            sink: Sink::new(sink, self.streamer.clone()),
            pending_children: n - 1,
            fill,
            spec: SpecState::default(),
            guide,
            tier: Default::default(),
        };
        self.metrics.requests_added();
        if self.admit_from_tiers(&mut seq) {
            // Replaying an interrupted run of it ended it.
            return Ok(());
        }
        self.sched.waiting.push_back(seq);
        self.metrics.set_queue(self.sched.running.len(), self.sched.waiting.len());
        Ok(())
    }

    /// Cancel every choice of request `id`; its blocks are freed now (a queued step lands
    /// first; its failure has already ended the requests it was for).
    pub fn abort(&mut self, id: RequestId) {
        let _ = self.drain();
        let mut aborted = Vec::new();
        let mut i = 0;
        while i < self.sched.running.len() {
            if self.sched.running[i].request == id {
                // Cut off: what it computed stays in the tiers for a retry.
                self.cut(i);
                aborted.push(self.sched.running.remove(i));
            } else {
                i += 1;
            }
        }
        let (hit, kept): (Vec<Sequence>, Vec<Sequence>) = self.sched.waiting.drain(..).partition(|s| s.request == id);
        self.sched.waiting.extend(kept);
        // Dropping them returns their blocks, in the target's KV and the draft's.
        drop((aborted, hit));
        self.after_step_bookkeeping();
    }

    /// One engine iteration. A model failure ends the requests of this step with an error.
    /// With a step queued on the device (`in_flight`), the iteration queues the one after it
    /// when it can and then lands the queued one (`overlap`).
    pub fn step(&mut self) -> Result<(), EngineError> {
        if let Some(flight) = self.in_flight.take() {
            return self.advance(flight);
        }
        self.plan_proposals();
        self.install_restores();
        let rows = self.sched.schedule(&mut self.kvm);
        if let Err(e) = self.convert_turned() {
            return Err(self.fail_rows(&rows, e));
        }
        let rows = self.run_embeddings(rows);
        if rows.is_empty() {
            self.after_step_bookkeeping();
            return Ok(());
        }
        if let Err(e) = self.fit_proposals(&rows) {
            return Err(self.fail_rows(&rows, e));
        }
        let mut batch = ForwardBatch::default();
        let mut plan: Vec<PlanRow> = Vec::with_capacity(rows.len());
        for r in &rows {
            let s = &mut self.sched.running[r.index];
            let mut proposal = s.spec.proposal.take();
            // A model with recurrent state keeps the state after each proposed position, so a
            // rejected tail rolls back; without free slots for them the row decodes plainly.
            if proposal.as_ref().is_some_and(|p| !self.kvm.reserve_span(&mut s.kv, s.num_computed, p.len())) {
                proposal = None;
            }
            let end = s.num_computed + r.tokens.min(s.remaining());
            let (logits, n_logits) = match &proposal {
                Some(p) => (RowLogits::All, 1 + p.len()),
                None if end == s.tokens.len() => (RowLogits::Last, 1),
                None => (RowLogits::None, 0),
            };
            let mut query = s.tokens[s.num_computed..end].to_vec();
            if let Some(p) = &proposal {
                query.extend(&p.ids);
            }
            let context = s.num_computed + query.len();
            // A row shorter than its allocation (a proposal cut short) keeps its live state at
            // its own end (a no-op without recurrent state).
            if !self.kvm.fit_row(&mut s.kv, context) {
                let e = EngineError::Model(RuntimeError::Shape("no recurrent state slot for a row".into()));
                return Err(self.fail_rows(&rows, e));
            }
            let options = RowOptions { adapter: s.adapter, full_precision: s.kv.full_precision() };
            batch.push_row_with(&query, context, s.kv.tables().to_vec(), logits, options);
            if let Some(row) = batch.rows.last_mut() {
                row.span_states = s.kv.span_states().to_vec();
            }
            plan.push(PlanRow { index: Some(r.index), tokens: end - s.num_computed, logits: n_logits, proposal });
        }
        self.metrics.add_batch(batch.num_tokens());
        // When every row takes the plain argmax of its logits rows (a verify row's at each of
        // its positions: greedy acceptance compares the proposal with them), the model may
        // pick the tokens itself (on its device) and hand back only the ids.
        let greedy = plan.iter().all(|r| r.logits == 0 || self.plain_greedy(r.row()));
        // Otherwise a model that samples on its device does it for rows without a proposal or
        // an output constraint (those judge or mask full logits rows on the host).
        let on_device = !greedy
            && self.model.samples_on_device()
            && plan
                .iter()
                .all(|r| r.logits == 0 || (r.proposal.is_none() && self.sched.running[r.row()].guide.is_none()));
        let samplers: Vec<RowSampler> = if on_device {
            let rows = plan.iter().filter(|r| r.logits > 0);
            rows.map(|r| emit::row_sampler(&self.sched.running[r.row()], &self.eos, 0)).collect()
        } else {
            Vec::new()
        };
        let want = match (greedy, on_device) {
            (true, _) => Want::Argmax,
            (false, true) => Want::Sample(&samplers),
            (false, false) => Want::Logits,
        };
        if let Err(e) = self.before_forward() {
            return Err(self.fail_rows(&rows, e));
        }
        // Constrained rows about to sample compute their token masks on a helper thread
        // meanwhile.
        let sampling: Vec<usize> = plan.iter().filter(|r| r.logits > 0).map(PlanRow::row).collect();
        let guides: Vec<&mut Guide> = (self.sched.running.iter_mut().enumerate())
            .filter(|(i, _)| sampling.contains(i))
            .filter_map(|(_, s)| s.guide.as_mut())
            .collect();
        let (model, kv) = (&self.model, &mut self.kv);
        // A CPU model runs on a pool worker: each op's parallel loop then forks within the
        // pool instead of waking it from outside (see `threads::run`, `run_forward`).
        let pending = std::thread::scope(|scope| {
            if !guides.is_empty() {
                scope.spawn(move || guides.into_iter().for_each(Guide::prepare_mask));
            }
            run_forward(&**model, || model.step(&batch, kv, want))
        });
        let pending = match pending {
            Ok(pending) => pending,
            Err(e) => return Err(self.fail_rows(&rows, e.into())),
        };
        // A queued step is landed by the next iteration, which queues the one after it first.
        if pending.is_queued() && self.overlap {
            self.in_flight = Some(self.flight(plan, pending));
            return Ok(());
        }
        self.resolve(plan, pending)
    }

    /// Wait for `pending`, the step of `plan`, and land it; a failure, or outputs that do not
    /// cover the logits rows the step asked for, ends the requests of its rows still running.
    fn resolve(&mut self, plan: Vec<PlanRow>, pending: Pending) -> Result<(), EngineError> {
        let wanted: usize = plan.iter().map(|r| r.logits).sum();
        let out = pending.wait().map_err(EngineError::from).and_then(|out| match out.rows(self.limits.vocab_size) {
            got if got == wanted => Ok(out),
            got => Err(EngineError::Model(RuntimeError::Shape(format!("a step gave {got} outputs for {wanted} rows")))),
        });
        match out {
            Ok(out) => {
                self.land(plan, &out);
                Ok(())
            }
            Err(e) => Err(self.fail(plan.iter().filter_map(|r| r.index).collect(), e)),
        }
    }

    /// Apply a step's outputs to the rows of its `plan`: count their computed tokens, decide
    /// the tokens of the rows that sampled, fork children, free what finished.
    fn land(&mut self, plan: Vec<PlanRow>, out: &StepOutput) {
        let vocab = self.limits.vocab_size;
        let mut done = Vec::new();
        let mut disconnected = Vec::new();
        let mut children = Vec::new();
        let mut offset = 0;
        for PlanRow { index, tokens, logits: n_logits, proposal } in plan {
            let first = offset;
            offset += n_logits;
            // A row that left while the step ran (landing a queued step) is skipped.
            let Some(idx) = index else { continue };
            let s = &mut self.sched.running[idx];
            s.num_computed += tokens;
            // Without logits, or when known tokens follow (asserted while this step was
            // queued behind the one that picked them), only the KV counts.
            if n_logits == 0 || s.num_computed < s.tokens.len() {
                self.kvm.after_step(&mut s.kv, &s.tokens, s.num_computed);
                continue;
            }
            let pick = match out {
                StepOutput::Logits(logits) => Pick::Logits(&logits[first * vocab..(first + n_logits) * vocab]),
                StepOutput::Ids(ids) => Pick::Tokens(&ids[first..first + n_logits]),
                StepOutput::Sampled(picked) => Pick::Sampled(&picked[first]),
            };
            if s.pending_children > 0 {
                self.kvm.after_step(&mut s.kv, &s.tokens, s.num_computed);
                children.extend(self.fork(idx));
            }
            match self.decide(idx, pick, proposal) {
                Emitted::Running => {}
                Emitted::Finished => done.push(idx),
                Emitted::Disconnected => disconnected.push(self.sched.running[idx].request),
            }
        }
        done.sort_unstable();
        self.publish_step(&done);
        // A finished sequence's blocks go back as it is dropped.
        for idx in done.into_iter().rev() {
            self.sched.running.remove(idx);
        }
        for child in children.into_iter().rev() {
            self.sched.waiting.push_front(child);
        }
        for id in disconnected {
            self.abort(id);
        }
        self.after_step_bookkeeping();
    }

    /// End the requests of this step's `rows` with the error `e` and return it.
    fn fail_rows(&mut self, rows: &[crate::scheduler::ScheduledRow], e: EngineError) -> EngineError {
        self.fail(rows.iter().map(|r| r.index).collect(), e)
    }

    /// End the running sequences at `indices` with the error `e` and return it.
    fn fail(&mut self, mut indices: Vec<usize>, e: EngineError) -> EngineError {
        let msg = e.to_string();
        indices.sort_unstable();
        indices.dedup();
        for idx in indices.into_iter().rev() {
            let seq = self.sched.running.remove(idx);
            self.finish(seq, FinishReason::Error, None, None, Some(msg.clone()));
        }
        self.after_step_bookkeeping();
        e
    }

    fn after_step_bookkeeping(&mut self) {
        self.metrics.set_queue(self.sched.running.len(), self.sched.waiting.len());
        self.metrics.set_kv(self.kvm.free_blocks());
        if let Some(c) = self.kvm.prefix_cache() {
            self.metrics.set_prefix(c.queried_tokens, c.hit_tokens);
        }
        self.metrics.set_preemptions(self.sched.preemptions);
        #[cfg(debug_assertions)]
        if let Err(e) = self.check_kv_invariants() {
            panic!("KV block pool invariant broken: {e}");
        }
    }

    /// Check the KV pools (the target's and the draft's): every free list agrees with the
    /// counts, and every block's count is the number of live table entries holding it.
    pub fn check_kv_invariants(&self) -> Result<(), String> {
        let seqs = || self.sched.running.iter().chain(&self.sched.waiting);
        self.kvm.check_invariants()?;
        self.kvm.check_holders(seqs().map(|s| &s.kv))?;
        match &self.drafter {
            Some(d) => d.check_invariants(seqs().map(|s| &s.spec.draft)),
            None => Ok(()),
        }
    }

    /// Children 1..n of the request at `running[idx]`, sharing its prompt's full blocks; each
    /// recomputes the prompt's last partial block itself.
    fn fork(&mut self, idx: usize) -> Vec<Sequence> {
        let bs = self.kvm.block_size();
        let parent = &mut self.sched.running[idx];
        let n = std::mem::take(&mut parent.pending_children);
        let shared = (parent.prompt_len - 1) / bs;
        let base_seed = parent.params.sampling.seed;
        let mut out = Vec::with_capacity(n);
        for choice in 1..=n {
            let p = &self.sched.running[idx];
            let kv = self.kvm.share_prefix(&p.kv, shared);
            out.push(Sequence {
                request: p.request,
                choice,
                params: p.params.clone(),
                seed: choice_seed(base_seed, choice),
                tokens: p.tokens[..p.prompt_len].to_vec(),
                prompt_len: p.prompt_len,
                num_computed: kv.tables().first().map_or(0, |t| t.len()) * bs,
                // Without shared blocks (a sliding window or recurrent state) a child starts
                // from a prefix-cache hit on the parent's prompt.
                looked_up: !kv.is_empty(),
                kv,
                adapter: p.adapter,
                cached_tokens: p.cached_tokens,
                max_tokens: p.max_tokens,
                counts: Default::default(),
                detok: detokenizer(self.tokenizer.as_deref(), &p.tokens[..p.prompt_len]),
                stops: StopStrings::new(p.params.stop.clone()),
                sink: p.sink.clone(),
                pending_children: 0,
                fill: FillState { mode: p.fill.mode, cursor: p.fill.cursor, ..Default::default() },
                spec: SpecState::default(),
                guide: p.guide.clone(),
                tier: Default::default(),
            });
        }
        out
    }

    /// Whether `running[idx]` takes the argmax of the raw logits this step, at each of its
    /// logits rows (a `min_tokens` ban only lifts as tokens are appended, so none starts at a
    /// later position of a verify row).
    fn plain_greedy(&self, idx: usize) -> bool {
        emit::takes_argmax(&self.sched.running[idx], &self.eos, 0)
    }
}

impl Drop for EngineCore {
    fn drop(&mut self) {
        self.detach_adapters();
    }
}

/// A row of a step: which running sequence (None: it left before the step landed), its
/// query tokens, the logits rows it gets, and its proposal.
struct PlanRow {
    index: Option<usize>,
    tokens: usize,
    logits: usize,
    proposal: Option<Proposal>,
}

impl PlanRow {
    /// The running index of a row of a step being built.
    fn row(&self) -> usize {
        self.index.expect("a scheduled row is running")
    }
}

/// One row's part of a `StepOutput`.
enum Pick<'a> {
    Logits(&'a [f32]),
    /// The argmax of each of the row's logits rows (one, or 1 + a proposal's length).
    Tokens(&'a [u32]),
    Sampled(&'a SampledToken),
}

/// What became of a sequence after its tokens were decided.
enum Emitted {
    Running,
    Finished,
    /// Its receiver was dropped: the request is aborted.
    Disconnected,
}

fn usage(seq: &Sequence) -> Usage {
    Usage {
        prompt_tokens: seq.prompt_len,
        cached_tokens: seq.cached_tokens,
        completion_tokens: seq.generated(),
        fill: seq.fill.usage,
        speculation: seq.spec.usage,
        tiers: crate::request::TierUsage {
            host_tokens: seq.tier.tier_tokens[crate::kv::TierKind::Host as usize],
            ssd_tokens: seq.tier.tier_tokens[crate::kv::TierKind::Ssd as usize],
            resumed_tokens: seq.tier.resumed,
        },
    }
}
