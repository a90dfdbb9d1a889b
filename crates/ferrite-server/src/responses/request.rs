//! A Responses request as a `Conversation`: `input` (a string, or items — messages with
//! `input_text` / `output_text` parts, `function_call`, `function_call_output`; `reasoning`
//! items are skipped), after the messages of the `previous_response_id` chain, with
//! `instructions` as the system message (instructions are not carried along the chain);
//! flat function `tools` (a `namespace` tool's functions count as tools under their own
//! names, and their calls name the namespace; hosted tools such as `web_search` are left
//! out, `hosted`); `tool_choice`; `parallel_tool_calls: false` allows one call;
//! `reasoning.effort` as the template's
//! `reasoning_effort`; `text.format` (`text`, `json_object`, `json_schema`) as the output
//! constraint.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::{json, Map, Value};

use ferrite_engine::Constraint;

use crate::conversation::{media_placeholder, Conversation, ToolChoice};
use crate::error::ApiError;
use crate::hosted::is_hosted_tool;
use crate::openai::params::CommonParams;
use crate::structured;

#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    input: Value,
    pub instructions: Option<String>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub max_output_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub stream: Option<bool>,
    pub previous_response_id: Option<String>,
    pub store: Option<bool>,
    text: Option<Value>,
    pub reasoning: Option<Value>,
    metadata: Option<Value>,
    pub fill: Option<String>,
    pub kv_cache_dtype: Option<String>,
    pub quantized_kv_start: Option<usize>,
}

fn bad(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, message)
}

impl ResponsesRequest {
    /// The output constraint of `text.format`.
    pub fn constraint(&self) -> Result<Option<Constraint>, ApiError> {
        match self.text.as_ref().and_then(|t| t.get("format")) {
            Some(format) => structured::from_format(format, "text.format"),
            None => Ok(None),
        }
    }

    /// `text` as the response echoes it.
    pub fn text_config(&self) -> Value {
        self.text.clone().filter(|t| t.get("format").is_some()).unwrap_or_else(|| json!({"format": {"type": "text"}}))
    }

    /// `metadata`, within OpenAI's limits: at most 16 keys of at most 64 characters, each
    /// value a string of at most 512 characters (`{}` when absent).
    pub fn metadata(&self) -> Result<Value, ApiError> {
        const KEYS: usize = 16;
        const KEY_CHARS: usize = 64;
        const VALUE_CHARS: usize = 512;
        let map = match &self.metadata {
            None | Some(Value::Null) => return Ok(json!({})),
            Some(Value::Object(map)) => map,
            Some(_) => return Err(bad("metadata", "'metadata' must be an object of strings")),
        };
        if map.len() > KEYS {
            return Err(bad("metadata", format!("'metadata' may hold at most {KEYS} keys, got {}", map.len())));
        }
        for (key, value) in map {
            if key.chars().count() > KEY_CHARS {
                return Err(bad("metadata", format!("'metadata' keys may be at most {KEY_CHARS} characters")));
            }
            match value.as_str() {
                Some(v) if v.chars().count() <= VALUE_CHARS => {}
                Some(_) => {
                    return Err(bad(
                        format!("metadata.{key}"),
                        format!("'metadata' values may be at most {VALUE_CHARS} characters"),
                    ))
                }
                None => return Err(bad(format!("metadata.{key}"), "'metadata' values must be strings")),
            }
        }
        Ok(Value::Object(map.clone()))
    }

    /// The messages of `input`.
    pub fn input_messages(&self) -> Result<Vec<Value>, ApiError> {
        match &self.input {
            Value::String(s) => Ok(vec![json!({"role": "user", "content": s})]),
            Value::Array(items) if items.is_empty() => Err(bad("input", "'input' must hold at least one item")),
            Value::Array(items) => {
                let mut out = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    input_item(i, item, &mut out)?;
                }
                Ok(out)
            }
            _ => Err(bad("input", "'input' must be a string or a list of input items")),
        }
    }

    /// The conversation: instructions, then `history` (the previous responses' messages and
    /// this input's).
    pub fn conversation(&self, history: &[Value]) -> Result<Conversation, ApiError> {
        let mut messages = Vec::with_capacity(history.len() + 1);
        if let Some(instructions) = self.instructions.as_deref().filter(|s| !s.is_empty()) {
            messages.push(json!({"role": "system", "content": instructions}));
        }
        messages.extend_from_slice(history);
        let mut kwargs = Map::new();
        if let Some(effort) = self.reasoning.as_ref().and_then(|r| r.get("effort")).and_then(Value::as_str) {
            kwargs.insert("reasoning_effort".into(), json!(effort));
        }
        Ok(Conversation {
            messages,
            tools: self.tools()?,
            tool_choice: self.tool_choice()?,
            kwargs,
            add_generation_prompt: true,
            single_tool_call: self.parallel_tool_calls == Some(false),
        })
    }

    fn tools(&self) -> Result<Vec<Value>, ApiError> {
        let mut out = Vec::new();
        for (i, t) in self.tools.iter().flatten().enumerate() {
            let at = format!("tools[{i}]");
            match t.get("type").and_then(Value::as_str) {
                Some("function") => out.push(function_tool(t, &at)?),
                Some("namespace") => {
                    let inner = t.get("tools").and_then(Value::as_array).ok_or_else(|| {
                        bad(format!("{at}.tools"), format!("'{at}.tools' must be a list of function tools"))
                    })?;
                    for (j, f) in inner.iter().enumerate() {
                        let at = format!("{at}.tools[{j}]");
                        if f.get("type").and_then(Value::as_str) != Some("function") {
                            return Err(bad(format!("{at}.type"), "a namespace holds tools of type 'function'"));
                        }
                        out.push(function_tool(f, &at)?);
                    }
                }
                Some(kind) if is_hosted_tool(kind) => {}
                _ => {
                    return Err(bad(
                        format!("{at}.type"),
                        "only tools of type 'function' or 'namespace' are supported (hosted tools are left out)",
                    ))
                }
            }
        }
        Ok(out)
    }

    /// The namespace of each function that came from a `namespace` tool.
    pub fn tool_namespaces(&self) -> HashMap<String, String> {
        let mut out = HashMap::new();
        for t in self.tools.iter().flatten().filter(|t| t.get("type").and_then(Value::as_str) == Some("namespace")) {
            let Some(namespace) = t.get("name").and_then(Value::as_str) else { continue };
            for f in t.get("tools").and_then(Value::as_array).into_iter().flatten() {
                if let Some(name) = f.get("name").and_then(Value::as_str) {
                    out.entry(name.to_string()).or_insert_with(|| namespace.to_string());
                }
            }
        }
        out
    }

    /// The types of the hosted tools left out of the prompt.
    pub fn omitted_tools(&self) -> Vec<String> {
        let kinds = self.tools.iter().flatten().filter_map(|t| t.get("type").and_then(Value::as_str));
        kinds.filter(|k| is_hosted_tool(k)).map(str::to_string).collect()
    }

    fn tool_choice(&self) -> Result<ToolChoice, ApiError> {
        match &self.tool_choice {
            None | Some(Value::Null) => Ok(ToolChoice::Auto),
            Some(Value::String(s)) if s == "auto" => Ok(ToolChoice::Auto),
            Some(Value::String(s)) if s == "none" => Ok(ToolChoice::None),
            Some(Value::String(s)) if s == "required" => Ok(ToolChoice::Required),
            Some(v) if v.get("type").and_then(Value::as_str) == Some("function") => {
                match v.get("name").and_then(Value::as_str) {
                    Some(name) => Ok(ToolChoice::Function(name.to_string())),
                    None => Err(bad("tool_choice.name", "tool_choice.name must be a string")),
                }
            }
            Some(_) => Err(bad(
                "tool_choice",
                "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
            )),
        }
    }

    /// The sampling fields in the OpenAI shape the engine parameters are built from.
    pub fn params(&self) -> CommonParams {
        CommonParams {
            model: self.model.clone(),
            temperature: self.temperature,
            top_p: self.top_p,
            max_tokens: self.max_output_tokens,
            stream: self.stream,
            fill: self.fill.clone(),
            kv_cache_dtype: self.kv_cache_dtype.clone(),
            quantized_kv_start: self.quantized_kv_start,
            ..CommonParams::default()
        }
    }
}

/// A flat function tool (`{"type": "function", "name", "description", "parameters"}`) in
/// chat's shape; `at` names it.
fn function_tool(t: &Value, at: &str) -> Result<Value, ApiError> {
    let name = t
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("{at}.name"), format!("'{at}.name' must be a string")))?;
    let mut function = json!({"name": name});
    for key in ["description", "parameters"] {
        if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
            function[key] = v.clone();
        }
    }
    Ok(json!({"type": "function", "function": function}))
}

/// The text of a message's content: a string, or text parts joined by newlines. In a tool's
/// output (`in_output`) an image or a file becomes a placeholder text.
fn content_text(at: &str, content: &Value, in_output: bool) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let part = format!("{at}[{j}]");
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => texts.push(
                        p.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| bad(format!("{part}.text"), format!("'{part}.text' must be a string")))?
                            .to_string(),
                    ),
                    Some("refusal") => {}
                    Some("input_image") if in_output => texts.push(media_placeholder("image")),
                    Some("input_file") if in_output => texts.push(media_placeholder("file")),
                    Some(other) => {
                        return Err(bad(
                            format!("{part}.type"),
                            format!("only text content parts are supported, got '{other}'"),
                        ))
                    }
                    None => return Err(bad(format!("{part}.type"), format!("'{part}.type' must be a string"))),
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(bad(at.to_string(), format!("'{at}' must be a string or a list of content parts"))),
    }
}

/// Append the chat message(s) of input item `i`.
fn input_item(i: usize, item: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let at = format!("input[{i}]");
    let field = |name: &str| item.get(name).and_then(Value::as_str);
    let need =
        |name: &str| field(name).ok_or_else(|| bad(format!("{at}.{name}"), format!("'{at}.{name}' must be a string")));
    let kind = field("type").unwrap_or(if item.get("role").is_some() { "message" } else { "" });
    match kind {
        "message" => {
            let role = match need("role")? {
                "developer" => "system",
                r @ ("user" | "system" | "assistant") => r,
                other => return Err(bad(format!("{at}.role"), format!("unknown role '{other}'"))),
            };
            let content = item.get("content").ok_or_else(|| bad(format!("{at}.content"), "'content' is required"))?;
            out.push(json!({"role": role, "content": content_text(&format!("{at}.content"), content, false)?}));
        }
        "function_call" => {
            let function = json!({"name": need("name")?, "arguments": field("arguments").unwrap_or("{}")});
            let call = json!({"id": need("call_id")?, "type": "function", "function": function});
            match out.last_mut() {
                Some(last) if last["role"] == "assistant" => {
                    if let Some(calls) = last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                        calls.push(call);
                    } else {
                        last["tool_calls"] = json!([call]);
                    }
                }
                _ => out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        "function_call_output" => {
            let output = item.get("output").ok_or_else(|| bad(format!("{at}.output"), "'output' is required"))?;
            let text = content_text(&format!("{at}.output"), output, true)?;
            out.push(json!({"role": "tool", "tool_call_id": need("call_id")?, "content": text}));
        }
        "reasoning" => {}
        "" => return Err(bad(format!("{at}.type"), format!("'{at}.type' must be a string"))),
        other => return Err(bad(format!("{at}.type"), format!("input items of type '{other}' are not supported"))),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> ResponsesRequest {
        serde_json::from_value(body).expect("request")
    }

    #[test]
    fn items_map_to_chat_messages() {
        let req = request(json!({
            "input": [
                {"role": "developer", "content": "Be brief."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{\"city\":\"Oslo\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
                {"type": "reasoning", "summary": []},
            ],
            "instructions": "You are terse.",
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "w"},
            "reasoning": {"effort": "low"},
        }));
        let history = req.input_messages().expect("input");
        let conv = req.conversation(&history).expect("conversation");
        assert_eq!(
            conv.messages,
            vec![
                json!({"role": "system", "content": "You are terse."}),
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Weather?"}),
                json!({"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{\"city\":\"Oslo\"}"}}]}),
                json!({"role": "tool", "tool_call_id": "call_1", "content": "cold"}),
            ]
        );
        assert_eq!(
            conv.tools,
            vec![json!({"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}})]
        );
        assert_eq!(conv.tool_choice, ToolChoice::Function("w".into()));
        assert_eq!(conv.kwargs.get("reasoning_effort"), Some(&json!("low")));
    }

    #[test]
    fn unsupported_input_is_400() {
        let cases = [
            (json!({"input": 5}), "input"),
            (json!({"input": [{"type": "input_image"}]}), "input[0].type"),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
                "input[0].content[0].type",
            ),
            (json!({"input": [{"type": "function_call_output", "output": "x"}]}), "input[0].call_id"),
        ];
        for (body, param) in cases {
            let err = request(body).input_messages().expect_err("bad");
            assert_eq!(err.param.as_deref(), Some(param), "{err}");
        }
        let ok = request(json!({"input": "x", "text": {"format": {"type": "json_object"}}})).constraint();
        assert_eq!(ok.expect("json_object"), Some(Constraint::JsonObject));
        let err = request(json!({"input": "x", "text": {"format": {"type": "xml"}}})).constraint();
        assert_eq!(err.expect_err("400").param.as_deref(), Some("text.format.type"));
    }
}
