//! Steps the model handed back queued on its device (`Pending::is_queued`). While the device
//! runs a queued step, the engine queues the one after it — every row decoding the token the
//! queued step is picking, its id carried over on the device without the host seeing it
//! (`ForwardBatch::carried`) — and only then lands the queued step (resolves its handle,
//! streams, checks ends). The host's work for a step thus runs while the device computes the
//! next one.
//!
//! The following step is queued only when it is the step the scheduler would build: nothing
//! waits to be admitted, every running row was in the queued step and picks its pending token
//! there, none can end by length, none needs the host between the two steps (a proposal, an
//! output constraint, penalties that count the unseen pick, a fork), and every row gets the
//! KV block of one more position. A row that ends when the queued step lands (an end token, a
//! stop string, a disconnect) had one extra token computed, which is dropped with it; a row
//! whose next tokens became known (an asserted scaffold) keeps the KV of its pick and goes on
//! with them in a normal step. A queued verify step (greedy rows, the device's argmax at each
//! position) keeps its rows' proposals, judged against those ids when it lands; nothing is
//! queued behind it, since how many of its tokens stand is not known until then.

use std::collections::HashMap;

use ferrite_models::model::{run_forward, Pending, Want};
use ferrite_runtime::batch::{RowLogits, RowOptions};
use ferrite_runtime::sampling::RowSampler;
use ferrite_runtime::ForwardBatch;

use super::{emit, EngineCore, PlanRow};
use crate::error::EngineError;
use crate::request::RequestId;
use crate::spec::Proposal;

/// A step queued on the device whose picks were not taken yet: its handle and rows.
pub(super) struct InFlight {
    pending: Pending,
    rows: Vec<FlightRow>,
}

/// A row of a queued step: its sequence (request, choice), first query position, query
/// tokens, logits rows and the proposal it verifies (judged when the step lands).
#[derive(Debug, Clone)]
struct FlightRow {
    key: (RequestId, usize),
    position: usize,
    tokens: usize,
    logits: usize,
    proposal: Option<Proposal>,
}

impl EngineCore {
    /// The step just queued from `plan` (before any of its rows advanced), as `pending`.
    pub(super) fn flight(&self, plan: Vec<PlanRow>, pending: Pending) -> InFlight {
        let rows = plan.into_iter().map(|r| {
            let s = &self.sched.running[r.row()];
            let (tokens, logits, proposal) = (r.tokens, r.logits, r.proposal);
            FlightRow { key: (s.request, s.choice), position: s.num_computed, tokens, logits, proposal }
        });
        InFlight { pending, rows: rows.collect() }
    }

    /// Queue the step after `flight` when it can, then land `flight`. A failure to queue
    /// ends the requests that step was for, after `flight` landed.
    pub(super) fn advance(&mut self, flight: InFlight) -> Result<(), EngineError> {
        let next = self.chain(&flight);
        let keys: Vec<(RequestId, usize)> = flight.rows.iter().map(|r| r.key).collect();
        self.land_flight(flight)?;
        match next {
            Ok(next) => {
                self.in_flight = next;
                Ok(())
            }
            Err(e) => {
                let index = self.running_index();
                Err(self.fail(keys.iter().filter_map(|k| index.get(k).copied()).collect(), e))
            }
        }
    }

    /// Land the queued step, if any (before anything else changes the running rows).
    pub(super) fn drain(&mut self) -> Result<(), EngineError> {
        match self.in_flight.take() {
            Some(flight) => self.land_flight(flight),
            None => Ok(()),
        }
    }

    /// Running index by (request, choice).
    fn running_index(&self) -> HashMap<(RequestId, usize), usize> {
        self.sched.running.iter().enumerate().map(|(i, s)| ((s.request, s.choice), i)).collect()
    }

    /// Resolve `flight` and apply its picks to the rows still where it left them.
    fn land_flight(&mut self, flight: InFlight) -> Result<(), EngineError> {
        let index = self.running_index();
        let plan: Vec<PlanRow> = (flight.rows.into_iter())
            .map(|r| PlanRow {
                index: index.get(&r.key).copied().filter(|&i| self.sched.running[i].num_computed == r.position),
                tokens: r.tokens,
                logits: r.logits,
                proposal: r.proposal,
            })
            .collect();
        self.resolve(plan, flight.pending)
    }

    /// Queue the step after `flight` (see the module docs for when); None when it cannot be.
    fn chain(&mut self, flight: &InFlight) -> Result<Option<InFlight>, EngineError> {
        let running = &self.sched.running;
        if !self.sched.waiting.is_empty() || flight.rows.len() != running.len() || self.ngram || self.drafter.is_some()
        {
            return Ok(None);
        }
        let max_len = self.limits.max_model_len;
        let mut greedy = true;
        for (r, s) in flight.rows.iter().zip(running) {
            let picks_pending =
                r.logits == 1 && s.num_computed == r.position && r.position + r.tokens == s.tokens.len();
            let host_free = s.pending_children == 0
                && s.guide.is_none()
                && !s.fill.mode.echoes()
                && !s.params.sampling.has_penalties();
            // The pick being made ends the row when it reaches max_tokens or the context.
            let goes_on = s.generated() + 1 < s.max_tokens && s.tokens.len() + 1 < max_len;
            if r.key != (s.request, s.choice) || !picks_pending || !host_free || !goes_on {
                return Ok(None);
            }
            greedy &= emit::takes_argmax(s, &self.eos, 1);
        }
        if !greedy && !self.model.samples_on_device() {
            return Ok(None);
        }
        // A row before its quantized start may turn at the next position: its blocks are
        // converted before a step is built, which a chained step skips.
        if running.iter().any(|s| s.kv.full_precision()) {
            return Ok(None);
        }
        for s in &mut self.sched.running {
            if !self.kvm.allocate(&mut s.kv, s.tokens.len() + 1) {
                return Ok(None);
            }
        }
        let mut batch = ForwardBatch::default();
        for (i, s) in self.sched.running.iter().enumerate() {
            // The id is a placeholder: the device carries the queued step's pick of row i in.
            let options = RowOptions { adapter: s.adapter, full_precision: false };
            batch.push_row_with(&[0], s.tokens.len() + 1, s.kv.tables().to_vec(), RowLogits::Last, options);
            batch.carried.push((i, i));
        }
        let samplers: Vec<RowSampler> = match greedy {
            true => Vec::new(),
            false => self.sched.running.iter().map(|s| emit::row_sampler(s, &self.eos, 1)).collect(),
        };
        let want = if greedy { Want::Argmax } else { Want::Sample(&samplers) };
        self.before_forward()?;
        let (model, kv) = (&self.model, &mut self.kv);
        let pending = run_forward(&**model, || model.step(&batch, kv, want))?;
        self.metrics.add_batch(batch.num_tokens());
        self.metrics.add_overlapped();
        let rows = self.sched.running.iter().map(|s| FlightRow {
            key: (s.request, s.choice),
            position: s.tokens.len(),
            tokens: 1,
            logits: 1,
            proposal: None,
        });
        Ok(Some(InFlight { pending, rows: rows.collect() }))
    }
}
