//! `POST /v1/chat/completions`: messages through the chat template into the engine, and the
//! generation back as one `chat.completion` or a stream of `chat.completion.chunk` events
//! ending in `data: [DONE]`. Generated text goes through the request's `OutputParser`
//! (content, reasoning, tool calls).

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrite_engine::sampling::MAX_TOP_LOGPROBS;
use ferrite_engine::{FinishReason, Output, Usage};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::conversation::Conversation;
use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::generate::{finish_reason, merge_usage, reported, Choice, Generation};
use crate::openai::chat_output::Parsed;
use crate::openai::messages::{check_tools, normalize_messages, template_kwargs, tool_choice};
use crate::openai::params::CommonParams;
use crate::openai::{logprobs, usage_json};
use crate::parser::{parse_streamed, parse_whole, OutputParser};
use crate::pool::Lease;
use crate::sse::{done_event, json_event, sse_from_outputs, StreamRenderer};
use crate::state::{random_id, unix_now, App};
use axum::response::sse::Event;

/// The chat-only request fields (the shared ones are `CommonParams`). Public, with
/// `conversation`, so the request fuzz target (`fuzz/`) converts bodies as the handler does.
#[derive(Debug, Deserialize)]
pub struct ChatFields {
    messages: Value,
    pub max_completion_tokens: Option<usize>,
    logprobs: Option<bool>,
    top_logprobs: Option<usize>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    chat_template_kwargs: Option<Map<String, Value>>,
    reasoning_effort: Option<String>,
    add_generation_prompt: Option<bool>,
    /// A ferrite/vLLM extension: return the prompt and output token ids.
    return_token_ids: Option<bool>,
}

impl ChatFields {
    /// The conversation the request describes (messages, tools, tool choice, template
    /// arguments), each part checked.
    pub fn conversation(&self) -> Result<Conversation, ApiError> {
        Ok(Conversation {
            messages: normalize_messages(&self.messages)?,
            tools: check_tools(self.tools.as_deref())?,
            tool_choice: tool_choice(self.tool_choice.as_ref())?,
            kwargs: template_kwargs(self.chat_template_kwargs.as_ref(), self.reasoning_effort.as_deref()),
            add_generation_prompt: self.add_generation_prompt.unwrap_or(true),
            single_tool_call: self.parallel_tool_calls == Some(false),
        })
    }

    /// Alternatives per token for the engine: `None` without `logprobs: true`.
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (false, Some(k)) if k > 0 => {
                Err(ApiError::invalid_param("top_logprobs", "top_logprobs needs logprobs: true"))
            }
            (_, Some(k)) if k > MAX_TOP_LOGPROBS => Err(ApiError::invalid_param(
                "top_logprobs",
                format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {k}"),
            )),
            (true, k) => Ok(Some(k.unwrap_or(0))),
            (false, _) => Ok(None),
        }
    }
}

/// What rendering a response needs besides the outputs.
struct ChatResponder {
    served: Lease,
    id: String,
    created: u64,
    parsers: Vec<Box<dyn OutputParser>>,
    logprobs: bool,
    /// The prompt ids, when the request asked for token ids.
    prompt_ids: Option<Vec<u32>>,
}

impl ChatResponder {
    fn chunk(&self, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.served.model_name(),
            "system_fingerprint": null,
            "choices": choices,
        })
    }
}

pub async fn chat_completions(State(app): State<Arc<App>>, body: JsonBody) -> Result<Response, ApiError> {
    let started = Instant::now();
    let common: CommonParams = body.parse()?;
    let chat: ChatFields = body.parse()?;
    let served = app.pool.acquire(common.model.as_deref()).await?;
    let conversation = chat.conversation()?;
    let s = served.clone();
    let prepared = app.off_runtime(move |_| s.model.prepare_chat(&conversation)).await?;
    let lp = chat.logprobs()?;
    let params = common.to_request_params(&served.model, chat.max_completion_tokens.or(common.max_tokens), lp)?;
    let params = prepared.request_params(params);
    let n = params.n;
    let permit = app.admission.admit_one(n)?;
    let prompt_ids = chat.return_token_ids.unwrap_or(false).then(|| prepared.prompt_ids.clone());
    let generation =
        app.generate(&served, prepared.prompt_ids, params, permit, started).await?.with_markers(prepared.markers);
    // After `generate`, which validated n.
    let parsers = prepared.rendered.parsers(app.parsers.as_ref(), n);
    let responder = ChatResponder {
        served,
        id: random_id("chatcmpl-"),
        created: unix_now(),
        parsers,
        logprobs: lp.is_some(),
        prompt_ids,
    };
    if common.streaming() {
        Ok(stream(responder, generation, common.include_usage()))
    } else {
        Ok(Json(whole(responder, generation).await?).into_response())
    }
}

/// The finish reason of a choice whose output had tool calls or not.
fn chat_finish_reason(f: &ferrite_engine::Finished, tool_calls: bool) -> &'static str {
    if tool_calls && f.reason == FinishReason::Stop {
        "tool_calls"
    } else {
        finish_reason(f)
    }
}

async fn whole(mut r: ChatResponder, generation: Generation) -> Result<Value, ApiError> {
    let choices: Vec<Choice> = generation.collect().await?;
    let mut out = Vec::with_capacity(choices.len());
    for (i, c) in choices.iter().enumerate() {
        let parser = &mut r.parsers[i];
        let mut parsed = Parsed::default();
        let (deltas, cut) = parse_whole(parser.as_mut(), &c.text);
        parsed.add(deltas);
        let finished = reported(c.finished.clone(), cut);
        let lps = r.logprobs.then(|| json!({"content": logprobs::chat_content(&r.served.model, &c.logprobs)}));
        let mut choice = json!({
            "index": i,
            "message": parsed.message_json(),
            "logprobs": lps,
            "finish_reason": chat_finish_reason(&finished, parsed.has_tool_calls()),
        });
        if r.prompt_ids.is_some() {
            choice["token_ids"] = json!(c.token_ids);
        }
        out.push(choice);
    }
    let usage = merge_usage(choices.iter().map(|c| &c.finished.usage));
    let mut body = json!({
        "id": r.id,
        "object": "chat.completion",
        "created": r.created,
        "model": r.served.model_name(),
        "system_fingerprint": null,
        "choices": out,
        "usage": usage_json(&usage),
    });
    if let Some(ids) = &r.prompt_ids {
        body["prompt_token_ids"] = json!(ids);
    }
    Ok(body)
}

/// Streaming state: per choice whether it has called a tool, and its usage once finished.
struct ChatStream {
    r: ChatResponder,
    include_usage: bool,
    tool_calls: Vec<bool>,
    usages: Vec<Option<Usage>>,
}

fn stream(r: ChatResponder, generation: Generation, include_usage: bool) -> Response {
    let n = r.parsers.len();
    let state = ChatStream { r, include_usage, tool_calls: vec![false; n], usages: vec![None; n] };
    sse_from_outputs(generation.into_stream(), state)
}

impl ChatStream {
    fn chunk(&self, choices: Value) -> Value {
        let mut c = self.r.chunk(choices);
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }
}

impl StreamRenderer for ChatStream {
    fn start(&mut self) -> Vec<Event> {
        let roles: Vec<Value> = (0..self.r.parsers.len())
            .map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
            .collect();
        vec![json_event(&self.chunk(roles.into()))]
    }

    fn output(&mut self, out: Output) -> Vec<Event> {
        let i = out.choice;
        let (Some(parser), Some(called)) = (self.r.parsers.get_mut(i), self.tool_calls.get_mut(i)) else {
            return Vec::new();
        };
        let mut parsed = Parsed::default();
        let (deltas, cut) = parse_streamed(parser.as_mut(), &out.text, out.finished.is_some());
        parsed.add(deltas);
        let finished = out.finished.map(|f| reported(f, cut));
        *called |= parsed.has_tool_calls();
        let called = *called;
        let mut events = Vec::new();
        if let Some(e) = finished.as_ref().and_then(|f| f.error.as_ref()) {
            events.push(json_event(&ApiError::internal(format!("generation failed: {e}")).openai_body()));
        }
        let has_logprobs = self.r.logprobs && !out.logprobs.is_empty();
        let has_ids = self.r.prompt_ids.is_some() && !out.token_ids.is_empty();
        if parsed.is_empty() && finished.is_none() && !has_logprobs && !has_ids {
            return events;
        }
        let lps =
            self.r.logprobs.then(|| json!({"content": logprobs::chat_content(&self.r.served.model, &out.logprobs)}));
        let reason = finished.as_ref().map(|f| chat_finish_reason(f, called));
        let mut choice = json!({"index": i, "delta": parsed.delta_json(), "logprobs": lps, "finish_reason": reason});
        if self.r.prompt_ids.is_some() {
            choice["token_ids"] = json!(out.token_ids);
        }
        events.insert(0, json_event(&self.chunk(json!([choice]))));
        if let Some(f) = finished {
            self.usages[i] = Some(f.usage);
        }
        events
    }

    fn end(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        if self.usages.iter().any(Option::is_none) {
            events.push(json_event(&ApiError::internal("the engine stopped mid-request").openai_body()));
        } else if self.include_usage {
            let usage = merge_usage(self.usages.iter().flatten());
            let mut last = self.r.chunk(json!([]));
            last["usage"] = usage_json(&usage);
            events.push(json_event(&last));
        }
        events.push(done_event());
        events
    }
}
