//! `POST /v1/completions`: raw prompts — a string, a list of strings, token ids, or a list of
//! token-id lists — each generating `n` choices (choice index = prompt × n + choice), as one
//! `text_completion` or a stream of them ending in `data: [DONE]`. `echo` prepends the prompt
//! text; `return_token_ids` (a ferrite/vLLM extension) adds the prompt and output token ids.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrite_engine::sampling::MAX_TOP_LOGPROBS;
use ferrite_engine::{Output, Usage};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::generate::{finish_reason, merge_usage, Generation};
use crate::openai::logprobs::CompletionLogprobs;
use crate::openai::params::CommonParams;
use crate::openai::usage_json;
use crate::pool::Lease;
use crate::sse::{done_event, json_event, sse_from_outputs, StreamRenderer};
use crate::state::{random_id, unix_now, App, ModelInfo};

/// The completions-only request fields (the shared ones are `CommonParams`). Public, with
/// `prompts`, so the request fuzz target (`fuzz/`) converts bodies as the handler does.
#[derive(Debug, Deserialize)]
pub struct CompletionFields {
    /// The prompt (text, texts, ids or lists of ids), and whether to add special tokens: public
    /// for the request fuzz target, which converts them as the handler does.
    pub prompt: Value,
    suffix: Option<String>,
    echo: Option<bool>,
    logprobs: Option<usize>,
    best_of: Option<usize>,
    pub add_special_tokens: Option<bool>,
    return_token_ids: Option<bool>,
}

/// One prompt: its ids and the text `echo` shows.
pub struct Prompt {
    ids: Vec<u32>,
    text: String,
}

fn bad_prompt() -> ApiError {
    ApiError::invalid_param(
        "prompt",
        "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists",
    )
}

/// A JSON list of token ids.
pub(crate) fn token_ids(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
}

/// The prompts of a request, tokenized.
pub fn prompts(model: &ModelInfo, prompt: &Value, add_special: bool) -> Result<Vec<Prompt>, ApiError> {
    let text = |s: &str| -> Result<Prompt, ApiError> {
        Ok(Prompt { ids: model.encode(s, add_special)?, text: s.to_string() })
    };
    let ids = |ids: Vec<u32>| -> Prompt {
        let text = model.tokenizer.as_ref().and_then(|t| t.decode(&ids, false).ok()).unwrap_or_default();
        Prompt { ids, text }
    };
    match prompt {
        Value::String(s) => Ok(vec![text(s)?]),
        Value::Array(items) if items.is_empty() => Err(bad_prompt()),
        Value::Array(items) if items.iter().all(Value::is_string) => {
            items.iter().map(|s| text(s.as_str().unwrap_or_default())).collect()
        }
        Value::Array(items) if items.iter().all(Value::is_number) => {
            Ok(vec![ids(token_ids(prompt).ok_or_else(bad_prompt)?)])
        }
        Value::Array(items) => items.iter().map(|p| token_ids(p).map(ids).ok_or_else(bad_prompt)).collect(),
        _ => Err(bad_prompt()),
    }
}

struct Responder {
    served: Lease,
    id: String,
    created: u64,
    n: usize,
    echo: Vec<String>,
    return_token_ids: bool,
    prompt_ids: Vec<Vec<u32>>,
    logprobs: Vec<Option<CompletionLogprobs>>,
}

impl Responder {
    fn body(&self, object_choices: Value) -> Value {
        json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.served.model_name(),
               "system_fingerprint": null, "choices": object_choices})
    }

    /// One choice object: `text` (and `token_ids`) of global choice `index`.
    fn choice(
        &mut self,
        index: usize,
        text: String,
        ids: &[u32],
        lps: &[ferrite_engine::sampling::TokenLogprob],
        reason: Option<&str>,
    ) -> Value {
        let logprobs = self.logprobs[index].as_mut().map(|l| l.chunk(&self.served.model, lps));
        let mut c = json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason});
        if self.return_token_ids {
            c["token_ids"] = json!(ids);
        }
        c
    }
}

pub async fn completions(State(app): State<Arc<App>>, body: JsonBody) -> Result<Response, ApiError> {
    let started = Instant::now();
    let common: CommonParams = body.parse()?;
    let mut f: CompletionFields = body.parse()?;
    let served = app.pool.acquire(common.model.as_deref()).await?;
    if f.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
    }
    let echo = f.echo.unwrap_or(false);
    if echo && f.logprobs.is_some() {
        return Err(ApiError::invalid_param(
            "logprobs",
            "logprobs with echo is not supported (no prompt log-probabilities)",
        ));
    }
    if let Some(k) = f.logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
        return Err(ApiError::invalid_param(
            "logprobs",
            format!("logprobs must be at most {MAX_TOP_LOGPROBS}, got {k}"),
        ));
    }
    let n = common.n.unwrap_or(1);
    if f.best_of.is_some_and(|b| b != n) {
        return Err(ApiError::invalid_param("best_of", "best_of other than n is not supported"));
    }
    let (prompt, add_special) = (std::mem::take(&mut f.prompt), f.add_special_tokens.unwrap_or(true));
    let s = served.clone();
    let prompts = app.off_runtime(move |_| prompts(&s.model, &prompt, add_special)).await?;
    let params = common.to_request_params(&served.model, common.max_tokens, f.logprobs)?;
    let permits = app.admission.admit(prompts.len(), n)?;
    let mut generations = Vec::with_capacity(prompts.len());
    for (p, permit) in prompts.iter().zip(permits) {
        generations.push(app.generate(&served, p.ids.clone(), params.clone(), permit, started).await?);
    }
    let choices = prompts.len() * n;
    let responder = Responder {
        served,
        id: random_id("cmpl-"),
        created: unix_now(),
        n,
        echo: prompts.iter().map(|p| if echo { p.text.clone() } else { String::new() }).collect(),
        return_token_ids: f.return_token_ids.unwrap_or(false),
        prompt_ids: prompts.into_iter().map(|p| p.ids).collect(),
        logprobs: (0..choices).map(|_| f.logprobs.map(|_| CompletionLogprobs::default())).collect(),
    };
    if common.streaming() {
        Ok(stream(responder, generations, common.include_usage()))
    } else {
        Ok(Json(whole(responder, generations).await?).into_response())
    }
}

async fn whole(mut r: Responder, generations: Vec<Generation>) -> Result<Value, ApiError> {
    let per_prompt = futures_util::future::try_join_all(generations.into_iter().map(Generation::collect)).await?;
    let mut choices = Vec::new();
    let mut usage = Usage::default();
    for (p, prompt_choices) in per_prompt.iter().enumerate() {
        for (c, choice) in prompt_choices.iter().enumerate() {
            let text = format!("{}{}", r.echo[p], choice.text);
            let reason = finish_reason(&choice.finished);
            choices.push(r.choice(p * r.n + c, text, &choice.token_ids, &choice.logprobs, Some(reason)));
        }
        let u = merge_usage(prompt_choices.iter().map(|c| &c.finished.usage));
        usage = add_usage(usage, u);
    }
    let mut body = r.body(choices.into());
    body["usage"] = usage_json(&usage);
    if r.return_token_ids {
        body["prompt_token_ids"] = json!(r.prompt_ids);
    }
    Ok(body)
}

fn add_usage(a: Usage, b: Usage) -> Usage {
    Usage {
        prompt_tokens: a.prompt_tokens + b.prompt_tokens,
        cached_tokens: a.cached_tokens + b.cached_tokens,
        completion_tokens: a.completion_tokens + b.completion_tokens,
        fill: a.fill + b.fill,
        speculation: a.speculation + b.speculation,
        tiers: a.tiers + b.tiers,
    }
}

/// Streaming state: each choice's usage once it finished.
struct CompletionStream {
    r: Responder,
    include_usage: bool,
    usages: Vec<Option<Usage>>,
}

fn stream(r: Responder, generations: Vec<Generation>, include_usage: bool) -> Response {
    let n = r.n;
    let merged = futures_util::stream::select_all(generations.into_iter().enumerate().map(|(p, g)| {
        g.into_stream()
            .map(move |mut o| {
                o.choice += p * n;
                o
            })
            .boxed()
    }));
    let choices = r.logprobs.len();
    sse_from_outputs(merged, CompletionStream { r, include_usage, usages: vec![None; choices] })
}

impl CompletionStream {
    fn chunk(&self, choices: Value) -> Value {
        let mut c = self.r.body(choices);
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }
}

impl StreamRenderer for CompletionStream {
    fn start(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        for index in 0..self.usages.len() {
            let echo = self.r.echo[index / self.r.n].clone();
            if !echo.is_empty() {
                let c = self.r.choice(index, echo, &[], &[], None);
                events.push(json_event(&self.chunk(json!([c]))));
            }
        }
        events
    }

    fn output(&mut self, out: Output) -> Vec<Event> {
        if out.choice >= self.usages.len() {
            return Vec::new();
        }
        let mut events = Vec::new();
        if let Some(e) = out.finished.as_ref().and_then(|f| f.error.as_ref()) {
            events.push(json_event(&ApiError::internal(format!("generation failed: {e}")).openai_body()));
        }
        let reason = out.finished.as_ref().map(finish_reason);
        let c = self.r.choice(out.choice, out.text, &out.token_ids, &out.logprobs, reason);
        events.insert(0, json_event(&self.chunk(json!([c]))));
        if let Some(f) = out.finished {
            self.usages[out.choice] = Some(f.usage);
        }
        events
    }

    fn end(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        if self.usages.iter().any(Option::is_none) {
            events.push(json_event(&ApiError::internal("the engine stopped mid-request").openai_body()));
        } else if self.include_usage {
            let usage = self
                .usages
                .chunks(self.r.n)
                .map(|prompt| merge_usage(prompt.iter().flatten()))
                .fold(Usage::default(), add_usage);
            let mut last = self.r.body(json!([]));
            last["usage"] = usage_json(&usage);
            events.push(json_event(&last));
        }
        events.push(done_event());
        events
    }
}
