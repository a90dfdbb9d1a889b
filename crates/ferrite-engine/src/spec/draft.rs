//! `Drafter`: a small draft model with its own paged KV cache inside the engine. Each step it
//! runs up to k batched forwards over every row that speculates — the first one catches each
//! row's draft KV up with the tokens the target committed since, the next ones feed back the
//! token just drafted — and returns one verify proposal per row. After verification the row's
//! draft KV is rolled back to the tokens that stood.

use std::sync::Arc;

use ferrite_models::model::{run_forward, CausalLm, Want};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::{ForwardBatch, KvCache, KvScheme, RuntimeError};
use rand::Rng;

use super::proposal::{Origin, Policy, Proposal};
use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::kv::{KvManager, SeqKv};
use crate::sampling::{distribution, draw, rng_for, sample, SamplingParams};

/// Salt mixed into a request's seed for the draft's own draws, so they are independent of the
/// target's acceptance draws at the same output position.
const DRAFT_SALT: u64 = 0xD4AF_7000_0000_0001;

/// One sequence's KV in the draft model: its blocks (made at its first draft; dropping them
/// returns them to the draft's pools) and how many of its tokens they hold.
#[derive(Debug, Default)]
pub struct DraftKv {
    pub kv: Option<SeqKv>,
    pub computed: usize,
}

/// One row to draft for.
pub struct DraftJob<'a> {
    /// The sequence so far (prompt, output and the pending token).
    pub tokens: &'a [u32],
    pub state: &'a mut DraftKv,
    /// The most tokens to draft.
    pub room: usize,
    pub sampling: &'a SamplingParams,
    /// The sequence's own seed (its choice's).
    pub seed: u64,
    /// Tokens that end the request (drafting stops after one).
    pub ends: Vec<u32>,
}

pub struct Drafter {
    model: Arc<dyn CausalLm>,
    kv: KvCache,
    kvm: KvManager,
    max_len: usize,
    /// Draft forward passes run so far.
    pub forwards: u64,
}

impl Drafter {
    pub fn new(model: Arc<dyn CausalLm>, cfg: &EngineConfig, max_model_len: usize) -> Result<Drafter, EngineError> {
        let max_len = max_model_len.min(model.config().max_context());
        let layout = model.kv_layout();
        // The draft's own KV stays at the default precision, whatever the target's scheme.
        let scheme = KvScheme::default();
        let block_bytes = model.kv_block_bytes(cfg.block_size, &scheme)?;
        let group_blocks = cfg.group_blocks(&layout, &block_bytes, model.free_kv_memory()?, max_len)?;
        let kv = model.new_kv_cache(&group_blocks, cfg.block_size, &scheme)?;
        let mut kvm = KvManager::new(&layout, &group_blocks, cfg.block_size, None);
        // No prefix cache: a recurrent state needs no snapshots, only its live entry.
        kvm.set_snapshot_stride(usize::MAX);
        Ok(Drafter { model, kv, kvm, max_len, forwards: 0 })
    }

    pub fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    /// Draft for every job at once: one proposal per job (empty where the draft KV had no room).
    pub fn propose(&mut self, jobs: &mut [DraftJob<'_>]) -> Result<Vec<Proposal>, EngineError> {
        let mut out: Vec<Proposal> =
            jobs.iter().map(|_| Proposal::new(Vec::new(), Policy::Verify, Origin::Draft)).collect();
        let mut active: Vec<usize> = Vec::new();
        for (i, job) in jobs.iter_mut().enumerate() {
            let kv = job.state.kv.get_or_insert_with(|| self.kvm.new_seq());
            // A span no verdict rolled back from: its row's last state stands.
            self.kvm.drop_span(kv);
            let mut room = job.room.min((self.max_len + 1).saturating_sub(job.tokens.len()));
            // A draft with recurrent state keeps the state after each drafted token it feeds
            // back (rounds 1..room), so `rollback` can return to any accepted length; without
            // free slots for them it drafts one token.
            if room > 1 && !self.kvm.reserve_span(kv, job.tokens.len() - 1, room - 1) {
                room = 1;
            }
            job.room = room;
            if room > 0 && self.kvm.allocate(kv, job.tokens.len() + room - 1) {
                active.push(i);
            }
        }
        let vocab = self.vocab_size();
        let mut round = 0usize;
        while !active.is_empty() {
            let mut batch = ForwardBatch::default();
            for &i in &active {
                let job = &mut jobs[i];
                let last = out[i].ids.last().copied();
                let query: Vec<u32> = match last {
                    None => job.tokens[job.state.computed..].to_vec(),
                    Some(t) => vec![t],
                };
                let context = job.state.computed + query.len();
                // Each round's live state goes to the entry of its last position.
                let fitted = match job.state.kv.as_mut() {
                    Some(kv) => self.kvm.fit_row(kv, context).then(|| kv.tables().to_vec()),
                    None => None,
                };
                let tables = fitted
                    .ok_or_else(|| EngineError::Model(RuntimeError::Shape("no draft state slot for a row".into())))?;
                batch.push_row(&query, context, tables, RowLogits::Last);
                // Round r feeds drafted token r back; its state also goes to span slot r − 1.
                let span = job.state.kv.as_ref().and_then(|kv| kv.span_states().get(round.wrapping_sub(1)).copied());
                if let (Some(slot), true, Some(row)) = (span, round > 0, batch.rows.last_mut()) {
                    row.span_states = vec![slot];
                }
            }
            // As the target's step (see `run_forward`).
            let (model, kv) = (&self.model, &mut self.kv);
            let logits = run_forward(&**model, || model.step(&batch, kv, Want::Logits)?.logits())?;
            self.forwards += 1;
            let mut still = Vec::with_capacity(active.len());
            for (k, &i) in active.iter().enumerate() {
                let job = &mut jobs[i];
                job.state.computed += batch.rows[k].query_len;
                let row = &logits[k * vocab..(k + 1) * vocab];
                let step = (job.tokens.len() + round) as u64;
                let sp = job.sampling;
                let token = if sp.is_greedy() {
                    sample(row, sp, step)
                } else {
                    let q = distribution(row, sp);
                    let t = draw(&q, rng_for(job.seed ^ DRAFT_SALT, step).random());
                    out[i].draft_probs.push(q);
                    t
                };
                out[i].ids.push(token);
                if out[i].ids.len() < job.room && !job.ends.contains(&token) {
                    still.push(i);
                }
            }
            active = still;
            round += 1;
        }
        Ok(out)
    }

    /// Keep the draft KV of the first `valid` tokens of a sequence.
    pub fn rollback(&mut self, state: &mut DraftKv, valid: usize) {
        let fed = state.computed;
        state.computed = fed.min(valid);
        if let Some(kv) = state.kv.as_mut() {
            if state.computed == fed {
                // Everything fed stood: the live state is right, and the span slots of rounds
                // that never ran hold nothing.
                self.kvm.drop_span(kv);
            }
            self.kvm.truncate(kv, state.computed, state.computed);
        }
    }

    /// Check the draft's pools against `holders`, the draft KV of every live sequence (see
    /// `KvManager::check_holders`).
    pub fn check_invariants<'a>(&self, holders: impl IntoIterator<Item = &'a DraftKv>) -> Result<(), String> {
        self.kvm.check_invariants()?;
        self.kvm.check_holders(holders.into_iter().filter_map(|d| d.kv.as_ref()))
    }
}
