//! `Generation`: one engine request as the API layers see it. `App::generate` admits it
//! (429 past `--max-queue`), submits it (engine validation errors become 400s) and counts its
//! prompt; the `Generation` then yields the engine's outputs while recording TTFT, TPOT and
//! end-to-end latency. Dropping it — a client that went away — drops the engine's
//! `RequestStream`, which aborts the request and frees its KV blocks, and releases its permit.
//!
//! `collect` gathers a whole generation for non-streaming responses; `into_stream` turns it
//! into a `Stream` of outputs for SSE. `with_markers` puts the special tokens a chat
//! request's parsers read back into the text.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use ferrite_engine::sampling::TokenLogprob;
use ferrite_engine::{FinishReason, Finished, Output, Request, RequestParams, Usage};
use futures_util::Stream;

use crate::admission::Permit;
use crate::error::ApiError;
use crate::parser::markers::SpecialMarkers;
use crate::pool::{EngineStream, Lease};
use crate::state::App;

pub struct Generation {
    app: Arc<App>,
    stream: EngineStream,
    /// Holds the model resident until the response is done (declared after `stream`, which
    /// must go first).
    _served: Lease,
    _permit: Permit,
    started: Instant,
    first_token: Option<Instant>,
    open_choices: usize,
    completion_tokens: usize,
    markers: Option<SpecialMarkers>,
}

/// One finished choice of a non-streaming generation.
#[derive(Debug, Clone)]
pub struct Choice {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    pub finished: Finished,
}

/// A choice being collected.
#[derive(Default)]
struct Partial {
    text: String,
    token_ids: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    finished: Option<Finished>,
}

impl Partial {
    fn done(self) -> Option<Choice> {
        Some(Choice { text: self.text, token_ids: self.token_ids, logprobs: self.logprobs, finished: self.finished? })
    }
}

impl App {
    /// Submit `prompt` to `served`'s engine under an admission `permit`; `started` is when the
    /// HTTP request arrived. Validation and grammar compilation run off the async workers
    /// (`offload`).
    pub async fn generate(
        self: &Arc<Self>,
        served: &Lease,
        prompt: Vec<u32>,
        params: RequestParams,
        permit: Permit,
        started: Instant,
    ) -> Result<Generation, ApiError> {
        let prompt_len = prompt.len() as u64;
        let open_choices = params.n;
        let s = served.clone();
        // A request for a LoRA adapter runs through it (the lease holds it until the end).
        let params = RequestParams { adapter: served.adapter().map(String::from), ..params };
        let stream = self.off_runtime(move |_| s.engine.submit(Request { prompt, params })).await?;
        self.metrics.prompt_tokens.fetch_add(prompt_len, Relaxed);
        Ok(Generation {
            app: self.clone(),
            stream,
            _served: served.clone(),
            _permit: permit,
            started,
            first_token: None,
            open_choices,
            completion_tokens: 0,
            markers: None,
        })
    }
}

impl Generation {
    /// Put these special tokens' text back into the outputs (for the output parsers).
    pub fn with_markers(mut self, markers: Option<SpecialMarkers>) -> Generation {
        self.markers = markers;
        self
    }

    /// The next output of any choice; `None` once every choice has finished (or the engine
    /// stopped, which the caller sees as choices that never finished).
    pub async fn next(&mut self) -> Option<Output> {
        if self.open_choices == 0 {
            return None;
        }
        let mut out = self.stream.next().await?;
        if let Some(m) = &self.markers {
            m.restore(&mut out);
        }
        let now = Instant::now();
        if self.first_token.is_none() && !out.token_ids.is_empty() {
            self.first_token = Some(now);
            self.app.metrics.ttft.observe(now - self.started);
        }
        if let Some(f) = &out.finished {
            self.open_choices -= 1;
            self.completion_tokens += f.usage.completion_tokens;
            if self.open_choices == 0 {
                self.record_done(now);
            }
        }
        Some(out)
    }

    fn record_done(&self, now: Instant) {
        let m = &self.app.metrics;
        m.e2e.observe(now - self.started);
        if let Some(first) = self.first_token {
            if self.completion_tokens > 1 {
                m.tpot.observe((now - first) / (self.completion_tokens as u32 - 1));
            }
        }
    }

    /// Every choice to its end, indexed by choice. An engine failure is a 500.
    pub async fn collect(mut self) -> Result<Vec<Choice>, ApiError> {
        let mut parts: Vec<Partial> = (0..self.open_choices).map(|_| Partial::default()).collect();
        while let Some(o) = self.next().await {
            let Some(p) = parts.get_mut(o.choice) else { continue };
            p.text.push_str(&o.text);
            p.token_ids.extend(o.token_ids);
            p.logprobs.extend(o.logprobs);
            if let Some(e) = o.finished.as_ref().and_then(|f| f.error.as_ref()) {
                return Err(ApiError::internal(format!("generation failed: {e}")));
            }
            p.finished = o.finished;
        }
        parts
            .into_iter()
            .map(Partial::done)
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::internal("the engine stopped mid-request"))
    }

    /// The outputs as a stream (for SSE); it ends when every choice has finished.
    pub fn into_stream(self) -> impl Stream<Item = Output> + Send {
        futures_util::stream::unfold(self, |mut g| async move { g.next().await.map(|o| (o, g)) })
    }
}

/// The OpenAI `finish_reason` of an ending.
pub fn finish_reason(f: &Finished) -> &'static str {
    match f.reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
        FinishReason::Error => "error",
    }
}

/// The ending of a reply as the API reports it: truncated (`Length`) when the generation's
/// end cut a tool call short (`parser::parse_whole` / `parse_streamed`), whatever ended it.
pub fn reported(f: Finished, cut: bool) -> Finished {
    if cut {
        Finished { reason: FinishReason::Length, stop_string: None, ..f }
    } else {
        f
    }
}

/// Usage over the choices of one prompt: the prompt counted once, completions summed.
pub fn merge_usage<'a>(usages: impl IntoIterator<Item = &'a Usage>) -> Usage {
    usages.into_iter().fold(Usage::default(), |acc, u| Usage {
        prompt_tokens: acc.prompt_tokens.max(u.prompt_tokens),
        cached_tokens: acc.cached_tokens.max(u.cached_tokens),
        completion_tokens: acc.completion_tokens + u.completion_tokens,
        fill: acc.fill + u.fill,
        speculation: acc.speculation + u.speculation,
        tiers: ferrite_engine::TierUsage {
            host_tokens: acc.tiers.host_tokens.max(u.tiers.host_tokens),
            ssd_tokens: acc.tiers.ssd_tokens.max(u.tiers.ssd_tokens),
            resumed_tokens: acc.tiers.resumed_tokens + u.tiers.resumed_tokens,
        },
    })
}

/// The ferrite usage extensions: `fill`, `speculation` and `cache` (cached tokens by tier),
/// each present when it did something.
pub fn usage_extensions(u: &Usage) -> serde_json::Map<String, serde_json::Value> {
    let mut out = serde_json::Map::new();
    let f = &u.fill;
    if f.events > 0 {
        out.insert(
            "fill".into(),
            serde_json::json!({
                "events": f.events, "injected_tokens": f.injected_tokens, "verify_accepted": f.verify_accepted,
                "verify_rejected": f.verify_rejected, "wasted_samples": f.wasted_samples,
            }),
        );
    }
    let t = &u.tiers;
    if u.cached_tokens > 0 || t.resumed_tokens > 0 {
        // Cached prompt tokens by tier, and generated tokens replayed from an interrupted run.
        out.insert(
            "cache".into(),
            serde_json::json!({
                "device_tokens": u.cached_tokens.saturating_sub(t.host_tokens + t.ssd_tokens),
                "host_tokens": t.host_tokens, "ssd_tokens": t.ssd_tokens, "resumed_tokens": t.resumed_tokens,
            }),
        );
    }
    let s = &u.speculation;
    if s.rounds > 0 {
        out.insert(
            "speculation".into(),
            serde_json::json!({
                "rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted,
                "acceptance_rate": s.acceptance_rate(),
            }),
        );
    }
    out
}
