//! Tool calls and reasoning through `/v1/chat/completions` on SmolLM2: calls forced by
//! `tool_choice` (named and required) in the template's family syntax — described by the
//! server for SmolLM2's tool-less template, rendered by a Hermes template — streamed as
//! deltas; tool history round trips; reasoning split out when a template opens a think
//! block; a family this server cannot force is a 400. A forced call's arguments are
//! constrained to its tool's schema.

use ferrite_models::chat_template::ChatTemplate;
use ferrite_server::{App, ModelInfo, ServerConfig};
use serde_json::{json, Value};

use crate::common::*;

/// A tool whose schema an unconstrained small model rarely meets: bounds, an enum, required keys.
pub fn forecast_schema() -> Value {
    json!({"type": "object", "required": ["city", "days", "unit"],
           "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}})
}

/// Whether `input` validates against `schema`.
pub fn validates(schema: &Value, input: &Value) -> bool {
    jsonschema::validator_for(schema).expect("schema").is_valid(input)
}

pub fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
}

fn forced_body(max_tokens: usize) -> Value {
    json!({"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [weather_tool()],
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": max_tokens,
           "temperature": 0})
}

/// SmolLM2 serving with another chat template.
pub fn smol_with_template(source: &str) -> TestServer {
    let mut info = ModelInfo::new(smollm2(), "smollm2".into(), vec![]);
    info.chat_template = Some(ChatTemplate::new(source, None, None).expect("template"));
    start(App::new(engine(smollm2(), Some(512), false), info, ServerConfig::default()))
}

/// The decoded prompt `/tokenize` renders for a chat `body`.
pub async fn prompt_text(server: &TestServer, body: &Value) -> String {
    let mut req = json!({"messages": body["messages"]});
    for key in ["tools", "tool_choice", "chat_template_kwargs"] {
        if let Some(v) = body.get(key) {
            req[key] = v.clone();
        }
    }
    let (status, tok) = post(&server.at("/tokenize"), &req).await;
    assert_eq!(status, 200, "{tok}");
    smollm2().tokenizer.as_ref().expect("tokenizer").decode(&ids(&tok["tokens"]), false).expect("decode")
}

/// Tool calls merged from streamed deltas, checking each call opens with id, type and name.
pub fn streamed_calls(events: &[Value]) -> Vec<Value> {
    let mut calls: Vec<Value> = Vec::new();
    for e in events {
        for piece in e["choices"][0]["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = piece["index"].as_u64().expect("index") as usize;
            if i == calls.len() {
                assert!(piece["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{piece}");
                assert_eq!(piece["type"], "function");
                calls.push(json!({"id": piece["id"], "type": "function",
                                  "function": {"name": piece["function"]["name"], "arguments": ""}}));
            }
            let args = piece["function"]["arguments"].as_str().expect("arguments");
            let merged = format!("{}{args}", calls[i]["function"]["arguments"].as_str().expect("str"));
            calls[i]["function"]["arguments"] = json!(merged);
        }
    }
    calls
}

fn object_args(call: &Value) -> Value {
    let args = call["function"]["arguments"].as_str().expect("arguments string");
    let v: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("arguments {args:?}: {e}"));
    assert!(v.is_object(), "arguments {v} is an object");
    v
}

#[tokio::test]
async fn a_named_call_is_forced_and_streamed() {
    let server = own_smol();
    let body = forced_body(48);
    let prompt = prompt_text(&server, &body).await;
    assert!(prompt.contains("# Tools") && prompt.contains("\"get_weather\""), "tools described: {prompt}");
    assert!(
        prompt.ends_with("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "),
        "{prompt}"
    );
    let (status, whole) = post(&server.at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{whole}");
    let choice = &whole["choices"][0];
    let calls = choice["message"]["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert!(calls[0]["id"].as_str().is_some_and(|id| id.starts_with("call_")));
    object_args(&calls[0]);
    let finish = choice["finish_reason"].as_str().expect("finish_reason");
    assert_eq!(finish, "tool_calls", "a forced call ends the reply: {whole}");
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let events = post_stream(&server.at("/v1/chat/completions"), &stream_body).await;
    let streamed = streamed_calls(&events);
    assert_eq!(streamed.len(), calls.len());
    for (s, w) in streamed.iter().zip(calls) {
        assert_eq!(s["function"], w["function"], "streamed call = whole call");
    }
    let finishes: Vec<&str> = events.iter().filter_map(|e| e["choices"][0]["finish_reason"].as_str()).collect();
    assert_eq!(finishes, vec![finish]);
}

#[tokio::test]
async fn required_forces_a_call() {
    // One tool: required means that one.
    let mut body = forced_body(24);
    body["tool_choice"] = json!("required");
    let prompt = prompt_text(smol(), &body).await;
    assert!(prompt.ends_with("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "), "{prompt}");
    let (status, resp) = post(&smol().at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{resp}");
    let calls = resp["choices"][0]["message"]["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    object_args(&calls[0]);
    // Several: the model writes the name.
    let other = json!({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}});
    body["tools"] = json!([weather_tool(), other]);
    let prompt = prompt_text(smol(), &body).await;
    assert!(prompt.ends_with("<tool_call>\n{\"name\": \""), "{prompt}");
    let (status, resp) = post(&smol().at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{resp}");
    let calls = resp["choices"][0]["message"]["tool_calls"].as_array().expect("tool_calls");
    assert!(calls[0]["function"]["name"].as_str().is_some_and(|n| !n.is_empty()), "{resp}");
    object_args(&calls[0]);
}

#[tokio::test]
async fn forced_call_arguments_validate_against_the_schema() {
    let forecast = json!({"type": "function", "function": {"name": "get_forecast", "parameters": forecast_schema()}});
    let named = json!({"type": "function", "function": {"name": "get_forecast"}});
    for choice in [json!("required"), named] {
        let body = json!({"messages": [{"role": "user", "content": "Forecast for Paris?"}], "temperature": 0,
                          "tools": [weather_tool(), forecast], "tool_choice": choice, "max_tokens": 64});
        let (status, resp) = post(&smol().at("/v1/chat/completions"), &body).await;
        assert_eq!(status, 200, "{resp}");
        let call = &resp["choices"][0]["message"]["tool_calls"][0]["function"];
        let schema = match call["name"].as_str() {
            Some("get_forecast") => forecast_schema(),
            Some("get_weather") => weather_tool()["function"]["parameters"].clone(),
            other => panic!("{choice}: a call of {other:?}: {resp}"),
        };
        assert!(validates(&schema, &object_args(&resp["choices"][0]["message"]["tool_calls"][0])), "{choice}: {resp}");
        assert_eq!(resp["choices"][0]["finish_reason"], "tool_calls", "{resp}");
    }
}

#[tokio::test]
async fn a_hermes_template_renders_the_tools_and_the_opening() {
    let dir = ferrite_models::paths::test_assets_dir().join("llama.cpp-models/templates");
    let Ok(source) = std::fs::read_to_string(dir.join("Qwen-Qwen2.5-7B-Instruct.jinja")) else {
        eprintln!("test assets missing: skipped");
        return;
    };
    let server = smol_with_template(&source);
    let body = forced_body(20);
    let prompt = prompt_text(&server, &body).await;
    assert!(prompt.contains("<tools>\n{\"type\": \"function\""), "the template lists the tools: {prompt}");
    assert!(!prompt.contains("{\"type\":\"function\""), "the server does not describe them again");
    assert!(
        prompt.ends_with("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "),
        "{prompt}"
    );
    let (status, resp) = post(&server.at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_weather");
}

#[tokio::test]
async fn tool_history_round_trips() {
    let body = json!({
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
        ],
        "tools": [weather_tool()], "max_tokens": 6, "temperature": 0,
    });
    let prompt = prompt_text(smol(), &body).await;
    assert!(
        prompt.contains("<|im_start|>assistant\n<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call><|im_end|>"),
        "{prompt}"
    );
    assert!(prompt.contains("<|im_start|>user\n<tool_response>\nsunny, 24 C\n</tool_response><|im_end|>"), "{prompt}");
    let (status, resp) = post(&smol().at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{resp}");
}

/// SmolLM2's template, but the generation prompt opens a think block.
pub const THINKING_TEMPLATE: &str =
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
    {% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}";

#[tokio::test]
async fn reasoning_from_a_block_the_template_opens() {
    let server = smol_with_template(THINKING_TEMPLATE);
    let body = chat_body("Why is the sky blue?", 10);
    let (status, whole) = post(&server.at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{whole}");
    let message = &whole["choices"][0]["message"];
    let reasoning = message["reasoning_content"].as_str().expect("reasoning_content");
    assert!(!reasoning.is_empty() && !reasoning.contains("</think>"));
    assert_eq!(message["content"], "", "all of a reply inside the open block is reasoning: {message}");
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let events = post_stream(&server.at("/v1/chat/completions"), &stream_body).await;
    let streamed: String =
        events.iter().filter_map(|e| e["choices"][0]["delta"]["reasoning_content"].as_str()).collect();
    assert_eq!(streamed, reasoning);
    // A forced call closes the block first.
    let forced = forced_body(16);
    let prompt = prompt_text(&server, &forced).await;
    assert!(
        prompt.ends_with("<think>\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "),
        "{prompt}"
    );
    let (_, resp) = post(&server.at("/v1/chat/completions"), &forced).await;
    let message = &resp["choices"][0]["message"];
    assert_eq!(message["tool_calls"][0]["function"]["name"], "get_weather", "{resp}");
    assert!(message.get("reasoning_content").is_none(), "{message}");
}

#[tokio::test]
async fn a_family_without_a_known_syntax_cannot_be_forced() {
    let source = "{% if tools %}TOOLS: {{ tools | length }}\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n\
                  {{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let server = smol_with_template(source);
    let body = forced_body(4);
    assert_error(post(&server.at("/v1/chat/completions"), &body).await, 400, Some("tool_choice"), "cannot force");
    let mut auto = body.clone();
    auto["tool_choice"] = json!("auto");
    let (status, resp) = post(&server.at("/v1/chat/completions"), &auto).await;
    assert_eq!(status, 200, "{resp}");
    assert!(resp["choices"][0]["message"]["content"].is_string());
    assert!(prompt_text(&server, &auto).await.starts_with("TOOLS: 1\n"), "the template shows its tools itself");
}
