//! The iteration-level scheduler: each step hands out a token budget — running rows first
//! (1 token when decoding, the rest of a prompt chunk by chunk), then chunks of waiting
//! prompts in arrival order. When KV blocks run out, the newest running sequence is preempted:
//! its blocks are freed and it is recomputed later (`num_computed` back to 0), never lost.
//! A decoding row may ask for room for proposed tokens after its pending one (verify and
//! speculation); that room is given only when the budget and free blocks allow — proposals
//! never preempt anyone. An embedding request runs its whole input in one step or waits, and
//! never starts from the prefix cache (it needs every token's states). A row before its
//! quantized KV start gets no span past that start (a chunk or a verify span ends there); the
//! step after, its allocation turns it quantized (`kv/transition.rs`).

use std::collections::VecDeque;

use crate::kv::KvManager;
use crate::sequence::Sequence;

/// One row of the next batch: `running[index]` runs `tokens` query tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ScheduledRow {
    pub index: usize,
    pub tokens: usize,
}

pub(crate) struct Scheduler {
    pub waiting: VecDeque<Sequence>,
    pub running: Vec<Sequence>,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub preemptions: u64,
}

impl Scheduler {
    pub fn new(max_num_batched_tokens: usize, max_num_seqs: usize) -> Scheduler {
        Scheduler {
            waiting: VecDeque::new(),
            running: Vec::new(),
            max_num_batched_tokens,
            max_num_seqs,
            preemptions: 0,
        }
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Free a sequence's blocks and queue it for recomputation ahead of new arrivals.
    fn preempt(&mut self, mut seq: Sequence, kvm: &mut KvManager) {
        // The old allocation's blocks go back as it is replaced.
        seq.kv = kvm.fresh(&seq.kv);
        seq.num_computed = 0;
        seq.looked_up = false;
        self.preemptions += 1;
        self.waiting.push_front(seq);
    }

    pub fn schedule(&mut self, kvm: &mut KvManager) -> Vec<ScheduledRow> {
        let mut budget = self.max_num_batched_tokens;
        let mut rows = Vec::new();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &mut self.running[i];
            // A row before its quantized start computes up to it, then turns (`allocate`).
            let mut n = seq.wanted().min(budget).min(seq.kv.room_before_start(seq.num_computed));
            if n > seq.remaining() && !kvm.allocate(&mut seq.kv, seq.num_computed + n) {
                n = seq.remaining().min(budget).min(seq.kv.room_before_start(seq.num_computed));
            }
            let total = self.running[i].num_computed + n;
            let mut fits = true;
            while !kvm.allocate(&mut self.running[i].kv, total) {
                // Preempt the newest running sequence; if that is this one, it waits.
                let victim = self.running.pop().expect("running is non-empty");
                let was_self = self.running.len() == i;
                self.preempt(victim, kvm);
                if was_self {
                    fits = false;
                    break;
                }
            }
            if !fits {
                break;
            }
            rows.push(ScheduledRow { index: i, tokens: n });
            budget -= n;
            i += 1;
        }
        while budget > 0 && self.running.len() < self.max_num_seqs {
            let Some(seq) = self.waiting.front_mut() else { break };
            if !seq.looked_up {
                if seq.kv.is_empty() && !seq.params.embed {
                    seq.num_computed = kvm.acquire_prefix(&mut seq.kv, &seq.tokens);
                    if seq.first_admission() {
                        seq.note_first_hit(kvm.block_size());
                    }
                }
                seq.looked_up = true;
            }
            let n = seq.remaining().min(budget).min(seq.kv.room_before_start(seq.num_computed));
            if seq.params.embed && n < seq.remaining() {
                break;
            }
            if !kvm.allocate(&mut seq.kv, seq.num_computed + n) {
                if self.running.is_empty() && self.release_waiting_blocks(kvm) {
                    continue;
                }
                break;
            }
            let seq = self.waiting.pop_front().expect("front exists");
            rows.push(ScheduledRow { index: self.running.len(), tokens: n });
            self.running.push(seq);
            budget -= n;
        }
        rows
    }

    /// With nothing running and the head of the queue unable to get blocks, blocks held by
    /// other waiting sequences (forked children, prefix hits) are released, newest first.
    /// Returns false when there was nothing to release.
    fn release_waiting_blocks(&mut self, kvm: &mut KvManager) -> bool {
        let Some(idx) = self.waiting.iter().skip(1).rposition(|s| !s.kv.is_empty()).map(|p| p + 1) else {
            return false;
        };
        let seq = &mut self.waiting[idx];
        seq.kv = kvm.fresh(&seq.kv);
        seq.num_computed = 0;
        seq.looked_up = false;
        true
    }
}
