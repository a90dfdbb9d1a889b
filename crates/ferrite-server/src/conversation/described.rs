//! Tools for chat templates that ignore them (SmolLM2, Gemma 2, Phi-3.5, …): the server
//! describes the tools in the system message and asks for Hermes-style
//! `<tool_call>{"name": …, "arguments": …}</tool_call>` replies, and writes earlier calls and
//! their results into the conversation as text in the same syntax (assistant calls in the
//! assistant's content, results as a user turn of `<tool_response>` blocks), since such a
//! template renders only roles and content. A template that refuses system messages gets
//! the description at the top of the first user message instead.

use serde_json::{json, Value};

use super::{text_of, Conversation};
use crate::error::ApiError;
use crate::prompt::ChatPrompt;
use crate::state::ModelInfo;

/// The prompt text of `messages` (those of `conv`, or a rewrite of them) with `tools` (those
/// not hidden) described by the server.
pub fn render(model: &ModelInfo, messages: &[Value], conv: &Conversation, tools: &[Value]) -> Result<String, ApiError> {
    let messages = history_as_text(messages);
    let render = |messages: &[Value]| {
        model.render_chat(&ChatPrompt {
            messages,
            tools: None,
            add_generation_prompt: conv.add_generation_prompt,
            kwargs: conv.kwargs.clone(),
        })
    };
    if tools.is_empty() {
        return render(&messages);
    }
    let description = describe(tools);
    match render(&with_description(&messages, &description, true)) {
        // Maybe the template refuses system messages: try the first user message.
        Err(e) if messages.first().is_none_or(|m| m["role"] != "system") => {
            render(&with_description(&messages, &description, false)).map_err(|_| e)
        }
        other => other,
    }
}

fn describe(tools: &[Value]) -> String {
    let list: Vec<String> = tools.iter().map(Value::to_string).collect();
    format!(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\n\
         For each function call, return a json object with function name and arguments within \
         <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
        list.join("\n")
    )
}

/// `messages` with `description` appended to the system message (inserting one), or put
/// before the first user message's text.
fn with_description(messages: &[Value], description: &str, in_system: bool) -> Vec<Value> {
    let mut out = messages.to_vec();
    if in_system {
        match out.first_mut() {
            Some(first) if first["role"] == "system" => {
                let text = text_of(&first["content"]);
                first["content"] = json!(format!("{text}\n\n{description}"));
            }
            _ => out.insert(0, json!({"role": "system", "content": description})),
        }
    } else if let Some(user) = out.iter_mut().find(|m| m["role"] == "user") {
        let text = text_of(&user["content"]);
        user["content"] = json!(format!("{description}\n\n{text}"));
    }
    out
}

/// Earlier tool calls and results written as text.
fn history_as_text(messages: &[Value]) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::with_capacity(messages.len());
    // The last message written is a user turn of tool results (the next result joins it).
    let mut results_turn = false;
    for m in messages {
        let role = m["role"].as_str();
        if role == Some("tool") {
            let block = format!("<tool_response>\n{}\n</tool_response>", text_of(&m["content"]));
            match out.last_mut() {
                Some(last) if results_turn => {
                    last["content"] = json!(format!("{}\n{block}", text_of(&last["content"])))
                }
                _ => out.push(json!({"role": "user", "content": block})),
            }
            results_turn = true;
            continue;
        }
        results_turn = false;
        if role != Some("assistant") || m.get("tool_calls").is_none_or(Value::is_null) {
            out.push(m.clone());
            continue;
        }
        let mut text = text_of(&m["content"]);
        for call in m["tool_calls"].as_array().into_iter().flatten() {
            let f = &call["function"];
            let args = match &f["arguments"] {
                Value::String(s) => serde_json::from_str(s).unwrap_or_else(|_| json!(s)),
                other => other.clone(),
            };
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&format!("<tool_call>\n{}\n</tool_call>", json!({"name": f["name"], "arguments": args})));
        }
        out.push(json!({"role": "assistant", "content": text}));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_and_results_become_text() {
        let messages = vec![
            json!({"role": "user", "content": "Weather?"}),
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Oslo\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "w", "arguments": {"city": "Rome"}}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "cold"}),
            json!({"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "warm"}]}),
        ];
        let out = history_as_text(&messages);
        assert_eq!(out.len(), 3);
        assert_eq!(
            out[1],
            json!({"role": "assistant", "content": "<tool_call>\n{\"name\":\"w\",\"arguments\":{\"city\":\"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\":\"w\",\"arguments\":{\"city\":\"Rome\"}}\n</tool_call>"})
        );
        assert_eq!(
            out[2],
            json!({"role": "user", "content": "<tool_response>\ncold\n</tool_response>\n<tool_response>\nwarm\n</tool_response>"})
        );
    }

    #[test]
    fn the_description_goes_to_the_system_or_first_user_message() {
        let messages =
            vec![json!({"role": "system", "content": "Be brief."}), json!({"role": "user", "content": "Hi"})];
        let out = with_description(&messages, "TOOLS", true);
        assert_eq!(out[0]["content"], "Be brief.\n\nTOOLS");
        let out = with_description(&messages[1..], "TOOLS", true);
        assert_eq!(out[0], json!({"role": "system", "content": "TOOLS"}));
        let out = with_description(&messages[1..], "TOOLS", false);
        assert_eq!(out[0], json!({"role": "user", "content": "TOOLS\n\nHi"}));
    }
}
