//! `Input`: how the CPU executor turns a step's tokens into the first residual stream, as the
//! plan's `InputKind` says: the token embedding (times Gemma's or granite's scale), or an
//! encoder's (BERT) sum of the word embedding, the token-type-0 embedding and the learned
//! embedding of each token's absolute position, LayerNormed.

use ferrite_runtime::{cpu, ForwardBatch, Result as RtResult, RuntimeError, Tensor};

use crate::blocks::{self, Norm};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::plan::{DecoderPlan, InputKind};
use crate::weights::Weights;

pub enum Input {
    Tokens {
        table: Tensor,
        scale: Option<f32>,
    },
    Encoder {
        words: Tensor,
        /// `[max_positions, hidden]`.
        positions: Vec<f32>,
        max_positions: usize,
        /// The token-type-0 row.
        token_type: Vec<f32>,
        norm: Norm,
    },
}

impl Input {
    /// The input of `plan`, its tensors checked against `cfg`.
    pub fn load(w: &Weights, cfg: &ModelConfig, plan: &DecoderPlan) -> Result<Input> {
        let d = cfg.hidden_size;
        match &plan.input {
            InputKind::Tokens => Ok(Input::Tokens {
                table: w.get("model.embed_tokens.weight", &[cfg.vocab_size, d])?,
                scale: plan.embed_scale,
            }),
            InputKind::Encoder(e) => {
                let types = w.get_f32(&format!("{}.weight", e.token_types), &[e.types, d])?;
                Ok(Input::Encoder {
                    words: w.get(&format!("{}.weight", e.words), &[cfg.vocab_size, d])?,
                    positions: w.get_f32(&format!("{}.weight", e.positions), &[e.max_positions, d])?,
                    max_positions: e.max_positions,
                    token_type: types[..d].to_vec(),
                    norm: Norm::load_kind(w, &e.norm, d, plan.norm, plan.eps)?,
                })
            }
        }
    }

    /// The token embedding table (what a tied LM head reads).
    pub fn table(&self) -> &Tensor {
        match self {
            Input::Tokens { table, .. } => table,
            Input::Encoder { words, .. } => words,
        }
    }

    /// `[tokens, hidden]`: the first residual stream of `batch`.
    pub fn forward(&self, batch: &ForwardBatch) -> RtResult<Vec<f32>> {
        match self {
            Input::Tokens { table, scale } => blocks::embed(table, &batch.tokens, *scale),
            Input::Encoder { words, positions, max_positions, token_type, norm } => {
                let d = token_type.len();
                let mut x = vec![0f32; batch.tokens.len() * d];
                cpu::embedding(words, &batch.tokens, &mut x)?;
                for (row, &p) in x.chunks_exact_mut(d).zip(&batch.positions) {
                    let p = p as usize;
                    if p >= *max_positions {
                        return Err(RuntimeError::Shape(format!(
                            "position {p} is past the model's {max_positions} learned positions"
                        )));
                    }
                    let pos = &positions[p * d..(p + 1) * d];
                    // transformers' order: (word + token type) + position.
                    for ((v, t), q) in row.iter_mut().zip(token_type).zip(pos) {
                        *v = (*v + t) + q;
                    }
                }
                norm.forward_in_place(&mut x);
                Ok(x)
            }
        }
    }
}
