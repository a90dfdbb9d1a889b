//! The OpenAI Responses API: `POST /v1/responses` (whole or streamed) and
//! `GET /v1/responses/{id}`, over the same conversations, engine and output parsers as chat
//! completions — `request` translates the request, `output` renders and stores the reply,
//! `store` keeps finished responses (bounded, with a time to live) for
//! `previous_response_id` and retrieval. Hosted tools left out of the prompt are named in
//! the `x-ferrite-omitted-tools` header.

mod output;
pub mod request;
pub mod store;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::blocks::Blocks;
use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::hosted::with_omitted_tools;
use crate::sse::sse_from_outputs;
use crate::state::{random_id, unix_now, App};
use output::{Responder, ResponseStream};
use request::ResponsesRequest;

pub fn routes() -> Router<Arc<App>> {
    Router::new().route("/v1/responses", post(create)).route("/v1/responses/{id}", get(retrieve))
}

fn not_stored(id: &str) -> ApiError {
    ApiError::not_found(format!("no stored response '{id}' (never made, made with store: false, or expired)"))
}

async fn create(State(app): State<Arc<App>>, body: JsonBody) -> Result<Response, ApiError> {
    let started = Instant::now();
    let req: ResponsesRequest = body.parse()?;
    let served = app.pool.acquire(req.model.as_deref()).await?;
    let constraint = req.constraint()?;
    let metadata = req.metadata()?;
    let mut history = match &req.previous_response_id {
        Some(id) => {
            app.responses.get(id).ok_or_else(|| not_stored(id).with_param("previous_response_id"))?.messages.clone()
        }
        None => Vec::new(),
    };
    history.extend(req.input_messages()?);
    let conversation = req.conversation(&history)?;
    let s = served.clone();
    let prepared = app.off_runtime(move |_| s.model.prepare_chat(&conversation)).await?;
    let mut params = req.params().to_request_params(&served.model, req.max_output_tokens, None)?;
    params.constraint = constraint;
    // A forced tool call's constraint takes the place of `text.format`.
    let params = prepared.request_params(params);
    let store = req.store.unwrap_or(true);
    let frame = json!({
        "id": random_id("resp_"),
        "object": "response",
        "created_at": unix_now(),
        "status": "in_progress",
        "background": false,
        "error": null,
        "incomplete_details": null,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": served.model_name(),
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.as_ref().and_then(|r| r.get("effort")).cloned(), "summary": null},
        "store": store,
        "temperature": params.sampling.temperature,
        "top_p": params.sampling.top_p,
        "text": req.text_config(),
        "tool_choice": req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        "tools": req.tools.clone().unwrap_or_default(),
        "truncation": "disabled",
        "usage": null,
        "user": null,
        "metadata": metadata,
    });
    let permit = app.admission.admit_one(1)?;
    let parser = prepared.rendered.parser(app.parsers.as_ref());
    let generation =
        app.generate(&served, prepared.prompt_ids, params, permit, started).await?.with_markers(prepared.markers);
    let r = Responder {
        app: app.clone(),
        served,
        frame,
        parser,
        blocks: Blocks::default(),
        item_ids: Vec::new(),
        history,
        store,
        namespaces: req.tool_namespaces(),
    };
    let resp = if req.stream.unwrap_or(false) {
        sse_from_outputs(generation.into_stream(), ResponseStream { r, sequence: 0, finished: false })
    } else {
        let choice =
            generation.collect().await?.pop().ok_or_else(|| ApiError::internal("the engine returned no reply"))?;
        Json(r.whole(&choice.text, &choice.finished)).into_response()
    };
    Ok(with_omitted_tools(resp, &req.omitted_tools()))
}

async fn retrieve(State(app): State<Arc<App>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let stored = app.responses.get(&id).ok_or_else(|| not_stored(&id))?;
    Ok(Json(stored.response.clone()))
}
