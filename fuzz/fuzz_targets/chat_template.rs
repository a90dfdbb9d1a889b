//! The chat-template renderer on hostile templates and messages. Input: template source, a
//! NUL byte, then JSON — a list of messages, or an object with `messages`, `tools`,
//! `add_generation_prompt` and extra template variables. Compiling and rendering may fail
//! (a clear error); they must not panic or hang.
#![no_main]

use ferrite_models::chat_template::{ChatRenderRequest, ChatTemplate};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map, Value};

fuzz_target!(|data: &[u8]| {
    let (source, rest) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(source) = std::str::from_utf8(source) else { return };
    let Ok(template) = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into())) else { return };
    let input: Value = serde_json::from_slice(rest).unwrap_or_else(|_| json!([{"role": "user", "content": "hi"}]));
    let (messages, tools, add_generation_prompt, extra) = match &input {
        Value::Array(m) => (m.clone(), None, true, Map::new()),
        Value::Object(o) => (
            o.get("messages").and_then(Value::as_array).cloned().unwrap_or_default(),
            o.get("tools").and_then(Value::as_array).cloned(),
            o.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true),
            o.get("extra").and_then(Value::as_object).cloned().unwrap_or_default(),
        ),
        _ => return,
    };
    let req = ChatRenderRequest { messages: &messages, tools: tools.as_deref(), add_generation_prompt, extra };
    let _ = template.render(&req);
});
