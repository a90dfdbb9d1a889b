//! Proposals of the step: before scheduling, each decoding row gets at most one — an echo
//! span (`--fill echo`), a prompt-lookup draft (`--spec ngram`), or room for draft-model
//! tokens — clamped to its room and end tokens; after scheduling, proposals are cut to the
//! room each row was given and the draft model drafts for its rows in one batched run.

use super::EngineCore;
use crate::scheduler::ScheduledRow;
use crate::spec::ngram::{lookup, NgramParams};
use crate::spec::{DraftJob, Origin, Policy, Proposal};
use crate::EngineError;

/// The longest echo span verified in one step.
pub(crate) const ECHO_SPAN: usize = 16;

impl EngineCore {
    /// Give each running row that decodes next its proposal for this step (or room to draft).
    pub(super) fn plan_proposals(&mut self) {
        let max_len = self.limits.max_model_len;
        let k = self.num_draft_tokens;
        let (ngram, draft) = (self.ngram, self.drafter.is_some());
        for s in &mut self.sched.running {
            s.spec.proposal = None;
            s.spec.reserve = 0;
            // A proposal follows the pending token: at most room − 1 tokens.
            let room = s.room(max_len).saturating_sub(1);
            if s.remaining() != 1 || s.pending_children > 0 || room == 0 {
                continue;
            }
            let ends = s.end_tokens(&self.eos);
            let echo = s.fill.mode.echoes().then(|| lookup(&s.tokens, ECHO_SPAN, NgramParams::ECHO));
            let proposal = match echo.filter(|ids| !ids.is_empty()) {
                Some(ids) => Some(Proposal::new(ids, Policy::Verify, Origin::Echo)),
                None if ngram => {
                    Some(Proposal::new(lookup(&s.tokens, k, NgramParams::SPEC), Policy::Verify, Origin::Ngram))
                }
                None => None,
            };
            match proposal {
                Some(mut p) => {
                    p.clamp(room, &ends);
                    if !p.is_empty() {
                        s.spec.reserve = p.len();
                        s.spec.proposal = Some(p);
                    }
                }
                None if draft => s.spec.reserve = k.min(room),
                None => {}
            }
        }
    }

    /// Cut each scheduled row's proposal to the tokens it was given beyond its pending one,
    /// and draft for the rows that reserved room for the draft model.
    pub(super) fn fit_proposals(&mut self, rows: &[ScheduledRow]) -> Result<(), EngineError> {
        let mut drafting = vec![0usize; self.sched.running.len()];
        for r in rows {
            let s = &mut self.sched.running[r.index];
            let extra = r.tokens.saturating_sub(s.remaining());
            match s.spec.proposal.as_mut() {
                Some(p) => {
                    p.clamp(extra, &[]);
                    if p.is_empty() {
                        s.spec.proposal = None;
                    }
                }
                None => drafting[r.index] = extra.min(s.spec.reserve),
            }
        }
        let Some(drafter) = self.drafter.as_mut() else { return Ok(()) };
        let eos = &self.eos;
        let mut jobs = Vec::new();
        let mut owners = Vec::new();
        for (i, s) in self.sched.running.iter_mut().enumerate() {
            let room = drafting.get(i).copied().unwrap_or(0);
            if room > 0 {
                owners.push(i);
                jobs.push(DraftJob {
                    ends: s.end_tokens(eos),
                    tokens: &s.tokens,
                    state: &mut s.spec.draft,
                    room,
                    sampling: &s.params.sampling,
                    seed: s.seed,
                });
            }
        }
        if jobs.is_empty() {
            return Ok(());
        }
        let proposals = drafter.propose(&mut jobs)?;
        self.metrics.set_draft_forwards(drafter.forwards);
        for (i, p) in owners.into_iter().zip(proposals) {
            if !p.is_empty() {
                self.sched.running[i].spec.proposal = Some(p);
            }
        }
        Ok(())
    }
}
