//! Log-probabilities in OpenAI's two shapes: chat's `{"content": [{token, logprob, bytes,
//! top_logprobs}]}` and legacy completions' `{tokens, token_logprobs, top_logprobs,
//! text_offset}`. A token's text is its own decoding (special tokens included); a model
//! without a tokenizer names tokens `token_id:N`.

use ferrite_engine::sampling::TokenLogprob;
use serde_json::{json, Map, Value};

use crate::state::ModelInfo;

/// What OpenAI sends for a log-probability that is not a finite number.
const FLOOR: f32 = -9999.0;

fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        FLOOR
    }
}

/// The text of one token.
pub fn token_text(model: &ModelInfo, id: u32) -> String {
    match model.tokenizer.as_deref().map(|t| t.decode(&[id], false)) {
        Some(Ok(text)) => text,
        _ => format!("token_id:{id}"),
    }
}

fn entry(model: &ModelInfo, id: u32, lp: f32) -> Value {
    let token = token_text(model, id);
    json!({"token": token, "logprob": finite(lp), "bytes": token.as_bytes()})
}

/// Chat's `logprobs.content` entries for `lps`.
pub fn chat_content(model: &ModelInfo, lps: &[TokenLogprob]) -> Vec<Value> {
    lps.iter()
        .map(|lp| {
            let mut e = entry(model, lp.token, lp.logprob);
            e["top_logprobs"] = lp.top.iter().map(|&(id, v)| entry(model, id, v)).collect();
            e
        })
        .collect()
}

/// Builds completions-style logprobs across the chunks of one choice, keeping the running
/// text offset.
#[derive(Debug, Default)]
pub struct CompletionLogprobs {
    offset: usize,
}

impl CompletionLogprobs {
    pub fn chunk(&mut self, model: &ModelInfo, lps: &[TokenLogprob]) -> Value {
        let mut tokens = Vec::with_capacity(lps.len());
        let mut offsets = Vec::with_capacity(lps.len());
        for lp in lps {
            let text = token_text(model, lp.token);
            offsets.push(self.offset);
            self.offset += text.chars().count();
            tokens.push(text);
        }
        let top: Vec<Value> = lps
            .iter()
            .map(|lp| {
                let m: Map<String, Value> =
                    lp.top.iter().map(|&(id, v)| (token_text(model, id), json!(finite(v)))).collect();
                Value::Object(m)
            })
            .collect();
        json!({
            "tokens": tokens,
            "token_logprobs": lps.iter().map(|lp| finite(lp.logprob)).collect::<Vec<_>>(),
            "top_logprobs": top,
            "text_offset": offsets,
        })
    }
}
