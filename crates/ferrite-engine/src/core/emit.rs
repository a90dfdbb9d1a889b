//! Deciding and streaming a row's tokens after the forward: sample the next token, or judge a
//! verify proposal position by position (each emitted token goes through the same stop,
//! end-token and length checks, in order; a constrained row's grammar masks every position,
//! advanced by the tokens that stood before it), assert what is known to follow (a tool-call
//! scaffold after its trigger, or the tokens a grammar forces), then commit — the KV keeps
//! only the positions that stood.

use std::borrow::Cow;

use super::{usage, Emitted, EngineCore, Pick};
use crate::metrics::Metrics;
use crate::request::{FinishReason, Finished, Output};
use crate::sampling::{
    apply_processors, processor_edits, sample, token_logprobs, uniform, SamplingParams, TokenLogprob,
};
use crate::sequence::Sequence;
use crate::spec::usage as tally;
use crate::spec::verify::{judge, Verdict};
use crate::spec::{Origin, Policy, Proposal};
use ferrite_models::tokenizer::Tokenizer;
use ferrite_runtime::sampling::{RowSampler, RowSampling};

/// The end tokens `seq` may not pick yet (`min_tokens`), `ahead` tokens after its last known
/// one.
fn banned(seq: &Sequence, eos: &[u32], ahead: usize) -> Vec<u32> {
    let p = &seq.params;
    if seq.generated() + ahead < p.min_tokens {
        eos.iter().chain(&p.stop_token_ids).copied().collect()
    } else {
        Vec::new()
    }
}

/// What a device that samples does for `seq`'s next token: the processors `processed`
/// applies (as edits), the cuts and the uniform draw `sample` uses, and its logprobs request.
/// With `ahead` = 1 it is the token after the pending one, whose pick the host has not seen
/// yet (penalties, which count it, are then not expressible: see `overlap`).
pub(super) fn row_sampler(seq: &Sequence, eos: &[u32], ahead: usize) -> RowSampler {
    let sp = &seq.params.sampling;
    let step = (seq.generated() + ahead) as u64;
    RowSampler {
        params: RowSampling {
            temperature: sp.temperature,
            top_k: u32::try_from(sp.top_k).unwrap_or(u32::MAX),
            top_p: sp.top_p,
            min_p: sp.min_p,
            uniform: if sp.is_greedy() { 0.0 } else { uniform(seq.seed, step) },
        },
        edits: processor_edits(sp, &seq.tokens[..seq.prompt_len], &seq.counts, &banned(seq, eos, ahead)),
        top_logprobs: seq.params.logprobs.unwrap_or(0),
    }
}

/// Whether `seq` takes the argmax of the raw logits `ahead` tokens after its last known one:
/// greedy, no penalty, bias or banned token, no logprobs, no output constraint.
pub(super) fn takes_argmax(seq: &Sequence, eos: &[u32], ahead: usize) -> bool {
    let (p, sp) = (&seq.params, &seq.params.sampling);
    sp.is_greedy()
        && !sp.has_penalties()
        && sp.logit_bias.is_empty()
        && banned(seq, eos, ahead).is_empty()
        && p.logprobs.is_none()
        && seq.guide.is_none()
}

/// `row` after the request's logit processors (penalties, bias, the `min_tokens` ban).
fn processed<'a>(seq: &Sequence, row: &'a [f32], eos: &[u32]) -> Cow<'a, [f32]> {
    let sp = &seq.params.sampling;
    let banned = banned(seq, eos, 0);
    if !(sp.has_penalties() || !sp.logit_bias.is_empty() || !banned.is_empty()) {
        return Cow::Borrowed(row);
    }
    let mut out = row.to_vec();
    apply_processors(&mut out, sp, &seq.tokens[..seq.prompt_len], &seq.counts, &banned);
    Cow::Owned(out)
}

impl EngineCore {
    /// Decide the tokens of `running[idx]` from `pick`: one logits row per position from its
    /// pending token on (1 + the proposal's length), the argmax the model already took at
    /// each of them (greedy rows: a proposed token stands where it is that argmax), or the
    /// token the model sampled on the device (a row without a proposal); then commit its KV.
    pub(super) fn decide(&mut self, idx: usize, pick: Pick<'_>, proposal: Option<Proposal>) -> Emitted {
        let vocab = self.limits.vocab_size;
        let (drafts, origin) = match &proposal {
            Some(p) => (&p.ids[..], p.origin),
            None => (&[][..], Origin::Draft),
        };
        if let Some(p) = &proposal {
            let s = &mut self.sched.running[idx];
            tally::proposed(&mut s.fill.usage, &mut s.spec.usage, p.origin, p.policy, p.len());
            self.metrics.add_proposed(p.len());
        }
        let mut used = 0;
        let mut outcome = Emitted::Running;
        for j in 0..=drafts.len() {
            used = j;
            let seq = &mut self.sched.running[idx];
            // A grammar failure ends the row with an error, before any token is streamed.
            let mut failure = None;
            let (token, agreed, logprobs) = match pick {
                Pick::Tokens(ids) => {
                    let token = ids[j];
                    (token, drafts.get(j) == Some(&token), Vec::new())
                }
                Pick::Sampled(picked) => {
                    let logprobs = seq.params.logprobs.map(|k| TokenLogprob {
                        token: picked.token,
                        logprob: picked.logprob,
                        top: picked.top.iter().take(k).copied().collect(),
                    });
                    (picked.token, false, logprobs.into_iter().collect())
                }
                Pick::Logits(rows) => {
                    let raw = &rows[j * vocab..(j + 1) * vocab];
                    let mut logits = processed(seq, raw, &self.eos);
                    if let Some(guide) = seq.guide.as_mut() {
                        failure = guide.constrain(logits.to_mut(), raw).err().map(|e| e.to_string());
                    }
                    let sp = SamplingParams { seed: seq.seed, ..seq.params.sampling.clone() };
                    let step = seq.generated() as u64;
                    let (token, agreed) = match drafts.get(j) {
                        Some(&d) => {
                            let q = proposal.as_ref().and_then(|p| p.draft_probs.get(j)).map_or(&[][..], |q| &q[..]);
                            match judge(&logits, &sp, step, d, q) {
                                Verdict::Accept => (d, true),
                                Verdict::Reject(t) => (t, false),
                            }
                        }
                        None => (sample(&logits, &sp, step), false),
                    };
                    let logprobs: Vec<TokenLogprob> =
                        seq.params.logprobs.map(|k| token_logprobs(&logits, token, k)).into_iter().collect();
                    (token, agreed, logprobs)
                }
            };
            if agreed {
                tally::accepted(&mut seq.fill.usage, &mut seq.spec.usage, origin);
                self.metrics.add_accepted(1);
            } else if j < drafts.len() {
                tally::rejected(&mut seq.fill.usage, origin);
            }
            if let Some(error) = failure {
                outcome = self.fail_constrained(idx, error);
                break;
            }
            outcome = self.emit(idx, token, logprobs);
            if !matches!(outcome, Emitted::Running) {
                break;
            }
            if let Some(after) = self.assert_after(idx, token) {
                outcome = after;
                break;
            }
            if !agreed {
                break;
            }
        }
        let s = &mut self.sched.running[idx];
        // The logits rows 0..=used stood: their query positions' KV is kept.
        s.num_computed += used;
        if proposal.is_some() {
            self.kvm.truncate(&mut s.kv, s.num_computed, s.tokens.len());
        }
        self.kvm.after_step(&mut s.kv, &s.tokens, s.num_computed);
        if let Some(d) = self.drafter.as_mut() {
            d.rollback(&mut s.spec.draft, s.num_computed);
        }
        outcome
    }

    /// After the model chose `token` (fill strict or echo): append without sampling what is
    /// known to follow — for a constrained row the tokens its grammar forces, otherwise the
    /// rest of a tool-call scaffold run that `token` triggered. `None` when nothing was
    /// asserted. Requests that want logprobs are never asserted into (there are no logits).
    fn assert_after(&mut self, idx: usize, token: u32) -> Option<Emitted> {
        let scaffold = self.scaffold.clone();
        let max_len = self.limits.max_model_len;
        let seq = &mut self.sched.running[idx];
        if !seq.fill.mode.asserts_scaffolds() || seq.params.logprobs.is_some() {
            return None;
        }
        let (ids, origin) = match seq.guide.as_mut() {
            Some(guide) => (guide.forced_tokens(), Origin::Grammar),
            None => (scaffold?.after(&mut seq.fill.cursor, token).to_vec(), Origin::Scaffold),
        };
        let mut p = Proposal::new(ids, Policy::Assert, origin);
        p.clamp(seq.room(max_len), &seq.end_tokens(&self.eos));
        if p.is_empty() {
            return None;
        }
        tally::proposed(&mut seq.fill.usage, &mut seq.spec.usage, p.origin, p.policy, p.len());
        self.metrics.add_asserted(p.len());
        for t in p.ids {
            let out = self.emit(idx, t, Vec::new());
            if !matches!(out, Emitted::Running) {
                return Some(out);
            }
        }
        Some(Emitted::Running)
    }

    /// Append `token` to `running[idx]` (advancing its grammar, if constrained), detokenize,
    /// check its ends and stream it. A token its grammar refuses ends the row with an error
    /// instead, unstreamed.
    fn emit(&mut self, idx: usize, token: u32, logprobs: Vec<TokenLogprob>) -> Emitted {
        let e = Emitter {
            eos: &self.eos,
            tokenizer: self.tokenizer.as_deref(),
            max_model_len: self.limits.max_model_len,
            metrics: &self.metrics,
        };
        emit_token(&e, &mut self.sched.running[idx], token, logprobs)
    }

    /// End `running[idx]` with a grammar `error` and no new token: a token its grammar did not
    /// allow is never streamed.
    fn fail_constrained(&mut self, idx: usize, error: String) -> Emitted {
        fail_constrained(&self.metrics, &mut self.sched.running[idx], error)
    }

    /// Send a final output for `seq` with no new token; its blocks go back as it is dropped.
    pub(super) fn finish(
        &mut self,
        seq: Sequence,
        reason: FinishReason,
        stop_string: Option<String>,
        stop_token: Option<u32>,
        error: Option<String>,
    ) {
        let finished = Finished { reason, stop_string, stop_token, error, usage: usage(&seq) };
        let out = Output::end(seq.choice, finished, seq.cached_tokens);
        let _ = seq.sink.send(out);
        self.metrics.request_finished();
    }
}

/// What streaming a token needs besides its sequence.
pub(super) struct Emitter<'a> {
    pub eos: &'a [u32],
    pub tokenizer: Option<&'a Tokenizer>,
    pub max_model_len: usize,
    pub metrics: &'a Metrics,
}

/// Append `token` to `seq` (advancing its grammar, if constrained), detokenize, check its
/// ends and stream it. A token its grammar refuses ends the row with an error instead,
/// unstreamed.
pub(super) fn emit_token(e: &Emitter<'_>, seq: &mut Sequence, token: u32, logprobs: Vec<TokenLogprob>) -> Emitted {
    let mut complete = false;
    if let Some(guide) = seq.guide.as_mut() {
        match guide.commit(&[token]) {
            Ok(()) => complete = guide.is_finished(),
            Err(err) => return fail_constrained(e.metrics, seq, err.to_string()),
        }
    }
    let p = seq.params.clone();
    seq.tokens.push(token);
    *seq.counts.entry(token).or_insert(0) += 1;
    e.metrics.add_generated(1);
    let generated = seq.generated();

    let is_end = (!p.ignore_eos && e.eos.contains(&token)) || p.stop_token_ids.contains(&token);
    let mut text = String::new();
    let mut reason = None;
    let (mut stop_string, mut stop_token, mut error) = (None, None, None);
    if is_end {
        reason = Some(FinishReason::Stop);
        stop_token = Some(token);
    } else if let Some(tok) = &e.tokenizer {
        match seq.detok.push(tok, token) {
            Ok(piece) => {
                let (emit, hit) = seq.stops.push(&piece);
                text = emit;
                if hit.is_some() {
                    reason = Some(FinishReason::Stop);
                    stop_string = hit;
                }
            }
            Err(err) => {
                reason = Some(FinishReason::Error);
                error = Some(format!("detokenize: {err}"));
            }
        }
    }
    if reason.is_none() && (generated >= seq.max_tokens || seq.tokens.len() >= e.max_model_len) {
        reason = Some(FinishReason::Length);
    }
    // The grammar is complete: nothing more may follow.
    complete &= reason.is_none();
    if complete {
        reason = Some(FinishReason::Stop);
    }
    // Any end but a stop string releases the text held back (an incomplete character, a
    // possible stop string's start); a stop string drops what follows it.
    if reason.is_some() && stop_string.is_none() {
        if let Some(tok) = &e.tokenizer {
            let tail = seq.detok.finish(tok).unwrap_or_default();
            text.push_str(&seq.stops.push(&tail).0);
            text.push_str(&seq.stops.flush());
        }
    }
    let finished = reason.map(|reason| Finished { reason, stop_string, stop_token, error, usage: usage(seq) });
    let done = finished.is_some();
    let out = Output {
        choice: seq.choice,
        token_ids: vec![token],
        text,
        logprobs,
        finished,
        cached_tokens: seq.cached_tokens,
        embedding: None,
    };
    if seq.sink.send(out).is_err() {
        // The receiver is gone: the caller disconnected.
        return Emitted::Disconnected;
    }
    if done {
        e.metrics.request_finished();
        Emitted::Finished
    } else {
        Emitted::Running
    }
}

/// End `seq` with a grammar `error` and no new token.
fn fail_constrained(metrics: &Metrics, seq: &mut Sequence, error: String) -> Emitted {
    let out = Output::end(seq.choice, Finished::error(error, usage(seq)), seq.cached_tokens);
    if seq.sink.send(out).is_err() {
        return Emitted::Disconnected;
    }
    metrics.request_finished();
    Emitted::Finished
}
