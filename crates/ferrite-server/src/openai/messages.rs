//! Chat messages, tools and `tool_choice` as OpenAI sends them: checked field by field (a
//! wrong type is a 400 naming `messages[i].field`) and normalized for the chat template
//! (`developer` becomes `system`; everything else passes through as sent, so templates see
//! `tool_calls`, `tool_call_id`, `name`, `reasoning_content`, ...).

use serde_json::{Map, Value};

use crate::conversation::ToolChoice;
use crate::error::ApiError;

const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Check and normalize `messages`.
pub fn normalize_messages(raw: &Value) -> Result<Vec<Value>, ApiError> {
    let list = raw.as_array().ok_or_else(|| ApiError::invalid_param("messages", "'messages' must be an array"))?;
    if list.is_empty() {
        return Err(ApiError::invalid_param("messages", "'messages' must hold at least one message"));
    }
    list.iter().enumerate().map(|(i, m)| normalize_message(i, m)).collect()
}

fn normalize_message(i: usize, m: &Value) -> Result<Value, ApiError> {
    let field = |name: &str| format!("messages[{i}].{name}");
    let bad = |name: &str, msg: &str| ApiError::invalid_param(field(name), format!("'{}' {msg}", field(name)));
    let obj = m
        .as_object()
        .ok_or_else(|| ApiError::invalid_param(format!("messages[{i}]"), format!("messages[{i}] must be an object")))?;
    let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| bad("role", "must be a string"))?;
    if !ROLES.contains(&role) {
        return Err(bad("role", &format!("must be one of {}, got '{role}'", ROLES.join(", "))));
    }
    match obj.get("content") {
        None | Some(Value::Null) if role == "assistant" => {}
        None | Some(Value::Null) => return Err(bad("content", "is required")),
        Some(Value::String(_)) => {}
        Some(Value::Array(parts)) => {
            for (j, part) in parts.iter().enumerate() {
                check_part(&field(&format!("content[{j}]")), part)?;
            }
        }
        Some(_) => return Err(bad("content", "must be a string or an array of content parts")),
    }
    if let Some(calls) = obj.get("tool_calls").filter(|v| !v.is_null()) {
        let calls = calls.as_array().ok_or_else(|| bad("tool_calls", "must be an array"))?;
        for (j, call) in calls.iter().enumerate() {
            check_tool_call(&field(&format!("tool_calls[{j}]")), call)?;
        }
    }
    for name in ["tool_call_id", "name", "reasoning_content"] {
        if obj.get(name).is_some_and(|v| !v.is_string() && !v.is_null()) {
            return Err(bad(name, "must be a string"));
        }
    }
    let mut out = obj.clone();
    if role == "developer" {
        out.insert("role".into(), Value::from("system"));
    }
    Ok(Value::Object(out))
}

fn check_part(at: &str, part: &Value) -> Result<(), ApiError> {
    let kind = part.get("type").and_then(Value::as_str);
    match kind {
        Some("text") if part.get("text").is_some_and(Value::is_string) => Ok(()),
        Some("text") => Err(ApiError::invalid_param(format!("{at}.text"), format!("'{at}.text' must be a string"))),
        Some(other) => Err(ApiError::invalid_param(
            format!("{at}.type"),
            format!("only text content parts are supported, got '{other}'"),
        )),
        None => Err(ApiError::invalid_param(format!("{at}.type"), format!("'{at}.type' must be a string"))),
    }
}

fn check_tool_call(at: &str, call: &Value) -> Result<(), ApiError> {
    let f = call.get("function");
    if !f.and_then(|f| f.get("name")).is_some_and(Value::is_string) {
        return Err(ApiError::invalid_param(
            format!("{at}.function.name"),
            format!("'{at}.function.name' must be a string"),
        ));
    }
    match f.and_then(|f| f.get("arguments")) {
        None | Some(Value::String(_)) | Some(Value::Object(_)) => Ok(()),
        Some(_) => Err(ApiError::invalid_param(
            format!("{at}.function.arguments"),
            format!("'{at}.function.arguments' must be a JSON string"),
        )),
    }
}

/// Check `tools`: function tools with a name.
pub fn check_tools(tools: Option<&[Value]>) -> Result<Vec<Value>, ApiError> {
    let tools = tools.unwrap_or_default();
    for (i, t) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid_param(format!("{at}.type"), "only tools of type 'function' are supported"));
        }
        if !t.get("function").and_then(|f| f.get("name")).is_some_and(Value::is_string) {
            return Err(ApiError::invalid_param(
                format!("{at}.function.name"),
                format!("'{at}.function.name' must be a string"),
            ));
        }
        // A call's arguments are an object, so its schema is one (OpenAI says the same).
        if t["function"].get("parameters").is_some_and(|p| !p.is_object() && !p.is_null()) {
            return Err(ApiError::invalid_param(
                format!("{at}.function.parameters"),
                format!("'{at}.function.parameters' must be a JSON Schema object"),
            ));
        }
    }
    Ok(tools.to_vec())
}

/// Chat's `tool_choice`: "none", "auto", "required" or `{"type": "function", "function":
/// {"name": …}}`.
pub fn tool_choice(v: Option<&Value>) -> Result<ToolChoice, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) if s == "auto" => Ok(ToolChoice::Auto),
        Some(Value::String(s)) if s == "none" => Ok(ToolChoice::None),
        Some(Value::String(s)) if s == "required" => Ok(ToolChoice::Required),
        Some(Value::Object(o)) => match o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) => Ok(ToolChoice::Function(name.to_string())),
            None => {
                Err(ApiError::invalid_param("tool_choice.function.name", "tool_choice.function.name must be a string"))
            }
        },
        Some(_) => {
            Err(ApiError::invalid_param("tool_choice", "tool_choice must be 'none', 'auto', 'required' or an object"))
        }
    }
}

/// The template kwargs of a request: `chat_template_kwargs`, plus `reasoning_effort` unless
/// the kwargs set it.
pub fn template_kwargs(kwargs: Option<&Map<String, Value>>, reasoning_effort: Option<&str>) -> Map<String, Value> {
    let mut out = kwargs.cloned().unwrap_or_default();
    if let Some(effort) = reasoning_effort {
        out.entry("reasoning_effort").or_insert_with(|| Value::from(effort));
    }
    out
}
