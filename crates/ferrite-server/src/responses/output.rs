//! Responses replies: the `response` object with its output items (`reasoning`, `message`
//! with an `output_text` part, `function_call`), and the event stream — `response.created`,
//! `response.in_progress`, per item `response.output_item.added`, its content part's
//! `response.content_part.added`, deltas (`response.output_text.delta`,
//! `response.reasoning_text.delta`, `response.function_call_arguments.delta`), their
//! `.done` events, `response.content_part.done`, `response.output_item.done`, and at the end
//! `response.completed` (`response.incomplete` when `max_output_tokens` cut it,
//! `response.failed` on an error) — every event with its `sequence_number`. A finished
//! response is stored (unless `store: false`) with its conversation for follow-ups.

use std::collections::HashMap;
use std::sync::Arc;

use axum::response::sse::Event;
use ferrite_engine::{FinishReason, Finished, Output, Usage};
use serde_json::{json, Value};

use crate::blocks::{BlockEvent, BlockKind, Blocks};
use crate::generate::reported;
use crate::parser::{parse_streamed, parse_whole, Delta, OutputParser};
use crate::pool::Lease;
use crate::sse::{named_event, StreamRenderer};
use crate::state::{random_id, unix_now, App};

pub struct Responder {
    pub app: Arc<App>,
    /// The model it answers with.
    pub served: Lease,
    /// The response object as the request shapes it (status, output and usage come later).
    pub frame: Value,
    pub parser: Box<dyn OutputParser>,
    pub blocks: Blocks,
    /// The output items' ids, one per block.
    pub item_ids: Vec<String>,
    /// The conversation so far, without instructions (stored with the output appended).
    pub history: Vec<Value>,
    pub store: bool,
    /// The namespace of each function offered inside a `namespace` tool (its calls name it).
    pub namespaces: HashMap<String, String>,
}

impl Responder {
    fn id(&self) -> &str {
        self.frame["id"].as_str().unwrap_or_default()
    }

    /// Parse `deltas` into blocks, giving new blocks their item ids.
    fn feed(&mut self, deltas: Vec<Delta>) -> Vec<BlockEvent> {
        let events = self.blocks.feed(deltas);
        for b in &self.blocks.blocks[self.item_ids.len()..] {
            let prefix = match b.kind {
                BlockKind::Text => "msg_",
                BlockKind::Reasoning => "rs_",
                BlockKind::ToolCall => "fc_",
            };
            self.item_ids.push(random_id(prefix));
        }
        events
    }

    /// Output item `i`, as added (empty) or done.
    fn item(&self, i: usize, done: bool) -> Value {
        let b = &self.blocks.blocks[i];
        let id = &self.item_ids[i];
        let status = if done { "completed" } else { "in_progress" };
        match b.kind {
            BlockKind::Text => {
                let content: Vec<Value> = part(b.kind, &b.text).filter(|_| done).into_iter().collect();
                json!({"id": id, "type": "message", "status": status, "role": "assistant", "content": content})
            }
            BlockKind::Reasoning => {
                let content: Vec<Value> = part(b.kind, &b.text).filter(|_| done).into_iter().collect();
                json!({"id": id, "type": "reasoning", "summary": [], "content": content, "status": status})
            }
            BlockKind::ToolCall => {
                let arguments = if done { b.text.as_str() } else { "" };
                let mut item = json!({"id": id, "type": "function_call", "call_id": b.call_id, "name": b.name,
                                      "arguments": arguments, "status": status});
                if let Some(namespace) = self.namespaces.get(&b.name) {
                    item["namespace"] = json!(namespace);
                }
                item
            }
        }
    }

    fn usage_json(&self, u: &Usage) -> Value {
        let reasoning: usize = self
            .blocks
            .blocks
            .iter()
            .filter(|b| b.kind == BlockKind::Reasoning)
            .map(|b| self.served.model.encode(&b.text, false).map_or(0, |ids| ids.len()))
            .sum();
        let mut v = json!({
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning.min(u.completion_tokens)},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        });
        if let Some(o) = v.as_object_mut() {
            o.extend(crate::generate::usage_extensions(u));
        }
        v
    }

    /// The response object with its status, finished output items and usage.
    fn response(&self, status: &str, usage: Option<&Usage>) -> Value {
        let mut r = self.frame.clone();
        r["status"] = json!(status);
        r["output"] = (0..self.blocks.blocks.len()).map(|i| self.item(i, true)).collect();
        r["usage"] = usage.map_or(Value::Null, |u| self.usage_json(u));
        if status == "incomplete" {
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        if status == "completed" {
            r["completed_at"] = json!(unix_now());
        }
        r
    }

    /// The output as one assistant chat message (for follow-ups).
    fn output_message(&self) -> Value {
        let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
        for b in &self.blocks.blocks {
            match b.kind {
                BlockKind::Text => content.push_str(&b.text),
                BlockKind::Reasoning => reasoning.push_str(&b.text),
                BlockKind::ToolCall => calls.push(json!({"id": b.call_id, "type": "function",
                                                         "function": {"name": b.name, "arguments": b.text}})),
            }
        }
        let mut m = json!({"role": "assistant", "content": content});
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        if !reasoning.is_empty() {
            m["reasoning_content"] = json!(reasoning);
        }
        m
    }

    /// The final response object for an ending; stored unless `store: false` or it failed.
    fn finish(&mut self, f: &Finished) -> (&'static str, Value) {
        let status = match f.reason {
            _ if f.error.is_some() => "failed",
            FinishReason::Length => "incomplete",
            FinishReason::Error => "failed",
            FinishReason::Stop | FinishReason::Abort => "completed",
        };
        let mut response = self.response(status, Some(&f.usage));
        if let Some(e) = &f.error {
            response["error"] = json!({"code": "server_error", "message": format!("generation failed: {e}")});
        }
        if self.store && status != "failed" {
            let mut messages = std::mem::take(&mut self.history);
            messages.push(self.output_message());
            self.app.responses.put(self.id().to_string(), response.clone(), messages);
        }
        (status, response)
    }

    /// The whole response for a generated `text`.
    pub fn whole(mut self, text: &str, finished: &Finished) -> Value {
        let (deltas, cut) = parse_whole(self.parser.as_mut(), text);
        self.feed(deltas);
        self.finish(&reported(finished.clone(), cut)).1
    }
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn reasoning_part(text: &str) -> Value {
    json!({"type": "reasoning_text", "text": text})
}

/// The content part of a block's item holding `text` (function calls have none).
fn part(kind: BlockKind, text: &str) -> Option<Value> {
    match kind {
        BlockKind::Text => Some(text_part(text)),
        BlockKind::Reasoning => Some(reasoning_part(text)),
        BlockKind::ToolCall => None,
    }
}

/// The streaming renderer.
pub struct ResponseStream {
    pub r: Responder,
    pub sequence: u64,
    pub finished: bool,
}

impl ResponseStream {
    fn event(&mut self, kind: &str, mut body: Value) -> Event {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        named_event(kind, &body)
    }

    /// Where an event about item `i` (and, with `part`, its content part) applies.
    fn at(&self, i: usize, part: bool) -> Value {
        let mut at = json!({"item_id": self.r.item_ids[i], "output_index": i});
        if part {
            at["content_index"] = json!(0);
        }
        at
    }

    fn block_events(&mut self, events: Vec<BlockEvent>) -> Vec<Event> {
        let mut out = Vec::new();
        for e in events {
            match e {
                BlockEvent::Start(i) => self.started(i, &mut out),
                BlockEvent::Delta(i, delta) => self.delta(i, delta, &mut out),
                BlockEvent::Stop(i) => self.stopped(i, &mut out),
            }
        }
        out
    }

    fn started(&mut self, i: usize, out: &mut Vec<Event>) {
        let item = self.r.item(i, false);
        out.push(self.event("response.output_item.added", json!({"output_index": i, "item": item})));
        if let Some(empty) = part(self.r.blocks.blocks[i].kind, "") {
            let mut body = self.at(i, true);
            body["part"] = empty;
            out.push(self.event("response.content_part.added", body));
        }
    }

    fn delta(&mut self, i: usize, delta: String, out: &mut Vec<Event>) {
        let (kind, mut body) = match self.r.blocks.blocks[i].kind {
            BlockKind::Text => ("response.output_text.delta", self.at(i, true)),
            BlockKind::Reasoning => ("response.reasoning_text.delta", self.at(i, true)),
            BlockKind::ToolCall => ("response.function_call_arguments.delta", self.at(i, false)),
        };
        body["delta"] = json!(delta);
        if kind == "response.output_text.delta" {
            body["logprobs"] = json!([]);
        }
        out.push(self.event(kind, body));
    }

    fn stopped(&mut self, i: usize, out: &mut Vec<Event>) {
        let b = self.r.blocks.blocks[i].clone();
        let mut body = self.at(i, b.kind != BlockKind::ToolCall);
        let kind = match b.kind {
            BlockKind::Text => {
                body["text"] = json!(b.text);
                body["logprobs"] = json!([]);
                "response.output_text.done"
            }
            BlockKind::Reasoning => {
                body["text"] = json!(b.text);
                "response.reasoning_text.done"
            }
            BlockKind::ToolCall => {
                body["arguments"] = json!(b.text);
                body["name"] = json!(b.name);
                "response.function_call_arguments.done"
            }
        };
        out.push(self.event(kind, body));
        if let Some(done) = part(b.kind, &b.text) {
            let mut body = self.at(i, true);
            body["part"] = done;
            out.push(self.event("response.content_part.done", body));
        }
        let item = self.r.item(i, true);
        out.push(self.event("response.output_item.done", json!({"output_index": i, "item": item})));
    }
}

impl StreamRenderer for ResponseStream {
    fn start(&mut self) -> Vec<Event> {
        let response = self.r.response("in_progress", None);
        vec![
            self.event("response.created", json!({"response": response.clone()})),
            self.event("response.in_progress", json!({"response": response})),
        ]
    }

    fn output(&mut self, out: Output) -> Vec<Event> {
        let (deltas, cut) = parse_streamed(self.r.parser.as_mut(), &out.text, out.finished.is_some());
        let mut block_events = self.r.feed(deltas);
        let Some(f) = out.finished.map(|f| reported(f, cut)) else { return self.block_events(block_events) };
        self.finished = true;
        block_events.extend(self.r.blocks.close());
        let mut events = self.block_events(block_events);
        let (status, response) = self.r.finish(&f);
        let kind = match status {
            "incomplete" => "response.incomplete",
            "failed" => "response.failed",
            _ => "response.completed",
        };
        events.push(self.event(kind, json!({"response": response})));
        events
    }

    fn end(&mut self) -> Vec<Event> {
        if self.finished {
            return Vec::new();
        }
        let mut response = self.r.response("failed", None);
        response["error"] = json!({"code": "server_error", "message": "the engine stopped mid-request"});
        vec![self.event("response.failed", json!({"response": response}))]
    }
}
