//! `POST /v1/embeddings`: OpenAI's embeddings — `input` a string, a list of strings, a list of
//! token ids or a list of token-id lists; each input is one prefill-only engine request
//! (`RequestParams::embed`), batched with the others by the engine. A text is tokenized with
//! the model's special tokens and, where the model gives a `max_seq_length`
//! (`EmbeddingSpec::max_tokens`), truncated to it as sentence-transformers does; token ids are
//! taken as they are. `encoding_format` is
//! `float` (default) or `base64` (little-endian f32 bytes); `dimensions` truncates where the
//! model was trained for it (Matryoshka, `EmbeddingSpec::check_truncation`) and renormalises a
//! normalised model's vectors. A model that does not embed, an empty input and an input past
//! what the model embeds at once are 400s in OpenAI's error shape.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::Json;
use base64::Engine as _;
use ferrite_engine::RequestParams;
use ferrite_models::embedding::normalize;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::openai::completions::token_ids;
use crate::state::{App, ModelInfo};

/// Most inputs one request may hold (OpenAI's limit).
const MAX_INPUTS: usize = 2048;

#[derive(Debug, Deserialize)]
struct EmbeddingRequest {
    model: Option<String>,
    input: Value,
    encoding_format: Option<String>,
    dimensions: Option<usize>,
}

fn bad_input(why: &str) -> ApiError {
    ApiError::invalid_param("input", format!("'input' {why}"))
}

/// The token ids of each input (texts tokenized with the model's special tokens, cut to
/// `max_tokens` when given).
fn inputs(model: &ModelInfo, input: &Value, max_tokens: Option<usize>) -> Result<Vec<Vec<u32>>, ApiError> {
    let shape = "must be a string, a list of strings, a list of token ids or a list of token-id lists";
    let text = |s: &str| -> Result<Vec<u32>, ApiError> {
        if s.is_empty() {
            return Err(bad_input("must not contain an empty string"));
        }
        match max_tokens {
            Some(n) => model.encode_truncated(s, n),
            None => model.encode(s, true),
        }
    };
    let ids = |v: &Value| -> Result<Vec<u32>, ApiError> {
        match token_ids(v) {
            Some(ids) if ids.is_empty() => Err(bad_input("must not contain an empty list of token ids")),
            Some(ids) => Ok(ids),
            None => Err(bad_input(shape)),
        }
    };
    match input {
        Value::String(s) => Ok(vec![text(s)?]),
        Value::Array(items) if items.is_empty() => Err(bad_input("must not be empty")),
        Value::Array(items) if items.len() > MAX_INPUTS && !items.iter().all(Value::is_number) => {
            Err(bad_input(&format!("holds {} inputs; at most {MAX_INPUTS} are allowed", items.len())))
        }
        Value::Array(items) if items.iter().all(Value::is_string) => {
            items.iter().map(|s| text(s.as_str().unwrap_or_default())).collect()
        }
        Value::Array(items) if items.iter().all(Value::is_number) => Ok(vec![ids(input)?]),
        Value::Array(items) => items.iter().map(ids).collect(),
        _ => Err(bad_input(shape)),
    }
}

/// `v` as OpenAI's base64 encoding: the little-endian bytes of its f32 values.
fn base64_of(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub async fn embeddings(State(app): State<Arc<App>>, body: JsonBody) -> Result<Json<Value>, ApiError> {
    let started = Instant::now();
    let req: EmbeddingRequest = body.parse()?;
    let served = app.pool.acquire(req.model.as_deref()).await?;
    let name = served.model.name.clone();
    let spec = served.engine.limits().embedding.clone().ok_or_else(|| {
        ApiError::invalid_param("model", format!("model '{name}' does not make embeddings"))
            .with_code("model_not_supported")
    })?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid_param(
                "encoding_format",
                format!("encoding_format must be 'float' or 'base64', got '{other}'"),
            ))
        }
    };
    let dimensions = req.dimensions.unwrap_or(spec.dimensions);
    spec.check_truncation(dimensions).map_err(|why| ApiError::invalid_param("dimensions", why))?;
    let (s, input, max_tokens) = (served.clone(), req.input, spec.max_tokens);
    let inputs = app.off_runtime(move |_| inputs(&s.model, &input, max_tokens)).await?;
    let permits = app.admission.admit(inputs.len(), 1)?;
    let params = RequestParams { embed: true, ..Default::default() };
    let mut generations = Vec::with_capacity(inputs.len());
    for (ids, permit) in inputs.into_iter().zip(permits) {
        // The engine names the field it checked `prompt`; here it is `input`.
        let g = app.generate(&served, ids, params.clone(), permit, started).await.map_err(|e| match e.param {
            Some(ref p) if p == "prompt" => e.with_param("input"),
            _ => e,
        })?;
        generations.push(g);
    }
    let mut data = Vec::with_capacity(generations.len());
    let mut prompt_tokens = 0;
    for (index, mut g) in generations.into_iter().enumerate() {
        let mut embedding = None;
        while let Some(out) = g.next().await {
            if let Some(f) = &out.finished {
                if let Some(e) = &f.error {
                    return Err(ApiError::internal(format!("embedding input {index} failed: {e}")));
                }
                prompt_tokens += f.usage.prompt_tokens;
            }
            embedding = embedding.or(out.embedding);
        }
        let mut v = embedding.ok_or_else(|| ApiError::internal(format!("input {index} ended without an embedding")))?;
        if dimensions < v.len() {
            v.truncate(dimensions);
            if spec.normalized {
                normalize(&mut v);
            }
        }
        let vector = if base64 { json!(base64_of(&v)) } else { json!(v) };
        data.push(json!({"object": "embedding", "index": index, "embedding": vector}));
    }
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_holds_little_endian_f32() {
        let text = base64_of(&[1.0, -2.5]);
        let bytes = base64::engine::general_purpose::STANDARD.decode(text).expect("base64");
        assert_eq!(bytes, [1.0f32.to_le_bytes(), (-2.5f32).to_le_bytes()].concat());
    }
}
