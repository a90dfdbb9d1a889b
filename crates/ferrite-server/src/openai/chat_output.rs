//! Parsed chat output in OpenAI's shapes: the whole assistant `message` (content,
//! `reasoning_content`, merged `tool_calls`) and a streaming `delta` (tool calls as indexed
//! pieces, one entry per call in a chunk).

use serde_json::{json, Map, Value};

use crate::parser::{Delta, ToolCallDelta};

/// Parser output gathered for one message or one streamed delta.
#[derive(Debug, Default)]
pub struct Parsed {
    content: String,
    reasoning: String,
    tool_calls: Vec<ToolCallDelta>,
}

impl Parsed {
    pub fn add(&mut self, deltas: Vec<Delta>) {
        for d in deltas {
            match d {
                Delta::Content(t) => self.content.push_str(&t),
                Delta::Reasoning(t) => self.reasoning.push_str(&t),
                Delta::ToolCall(c) => self.tool_calls.push(c),
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.reasoning.is_empty() && self.tool_calls.is_empty()
    }

    pub fn has_tool_calls(&self) -> bool {
        !self.tool_calls.is_empty()
    }

    /// A streaming `delta` object.
    pub fn delta_json(&self) -> Value {
        let mut d = Map::new();
        if !self.content.is_empty() {
            d.insert("content".into(), Value::from(self.content.as_str()));
        }
        if !self.reasoning.is_empty() {
            d.insert("reasoning_content".into(), Value::from(self.reasoning.as_str()));
        }
        if !self.tool_calls.is_empty() {
            d.insert("tool_calls".into(), self.tool_call_entries().into());
        }
        Value::Object(d)
    }

    /// The streamed `tool_calls` entries: one per call index, the pieces of a call that
    /// arrived together merged (clients accumulate entries by index, and some take a second
    /// entry with the same index in one chunk for a second call).
    fn tool_call_entries(&self) -> Vec<Value> {
        let mut calls: Vec<Value> = Vec::new();
        for c in &self.tool_calls {
            let at = match calls.iter().position(|call| call["index"] == c.index) {
                Some(at) => at,
                None => {
                    calls.push(json!({"index": c.index, "function": {"arguments": ""}}));
                    calls.len() - 1
                }
            };
            let call = &mut calls[at];
            if let Some(id) = &c.id {
                call["id"] = json!(id);
                call["type"] = json!("function");
            }
            if let Some(name) = &c.name {
                let before = call["function"]["name"].as_str().unwrap_or_default().to_string();
                call["function"]["name"] = json!(before + name);
            }
            let args = call["function"]["arguments"].as_str().unwrap_or_default().to_string();
            call["function"]["arguments"] = json!(args + &c.arguments);
        }
        calls
    }

    /// The whole assistant `message`, tool-call pieces merged per call.
    pub fn message_json(&self) -> Value {
        let mut m = json!({
            "role": "assistant",
            "content": if self.content.is_empty() && self.has_tool_calls() { Value::Null } else { json!(self.content) },
        });
        if !self.reasoning.is_empty() {
            m["reasoning_content"] = json!(self.reasoning);
        }
        if self.has_tool_calls() {
            let mut calls: Vec<(String, String, String)> = Vec::new();
            for piece in &self.tool_calls {
                if piece.index >= calls.len() {
                    calls.resize(piece.index + 1, Default::default());
                }
                let (id, name, args) = &mut calls[piece.index];
                if let Some(i) = &piece.id {
                    *id = i.clone();
                }
                if let Some(n) = &piece.name {
                    name.push_str(n);
                }
                args.push_str(&piece.arguments);
            }
            m["tool_calls"] = calls
                .into_iter()
                .map(|(id, name, arguments)| {
                    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
                })
                .collect();
        }
        m
    }
}
