//! Anthropic Messages replies: the whole `message` (content blocks: `thinking`, `text`,
//! `tool_use`), and the event stream Anthropic sends — `message_start`, `ping`, per block
//! `content_block_start` / `content_block_delta` (`text_delta`, `thinking_delta`,
//! `input_json_delta`) / `content_block_stop`, then `message_delta` (stop reason, usage) and
//! `message_stop`; an `error` event if generation fails.
//!
//! Usage follows Anthropic: `input_tokens` excludes the prompt tokens read from the prefix
//! cache, which are `cache_read_input_tokens` (their sum is the prompt length). A stream
//! sends `message_start` with the first output, once the prompt is scheduled and the split
//! is known, so `message_start` and `message_delta` report the same split.

use axum::response::sse::Event;
use ferrite_engine::{FinishReason, Finished, Output, Usage};
use serde_json::{json, Value};

use crate::blocks::{Block, BlockEvent, BlockKind, Blocks};
use crate::error::ApiError;
use crate::generate::reported;
use crate::parser::{parse_streamed, parse_whole, OutputParser};
use crate::pool::Lease;
use crate::sse::{named_event, StreamRenderer};

/// What rendering a reply needs besides the outputs.
pub struct Reply {
    pub served: Lease,
    pub id: String,
    pub parser: Box<dyn OutputParser>,
    pub blocks: Blocks,
    pub prompt_tokens: usize,
}

/// Anthropic's id for a tool call (`call_…` → `toolu_…`).
fn tool_use_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.strip_prefix("call_").unwrap_or(call_id))
}

/// `stop_reason` and `stop_sequence` of an ending.
fn stop_reason(f: &Finished, tool_use: bool) -> (&'static str, Option<String>) {
    match f.reason {
        FinishReason::Length => ("max_tokens", None),
        FinishReason::Stop if tool_use => ("tool_use", None),
        FinishReason::Stop if f.stop_string.is_some() => ("stop_sequence", f.stop_string.clone()),
        FinishReason::Stop | FinishReason::Abort | FinishReason::Error => ("end_turn", None),
    }
}

fn usage_json(u: &Usage) -> Value {
    let mut v = input_usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens);
    if let Some(o) = v.as_object_mut() {
        o.extend(crate::generate::usage_extensions(u));
    }
    v
}

/// Anthropic's usage counts for a prompt of which `cached` tokens came from the cache.
fn input_usage(prompt: usize, cached: usize, output: usize) -> Value {
    json!({
        "input_tokens": prompt - cached.min(prompt),
        "output_tokens": output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached.min(prompt),
    })
}

/// A content block, whole (`done`) or as `content_block_start` opens it.
fn block_json(b: &Block, done: bool) -> Value {
    let text = if done { b.text.as_str() } else { "" };
    match b.kind {
        BlockKind::Text => json!({"type": "text", "text": text}),
        BlockKind::Reasoning => json!({"type": "thinking", "thinking": text, "signature": ""}),
        BlockKind::ToolCall => {
            let input = if done { serde_json::from_str(&b.text).unwrap_or_else(|_| json!({})) } else { json!({}) };
            json!({"type": "tool_use", "id": tool_use_id(&b.call_id), "name": b.name, "input": input})
        }
    }
}

impl Reply {
    fn message(&self, content: Vec<Value>, stop: Option<(&str, Option<String>)>, usage: Value) -> Value {
        let (reason, sequence) = stop.map_or((None, None), |(r, s)| (Some(r), s));
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.served.model_name(),
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        })
    }

    /// The whole message for a generated `text`.
    pub fn whole(mut self, text: &str, finished: &Finished) -> Value {
        let (deltas, cut) = parse_whole(self.parser.as_mut(), text);
        self.blocks.feed(deltas);
        let content = self.blocks.blocks.iter().map(|b| block_json(b, true)).collect();
        let finished = reported(finished.clone(), cut);
        let stop = stop_reason(&finished, self.blocks.has_tool_calls());
        self.message(content, Some(stop), usage_json(&finished.usage))
    }

    fn block_events(&self, events: Vec<BlockEvent>) -> Vec<Event> {
        events
            .into_iter()
            .map(|e| match e {
                BlockEvent::Start(i) => named_event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": i, "content_block": block_json(&self.blocks.blocks[i], false)}),
                ),
                BlockEvent::Delta(i, text) => {
                    let delta = match self.blocks.blocks[i].kind {
                        BlockKind::Text => json!({"type": "text_delta", "text": text}),
                        BlockKind::Reasoning => json!({"type": "thinking_delta", "thinking": text}),
                        BlockKind::ToolCall => json!({"type": "input_json_delta", "partial_json": text}),
                    };
                    named_event("content_block_delta", &json!({"type": "content_block_delta", "index": i, "delta": delta}))
                }
                BlockEvent::Stop(i) => {
                    named_event("content_block_stop", &json!({"type": "content_block_stop", "index": i}))
                }
            })
            .collect()
    }
}

fn error_event(e: &ApiError) -> Event {
    named_event("error", &e.anthropic_body())
}

/// The streaming renderer; `started` once `message_start` went out, `finished` once the
/// reply has ended.
pub struct ReplyStream {
    pub reply: Reply,
    pub started: bool,
    pub finished: bool,
}

impl ReplyStream {
    fn message_start(&mut self, cached: usize) -> Vec<Event> {
        self.started = true;
        let usage = input_usage(self.reply.prompt_tokens, cached, 0);
        let message = self.reply.message(Vec::new(), None, usage);
        vec![
            named_event("message_start", &json!({"type": "message_start", "message": message})),
            named_event("ping", &json!({"type": "ping"})),
        ]
    }

    /// The events of one output, after `message_start`.
    fn events(&mut self, out: Output) -> Vec<Event> {
        let r = &mut self.reply;
        let (deltas, cut) = parse_streamed(r.parser.as_mut(), &out.text, out.finished.is_some());
        let mut block_events = r.blocks.feed(deltas);
        let Some(f) = out.finished.map(|f| reported(f, cut)) else { return r.block_events(block_events) };
        self.finished = true;
        if let Some(e) = &f.error {
            return vec![error_event(&ApiError::internal(format!("generation failed: {e}")))];
        }
        block_events.extend(r.blocks.close());
        let mut events = r.block_events(block_events);
        let (reason, sequence) = stop_reason(&f, r.blocks.has_tool_calls());
        events.push(named_event(
            "message_delta",
            &json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage_json(&f.usage)}),
        ));
        events.push(named_event("message_stop", &json!({"type": "message_stop"})));
        events
    }
}

impl StreamRenderer for ReplyStream {
    fn start(&mut self) -> Vec<Event> {
        Vec::new()
    }

    fn output(&mut self, out: Output) -> Vec<Event> {
        let mut events = if self.started { Vec::new() } else { self.message_start(out.cached_tokens) };
        events.extend(self.events(out));
        events
    }

    fn end(&mut self) -> Vec<Event> {
        if self.finished {
            Vec::new()
        } else {
            vec![error_event(&ApiError::internal("the engine stopped mid-request"))]
        }
    }
}
