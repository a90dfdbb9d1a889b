//! The OpenAI-compatible API: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`
//! and `/v1/models`, with what they share (request fields, log-probabilities, usage, ids), and
//! vLLM's LoRA adapter endpoints (`adapters`).

pub mod adapters;
pub mod chat;
mod chat_output;
pub mod completions;
pub mod embeddings;
pub mod logprobs;
pub mod messages;
pub mod models;
pub mod params;

use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;
use ferrite_engine::Usage;
use serde_json::{json, Value};

use crate::state::App;

pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/models", get(models::list))
        .route("/v1/models/{id}", get(models::retrieve))
        .route("/v1/load_lora_adapter", post(adapters::load))
        .route("/v1/unload_lora_adapter", post(adapters::unload))
}

/// OpenAI's `usage` object.
pub fn usage_json(u: &Usage) -> Value {
    let mut v = json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    });
    if let Some(o) = v.as_object_mut() {
        o.extend(crate::generate::usage_extensions(u));
    }
    v
}
