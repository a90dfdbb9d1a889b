//! OpenAI-style messages made ready for a template: tool-call arguments sent as a JSON
//! string become a mapping (templates iterate `arguments.items()` or pipe it to `tojson`;
//! the caller retries with the strings for the few templates that concatenate them),
//! `content: null` (an assistant turn that only calls tools) becomes `""` (as vLLM does; many
//! templates test `'<think>' in content` or concatenate it), and list-of-parts content is
//! joined into a string for templates that only print strings.

use serde_json::Value;

/// Copies `messages` for rendering. `flatten_parts`: the template cannot iterate content
/// parts, so text parts are joined with `"\n"` (as vLLM does) and other parts dropped.
/// `parse_args`: JSON-object argument strings become mappings.
pub(crate) fn prepare_messages(messages: &[Value], flatten_parts: bool, parse_args: bool) -> Vec<Value> {
    messages
        .iter()
        .map(|message| {
            let mut message = message.clone();
            if let Some(obj) = message.as_object_mut() {
                if let (true, Some(Value::Array(calls))) = (parse_args, obj.get_mut("tool_calls")) {
                    for call in calls.iter_mut() {
                        parse_arguments(call);
                    }
                }
                if let Some(content @ Value::Null) = obj.get_mut("content") {
                    *content = Value::String(String::new());
                }
                if flatten_parts {
                    if let Some(content) = obj.get_mut("content") {
                        if let Some(text) = join_text_parts(content) {
                            *content = Value::String(text);
                        }
                    }
                }
            }
            message
        })
        .collect()
}

/// Whether some tool call's `function.arguments` is a string.
pub(crate) fn has_string_arguments(messages: &[Value]) -> bool {
    messages
        .iter()
        .filter_map(|m| m.get("tool_calls")?.as_array())
        .flatten()
        .any(|call| call.get("function").and_then(|f| f.get("arguments")).is_some_and(Value::is_string))
}

/// `{"function": {"arguments": "{\"a\": 1}"}}` → `{"function": {"arguments": {"a": 1}}}`;
/// a string that is not a JSON object stays a string.
fn parse_arguments(call: &mut Value) {
    let Some(function) = call.get_mut("function").and_then(Value::as_object_mut) else {
        return;
    };
    let Some(Value::String(text)) = function.get("arguments") else {
        return;
    };
    if let Ok(parsed @ Value::Object(_)) = serde_json::from_str::<Value>(text) {
        function.insert("arguments".to_string(), parsed);
    }
}

/// The text of a list of content parts (`{"type": "text", "text": …}` or bare strings).
fn join_text_parts(content: &Value) -> Option<String> {
    let parts = content.as_array()?;
    let texts: Vec<&str> = parts
        .iter()
        .filter_map(|part| match part {
            Value::String(s) => Some(s.as_str()),
            Value::Object(o) => {
                let is_text = o.get("type").and_then(Value::as_str).is_none_or(|t| t == "text");
                if is_text {
                    o.get("text").and_then(Value::as_str)
                } else {
                    None
                }
            }
            _ => None,
        })
        .collect();
    Some(texts.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn arguments_string_becomes_mapping() {
        let msgs = [json!({"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
            {"type": "function", "function": {"name": "g", "arguments": "not json"}}
        ]})];
        let out = prepare_messages(&msgs, false, true);
        assert!(has_string_arguments(&msgs));
        assert_eq!(out[0]["tool_calls"][0]["function"]["arguments"], json!({"a": 1}));
        assert_eq!(out[0]["tool_calls"][1]["function"]["arguments"], json!("not json"));
        assert!(out[0].get("content").is_none());
        let out = prepare_messages(&[json!({"role": "assistant", "content": null})], false, true);
        assert_eq!(out[0]["content"], json!(""));
    }

    #[test]
    fn parts_are_flattened_only_when_asked() {
        let msgs = [json!({"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}
        ]})];
        assert_eq!(prepare_messages(&msgs, true, true)[0]["content"], json!("a\nb"));
        assert!(prepare_messages(&msgs, false, true)[0]["content"].is_array());
    }
}
