//! The Anthropic Messages API: `POST /v1/messages` (whole or streamed) and
//! `POST /v1/messages/count_tokens`, over the same conversations, engine and output parsers
//! as OpenAI chat — `request` translates the request, `response` renders the reply.
//! `max_tokens` is required and taken as a cap: past the room left in the context it is
//! lowered to that room (the reply then ends with `max_tokens` at the context's end). Server
//! tools left out of the prompt are named in the `x-ferrite-omitted-tools` header. Every
//! error on these routes, the handlers' and the shared layers' alike (401 without a valid
//! `x-api-key`, 404, 405, 413, 429), has Anthropic's shape (`error_shape`).

pub mod request;
mod response;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::blocks::Blocks;
use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::hosted::with_omitted_tools;
use crate::sse::sse_from_outputs;
use crate::state::{random_id, App};
use request::MessagesRequest;
use response::{Reply, ReplyStream};

pub fn routes() -> Router<Arc<App>> {
    Router::new().route("/v1/messages", post(messages)).route("/v1/messages/count_tokens", post(count_tokens))
}

/// Middleware: an error response on an Anthropic route gets Anthropic's body.
pub async fn error_shape(req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let ours = path == "/v1/messages" || path.starts_with("/v1/messages/");
    let resp = next.run(req).await;
    match resp.extensions().get::<ApiError>() {
        Some(e) if ours => e.response_with(e.anthropic_body()),
        _ => resp,
    }
}

async fn messages(State(app): State<Arc<App>>, body: JsonBody) -> Result<Response, ApiError> {
    let started = Instant::now();
    let req: MessagesRequest = body.parse()?;
    let served = app.pool.acquire(Some(&req.model)).await?;
    let max_tokens = req.max_tokens.ok_or_else(|| ApiError::invalid_param("max_tokens", "max_tokens is required"))?;
    let conversation = req.conversation()?;
    let s = served.clone();
    let prepared = app.off_runtime(move |_| s.model.prepare_chat(&conversation)).await?;
    // A cap, as Anthropic clients use it (often far past a local model's context): at most
    // what the context has room for.
    let room = served.engine.limits().max_model_len.saturating_sub(prepared.prompt_ids.len()).max(1);
    let mut params = req.params().to_request_params(&served.model, Some(max_tokens.min(room)), None)?;
    params.constraint = req.constraint()?;
    // A forced tool call's constraint takes the place of `output_config.format`.
    let params = prepared.request_params(params);
    let omitted = req.omitted_tools();
    let permit = app.admission.admit_one(1)?;
    let prompt_tokens = prepared.prompt_ids.len();
    let parser = prepared.rendered.parser(app.parsers.as_ref());
    let generation =
        app.generate(&served, prepared.prompt_ids, params, permit, started).await?.with_markers(prepared.markers);
    let reply = Reply { served, id: random_id("msg_"), parser, blocks: Blocks::default(), prompt_tokens };
    let resp = if req.stream.unwrap_or(false) {
        sse_from_outputs(generation.into_stream(), ReplyStream { reply, started: false, finished: false })
    } else {
        let choice =
            generation.collect().await?.pop().ok_or_else(|| ApiError::internal("the engine returned no reply"))?;
        Json(reply.whole(&choice.text, &choice.finished)).into_response()
    };
    Ok(with_omitted_tools(resp, &omitted))
}

async fn count_tokens(State(app): State<Arc<App>>, body: JsonBody) -> Result<Json<Value>, ApiError> {
    let req: MessagesRequest = body.parse()?;
    let served = app.pool.acquire(Some(&req.model)).await?;
    let conversation = req.conversation()?;
    let s = served.clone();
    let prepared = app.off_runtime(move |_| s.model.prepare_chat(&conversation)).await?;
    Ok(Json(json!({"input_tokens": prepared.prompt_ids.len()})))
}
