//! Embedding rows of a step: requests with `RequestParams::embed` run their whole input in a
//! batch of their own (`CausalLm::embed`), before the step's other rows, and finish at once
//! with their embedding; their blocks go back as they are dropped (no KV is kept, nothing
//! enters the prefix cache).

use ferrite_models::model::run_forward;
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::ForwardBatch;

use super::{usage, EngineCore};
use crate::error::EngineError;
use crate::request::{FinishReason, Finished, Output};
use crate::scheduler::ScheduledRow;

impl EngineCore {
    /// Run the embedding rows of `rows` and finish them; the other rows are returned, their
    /// indices moved past the finished ones.
    pub(super) fn run_embeddings(&mut self, rows: Vec<ScheduledRow>) -> Vec<ScheduledRow> {
        let (embed, rest): (Vec<ScheduledRow>, Vec<ScheduledRow>) =
            rows.into_iter().partition(|r| self.sched.running[r.index].params.embed);
        if embed.is_empty() {
            return rest;
        }
        let mut batch = ForwardBatch::default();
        for r in &embed {
            let s = &self.sched.running[r.index];
            batch.push_row(&s.tokens, s.tokens.len(), s.kv.tables().to_vec(), RowLogits::None);
        }
        self.metrics.add_batch(batch.num_tokens());
        let vectors = match self.before_forward() {
            Ok(()) => {
                let (model, kv) = (&self.model, &mut self.kv);
                run_forward(&**model, || model.embed(&batch, kv)).map_err(EngineError::from)
            }
            Err(e) => Err(e),
        };
        // Rows come in running order: removing them from the back keeps the indices valid.
        let gone: Vec<usize> = embed.iter().map(|r| r.index).collect();
        let mut seqs: Vec<_> = gone.iter().rev().map(|&i| self.sched.running.remove(i)).collect();
        seqs.reverse();
        let vectors = match vectors {
            Ok(v) if v.len() == seqs.len() => Ok(v),
            Ok(v) => Err(format!("the model made {} embeddings for {} inputs", v.len(), seqs.len())),
            Err(e) => Err(e.to_string()),
        };
        match vectors {
            Ok(vectors) => {
                for (seq, embedding) in seqs.into_iter().zip(vectors) {
                    let finished = Finished {
                        reason: FinishReason::Stop,
                        stop_string: None,
                        stop_token: None,
                        error: None,
                        usage: usage(&seq),
                    };
                    let out = Output { embedding: Some(embedding), ..Output::end(0, finished, 0) };
                    // A receiver that is gone wanted nothing more.
                    let _ = seq.sink.send(out);
                    self.metrics.request_finished();
                }
            }
            Err(msg) => {
                for seq in seqs {
                    self.finish(seq, FinishReason::Error, None, None, Some(msg.clone()));
                }
            }
        }
        let shift = |i: usize| i - gone.iter().filter(|&&g| g < i).count();
        rest.into_iter().map(|r| ScheduledRow { index: shift(r.index), tokens: r.tokens }).collect()
    }
}
