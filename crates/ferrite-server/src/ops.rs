//! Operations endpoints: `/health` (`degraded`, naming them, when engines are down; 503 when
//! every model's is), `/metrics` (Prometheus text, the resident engines added up), and vLLM-compatible
//! `/tokenize` (a prompt, or chat messages rendered as a chat request would be, tools and a
//! forced tool-call opening included) and `/detokenize`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::conversation::Conversation;
use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::openai::messages::{check_tools, normalize_messages, tool_choice};
use crate::pool::Served;
use crate::state::App;

pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
}

async fn health(State(app): State<Arc<App>>) -> Response {
    let down = app.pool.down();
    if down.is_empty() {
        return Json(json!({"status": "ok"})).into_response();
    }
    let models = app.pool.list().iter().filter(|m| m.parent.is_none()).count();
    let status = if down.len() == models { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
    let models: Map<String, Value> = down.into_iter().map(|(name, why)| (name, json!(why))).collect();
    (status, Json(json!({"status": "degraded", "down": models}))).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> impl IntoResponse {
    let text = app.metrics.render(&app.pool.engine_metrics());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Value>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    chat_template_kwargs: Option<Map<String, Value>>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    return_token_strs: Option<bool>,
}

async fn tokenize(State(app): State<Arc<App>>, body: JsonBody) -> Result<Json<Value>, ApiError> {
    let req: TokenizeRequest = body.parse()?;
    let served = app.pool.acquire(req.model.as_deref()).await?;
    // Rendering and tokenizing are CPU work: off the async workers.
    app.off_runtime(move |_| tokenize_now(&served, &req)).await.map(Json)
}

fn tokenize_now(app: &Served, req: &TokenizeRequest) -> Result<Value, ApiError> {
    let tokens = match (&req.prompt, &req.messages) {
        (Some(prompt), None) => app.model.encode(prompt, req.add_special_tokens.unwrap_or(true))?,
        (None, Some(messages)) => {
            let conversation = Conversation {
                messages: normalize_messages(messages)?,
                tools: check_tools(req.tools.as_deref())?,
                tool_choice: tool_choice(req.tool_choice.as_ref())?,
                kwargs: req.chat_template_kwargs.clone().unwrap_or_default(),
                add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
                single_tool_call: false,
            };
            let rendered = app.model.render_conversation(&conversation)?;
            app.model.encode(&rendered.text, req.add_special_tokens.unwrap_or(false))?
        }
        _ => return Err(ApiError::bad_request("send exactly one of 'prompt' and 'messages'")),
    };
    let token_strs = match req.return_token_strs.unwrap_or(false) {
        true => {
            let tok = app.model.tokenizer()?;
            json!(tokens.iter().map(|&id| tok.id_to_token(id).unwrap_or_default()).collect::<Vec<_>>())
        }
        false => Value::Null,
    };
    Ok(json!({
        "count": tokens.len(),
        "max_model_len": app.engine.limits().max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }))
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

async fn detokenize(State(app): State<Arc<App>>, body: JsonBody) -> Result<Json<Value>, ApiError> {
    let req: DetokenizeRequest = body.parse()?;
    let app = app.pool.acquire(req.model.as_deref()).await?;
    let vocab = app.engine.limits().vocab_size;
    if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param("tokens", format!("token id {bad} is outside the vocabulary of {vocab}")));
    }
    Ok(Json(json!({"prompt": app.model.decode(&req.tokens, false)?})))
}
