//! An Anthropic Messages request as a `Conversation` and engine parameters: `system` (a
//! string or text blocks) becomes a system message, and so does a `system` turn inside
//! `messages` (where it stands; `conversation` merges it into the leading one for a template
//! that refuses it); user turns' `tool_result` blocks become tool messages (ahead of the
//! turn's text; an image or document inside one becomes a short placeholder text),
//! assistant turns' `tool_use` blocks become tool calls and `thinking` blocks
//! `reasoning_content`; `tools` (`input_schema`) become function tools, server tools (web
//! search, code execution, …) are left out; `tool_choice` auto/any/tool/none maps onto
//! `ToolChoice` (`disable_parallel_tool_use` allows one call); `thinking` sets the
//! template's `enable_thinking`; `output_config.format` (or the older `output_format`), a
//! JSON schema, constrains the output as OpenAI's `response_format` does. A wrong type or an
//! unsupported block is a 400 naming the field.

use ferrite_engine::Constraint;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::conversation::{media_placeholder, Conversation, ToolChoice};
use crate::error::ApiError;
use crate::hosted::is_hosted_tool;
use crate::openai::params::{CommonParams, StopField};
use crate::structured;

/// The request fields (`metadata` and other extras are ignored).
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    messages: Value,
    system: Option<Value>,
    pub max_tokens: Option<usize>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    stop_sequences: Option<Vec<String>>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    pub stream: Option<bool>,
    thinking: Option<Value>,
    output_config: Option<Value>,
    output_format: Option<Value>,
    fill: Option<String>,
    kv_cache_dtype: Option<String>,
    quantized_kv_start: Option<usize>,
}

fn bad(param: String, message: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, message)
}

/// The text of a text block; `at` names it.
fn block_text<'a>(b: &'a Value, at: &str) -> Result<&'a str, ApiError> {
    match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
        (Some("text"), Some(t)) => Ok(t),
        _ => Err(bad(at.to_string(), format!("'{at}' must be a text block"))),
    }
}

/// The text of a string or a list of text blocks (joined by newlines); `at` names the field.
fn text_blocks(content: &Value, at: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let texts = blocks.iter().enumerate().map(|(j, b)| block_text(b, &format!("{at}[{j}]")));
            Ok(texts.collect::<Result<Vec<_>, _>>()?.join("\n"))
        }
        _ => Err(bad(at.to_string(), format!("'{at}' must be a string or a list of text blocks"))),
    }
}

impl MessagesRequest {
    /// The conversation to answer.
    pub fn conversation(&self) -> Result<Conversation, ApiError> {
        let mut messages = Vec::new();
        if let Some(system) = self.system.as_ref().filter(|s| !s.is_null()) {
            messages.push(json!({"role": "system", "content": text_blocks(system, "system")?}));
        }
        let list = self.messages.as_array().ok_or_else(|| bad("messages".into(), "'messages' must be an array"))?;
        if list.is_empty() {
            return Err(bad("messages".into(), "'messages' must hold at least one message"));
        }
        for (i, m) in list.iter().enumerate() {
            turn(i, m, i + 1 == list.len(), &mut messages)?;
        }
        let mut kwargs = Map::new();
        if let Some(t) = self.thinking.as_ref().and_then(|t| t.get("type")).and_then(Value::as_str) {
            kwargs.insert("enable_thinking".into(), Value::Bool(t != "disabled"));
        }
        let single_tool_call = self
            .tool_choice
            .as_ref()
            .and_then(|c| c.get("disable_parallel_tool_use"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(Conversation {
            messages,
            tools: self.tools()?,
            tool_choice: self.tool_choice()?,
            kwargs,
            add_generation_prompt: true,
            single_tool_call,
        })
    }

    /// The output constraint of `output_config.format` (or the older top-level
    /// `output_format`): `{"type": "json_schema", "schema": {...}}`.
    pub fn constraint(&self) -> Result<Option<Constraint>, ApiError> {
        match self.output_config.as_ref().and_then(|c| c.get("format")).filter(|f| !f.is_null()) {
            Some(format) => structured::from_format(format, "output_config.format"),
            None => match self.output_format.as_ref() {
                Some(format) => structured::from_format(format, "output_format"),
                None => Ok(None),
            },
        }
    }

    /// The `type`s of the server tools left out of the prompt.
    pub fn omitted_tools(&self) -> Vec<String> {
        let kinds = self.tools.iter().flatten().filter_map(|t| t.get("type").and_then(Value::as_str));
        kinds.filter(|k| is_hosted_tool(k)).map(str::to_string).collect()
    }

    fn tools(&self) -> Result<Vec<Value>, ApiError> {
        let mut out = Vec::new();
        for (i, t) in self.tools.iter().flatten().enumerate() {
            let at = format!("tools[{i}]");
            match t.get("type").and_then(Value::as_str) {
                None | Some("custom") => {}
                Some(kind) if is_hosted_tool(kind) => continue,
                Some(_) => {
                    return Err(bad(format!("{at}.type"), "only client tools (with an input_schema) are supported"))
                }
            }
            let name = t
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("{at}.name"), format!("'{at}.name' must be a string")))?;
            let schema = t
                .get("input_schema")
                .filter(|s| s.is_object())
                .ok_or_else(|| bad(format!("{at}.input_schema"), format!("'{at}.input_schema' must be an object")))?;
            let mut function = json!({"name": name, "parameters": schema});
            if let Some(d) = t.get("description").and_then(Value::as_str) {
                function["description"] = json!(d);
            }
            out.push(json!({"type": "function", "function": function}));
        }
        Ok(out)
    }

    fn tool_choice(&self) -> Result<ToolChoice, ApiError> {
        let Some(choice) = self.tool_choice.as_ref().filter(|c| !c.is_null()) else { return Ok(ToolChoice::Auto) };
        match (choice.get("type").and_then(Value::as_str), choice.get("name").and_then(Value::as_str)) {
            (Some("auto"), _) => Ok(ToolChoice::Auto),
            (Some("any"), _) => Ok(ToolChoice::Required),
            (Some("none"), _) => Ok(ToolChoice::None),
            (Some("tool"), Some(name)) => Ok(ToolChoice::Function(name.to_string())),
            (Some("tool"), None) => Err(bad("tool_choice.name".into(), "tool_choice of type 'tool' needs a name")),
            _ => Err(bad("tool_choice.type".into(), "tool_choice.type must be 'auto', 'any', 'tool' or 'none'")),
        }
    }

    /// The sampling fields in the OpenAI shape the engine parameters are built from.
    pub fn params(&self) -> CommonParams {
        CommonParams {
            model: Some(self.model.clone()),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            stop: self.stop_sequences.clone().map(StopField::Many),
            max_tokens: self.max_tokens,
            stream: self.stream,
            fill: self.fill.clone(),
            kv_cache_dtype: self.kv_cache_dtype.clone(),
            quantized_kv_start: self.quantized_kv_start,
            ..CommonParams::default()
        }
    }
}

/// The text of a `tool_result`'s content: a string, or blocks — text as is, an image or a
/// document as a placeholder (the model cannot see it; the turn goes on).
fn tool_result_text(content: &Value, at: &str) -> Result<String, ApiError> {
    let Value::Array(blocks) = content else { return text_blocks(content, at) };
    let mut texts = Vec::with_capacity(blocks.len());
    for (j, b) in blocks.iter().enumerate() {
        match b.get("type").and_then(Value::as_str) {
            Some(kind @ ("image" | "document")) => texts.push(media_placeholder(kind)),
            _ => texts.push(block_text(b, &format!("{at}[{j}]"))?.to_string()),
        }
    }
    Ok(texts.join("\n"))
}

/// Append the messages of turn `i` (`last`: the conversation's final turn).
fn turn(i: usize, m: &Value, last: bool, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let at = format!("messages[{i}]");
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant" | "system")) => r,
        _ => return Err(bad(format!("{at}.role"), format!("'{at}.role' must be 'user', 'assistant' or 'system'"))),
    };
    let content =
        m.get("content").ok_or_else(|| bad(format!("{at}.content"), format!("'{at}.content' is required")))?;
    if role == "system" {
        out.push(json!({"role": "system", "content": text_blocks(content, &format!("{at}.content"))?}));
        return Ok(());
    }
    let blocks = match content {
        Value::String(s) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        // As Anthropic's API: only a final assistant message (a prefill) may be empty.
        Value::Array(blocks) if blocks.is_empty() && !(role == "assistant" && last) => {
            return Err(bad(format!("{at}.content"), format!("'{at}.content' must hold at least one block")))
        }
        Value::Array(blocks) => blocks,
        _ => return Err(bad(format!("{at}.content"), format!("'{at}.content' must be a string or a list of blocks"))),
    };
    let (mut texts, mut calls, mut thinking) = (Vec::new(), Vec::new(), String::new());
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        let field = |name: &str| b.get(name).and_then(Value::as_str);
        let missing = |name: &str| bad(format!("{at}.{name}"), format!("'{at}.{name}' must be a string"));
        match (role, b.get("type").and_then(Value::as_str)) {
            (_, Some("text")) => texts.push(field("text").ok_or_else(|| missing("text"))?.to_string()),
            ("user", Some("tool_result")) => {
                let id = field("tool_use_id").ok_or_else(|| missing("tool_use_id"))?;
                let result = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => tool_result_text(c, &format!("{at}.content"))?,
                };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
            }
            ("assistant", Some("tool_use")) => {
                let id = field("id").ok_or_else(|| missing("id"))?;
                let name = field("name").ok_or_else(|| missing("name"))?;
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                let function = json!({"name": name, "arguments": input.to_string()});
                calls.push(json!({"id": id, "type": "function", "function": function}));
            }
            ("assistant", Some("thinking")) => thinking.push_str(field("thinking").unwrap_or_default()),
            ("assistant", Some("redacted_thinking")) => {}
            (_, Some(other)) => {
                return Err(bad(
                    format!("{at}.type"),
                    format!("content blocks of type '{other}' are not supported here"),
                ))
            }
            (_, None) => return Err(bad(format!("{at}.type"), format!("'{at}.type' must be a string"))),
        }
    }
    if role == "user" && texts.is_empty() {
        return Ok(());
    }
    let mut message = json!({"role": role, "content": texts.join("\n")});
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls);
        if texts.is_empty() {
            message["content"] = Value::Null;
        }
    }
    if !thinking.is_empty() {
        message["reasoning_content"] = json!(thinking);
    }
    out.push(message);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> MessagesRequest {
        serde_json::from_value(body).expect("request")
    }

    #[test]
    fn blocks_map_to_chat_messages() {
        let req = request(json!({
            "model": "m", "max_tokens": 5,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "cold"}]},
                    {"type": "text", "text": "Thanks"}]},
            ],
            "tools": [{"name": "w", "description": "weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "w"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        }));
        let conv = req.conversation().expect("conversation");
        assert_eq!(
            conv.messages,
            vec![
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Weather in Oslo?"}),
                json!({"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.", "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "w", "arguments": "{\"city\":\"Oslo\"}"}}]}),
                json!({"role": "tool", "tool_call_id": "toolu_1", "content": "cold"}),
                json!({"role": "user", "content": "Thanks"}),
            ]
        );
        assert_eq!(
            conv.tools,
            vec![
                json!({"type": "function", "function": {"name": "w", "parameters": {"type": "object"}, "description": "weather"}})
            ]
        );
        assert_eq!(conv.tool_choice, ToolChoice::Function("w".into()));
        assert_eq!(conv.kwargs.get("enable_thinking"), Some(&json!(true)));
    }

    #[test]
    fn bad_blocks_name_the_field() {
        let cases = [
            (json!([{"role": "tool", "content": "x"}]), "messages[0].role"),
            (json!([{"role": "system", "content": [{"type": "image"}]}]), "messages[0].content[0]"),
            (json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]), "messages[0].content[0].type"),
            (json!([{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text"),
            (json!([{"role": "user", "content": 5}]), "messages[0].content"),
        ];
        for (messages, param) in cases {
            let err = request(json!({"model": "m", "messages": messages})).conversation().expect_err("bad");
            assert_eq!(err.param.as_deref(), Some(param), "{err}");
        }
    }
}
