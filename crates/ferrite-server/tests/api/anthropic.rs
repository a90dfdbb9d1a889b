//! `/v1/messages` and `/v1/messages/count_tokens` on SmolLM2: the message shape and usage,
//! the exact streaming event sequence, tool_use blocks (forced, their input valid under the
//! tool's input_schema) and their round trip, stop
//! sequences, thinking blocks, and every error class in Anthropic's shape.

use std::time::Duration;

use ferrite_server::ServerConfig;
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::common::*;
use crate::tools::{forecast_schema, smol_with_template, validates, THINKING_TEMPLATE};

fn body(user: &str, max_tokens: usize) -> Value {
    json!({"model": "smollm2", "max_tokens": max_tokens, "temperature": 0, "system": "You are brief.",
           "messages": [{"role": "user", "content": user}], "metadata": {"user_id": "u1"}})
}

fn weather_tool() -> Value {
    json!({"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})
}

/// Assert an Anthropic-style error with `status` and `kind` whose message contains `needle`.
fn assert_anthropic_error(got: (StatusCode, Value), status: u16, kind: &str, needle: &str) {
    let (s, body) = got;
    assert_eq!(s.as_u16(), status, "status; body {body}");
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], kind, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_else(|| panic!("error.message in {body}"));
    assert!(message.contains(needle), "message {message:?} should contain {needle:?}");
}

fn text_of(msg: &Value) -> String {
    msg["content"].as_array().expect("content").iter().filter_map(|b| b["text"].as_str()).collect()
}

#[tokio::test]
async fn a_message_matches_chat_and_counts_its_tokens() {
    let server = own_smol();
    let (status, msg) = post(&server.at("/v1/messages"), &body("Name a color.", 12)).await;
    assert_eq!(status, 200, "{msg}");
    assert!(msg["id"].as_str().is_some_and(|id| id.starts_with("msg_")));
    assert_eq!(
        (msg["type"].as_str(), msg["role"].as_str(), msg["model"].as_str()),
        (Some("message"), Some("assistant"), Some("smollm2"))
    );
    assert_eq!(msg["content"][0]["type"], "text");
    assert!(["end_turn", "max_tokens"].contains(&msg["stop_reason"].as_str().expect("stop_reason")), "{msg}");
    assert!(msg["stop_sequence"].is_null());
    let chat = json!({"messages": [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}],
                      "max_tokens": 12, "temperature": 0});
    let (_, chat) = post(&server.at("/v1/chat/completions"), &chat).await;
    assert_eq!(text_of(&msg), chat["choices"][0]["message"]["content"].as_str().expect("content"));
    let u = &msg["usage"];
    assert_eq!(u["output_tokens"], chat["usage"]["completion_tokens"]);
    let input = u["input_tokens"].as_u64().expect("input") + u["cache_read_input_tokens"].as_u64().expect("cache read");
    assert_eq!(Some(input), chat["usage"]["prompt_tokens"].as_u64());
    let (status, count) = post(&server.at("/v1/messages/count_tokens"), &body("Name a color.", 12)).await;
    assert_eq!(status, 200, "{count}");
    assert_eq!(count, json!({"input_tokens": input}));
    // max_tokens far past the context (512 here) is a cap, not an error.
    let (status, long) = post(&server.at("/v1/messages"), &body(&"word ".repeat(450), 32000)).await;
    assert_eq!(status, 200, "{long}");
    let u = &long["usage"];
    let total =
        ["input_tokens", "cache_read_input_tokens", "output_tokens"].iter().map(|k| u[*k].as_u64().expect("count"));
    assert!(total.sum::<u64>() <= 512, "{u}");
}

#[tokio::test]
async fn streaming_follows_anthropics_event_sequence() {
    let server = own_smol();
    let (_, whole) = post(&server.at("/v1/messages"), &body("Count to five.", 12)).await;
    let mut req = body("Count to five.", 12);
    req["stream"] = json!(true);
    let events = post_events(&server.at("/v1/messages"), &req).await;
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str(), "the event name is its type");
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let n = names.len();
    assert_eq!(&names[..3], ["message_start", "ping", "content_block_start"]);
    assert_eq!(&names[n - 3..], ["content_block_stop", "message_delta", "message_stop"]);
    assert!(names[3..n - 3].iter().all(|&e| e == "content_block_delta"), "{names:?}");
    let start = &events[0].1["message"];
    assert_eq!(
        (start["id"].as_str().map(|i| i.starts_with("msg_")), start["content"].clone()),
        (Some(true), json!([]))
    );
    assert!(start["stop_reason"].is_null() && start["usage"]["input_tokens"].as_u64() > Some(0));
    assert_eq!(events[2].1["content_block"], json!({"type": "text", "text": ""}));
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| {
            assert_eq!((d["index"].as_u64(), d["delta"]["type"].as_str()), (Some(0), Some("text_delta")));
            d["delta"]["text"].as_str().expect("text").to_string()
        })
        .collect();
    assert_eq!(text, text_of(&whole));
    let delta = &events[n - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], whole["stop_reason"]);
    assert_eq!(delta["usage"], whole["usage"]);
}

#[tokio::test]
async fn a_forced_tool_use_streams_and_round_trips() {
    let server = own_smol();
    let mut req = body("What is the weather in Paris?", 48);
    req["tools"] = json!([weather_tool()]);
    req["tool_choice"] = json!({"type": "tool", "name": "get_weather"});
    let (status, msg) = post(&server.at("/v1/messages"), &req).await;
    assert_eq!(status, 200, "{msg}");
    let block =
        msg["content"].as_array().expect("content").iter().find(|b| b["type"] == "tool_use").expect("tool_use").clone();
    assert!(block["id"].as_str().is_some_and(|id| id.starts_with("toolu_")), "{block}");
    assert_eq!(block["name"], "get_weather");
    assert!(block["input"].is_object());
    // A forced call ends the reply, unless max_tokens cut it first.
    match msg["stop_reason"].as_str() {
        Some("tool_use") => {}
        Some("max_tokens") => assert_eq!(msg["usage"]["output_tokens"], 48, "{msg}"),
        other => panic!("stop_reason {other:?}: {msg}"),
    }
    req["stream"] = json!(true);
    let events = post_events(&server.at("/v1/messages"), &req).await;
    let (i, start) = events
        .iter()
        .enumerate()
        .find(|(_, (n, d))| n == "content_block_start" && d["content_block"]["type"] == "tool_use")
        .expect("tool_use start");
    assert_eq!(start.1["content_block"]["name"], "get_weather");
    assert_eq!(start.1["content_block"]["input"], json!({}));
    let index = &start.1["index"];
    let partial: String = events[i..]
        .iter()
        .filter(|(n, d)| n == "content_block_delta" && &d["index"] == index)
        .map(|(_, d)| d["delta"]["partial_json"].as_str().expect("input_json_delta").to_string())
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&partial).expect("streamed input is JSON"), block["input"]);
    // The call and its result go back to the model.
    let round = json!({"model": "smollm2", "max_tokens": 8, "tools": [weather_tool()], "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [block]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"], "content": "sunny"}]},
    ]});
    let (status, reply) = post(&server.at("/v1/messages"), &round).await;
    assert_eq!(status, 200, "{reply}");
    // tool_choice any: some tool.
    req["stream"] = json!(false);
    req["tool_choice"] = json!({"type": "any"});
    let (_, any) = post(&server.at("/v1/messages"), &req).await;
    assert!(any["content"].as_array().expect("content").iter().any(|b| b["type"] == "tool_use"), "{any}");
}

#[tokio::test]
async fn a_forced_tool_use_input_validates_against_its_input_schema() {
    let forecast = json!({"name": "get_forecast", "description": "Forecast", "input_schema": forecast_schema()});
    for choice in [json!({"type": "any"}), json!({"type": "tool", "name": "get_forecast"})] {
        let mut req = body("Forecast for Paris?", 64);
        req["tools"] = json!([weather_tool(), forecast]);
        req["tool_choice"] = choice.clone();
        let (status, msg) = post(&smol().at("/v1/messages"), &req).await;
        assert_eq!(status, 200, "{msg}");
        let blocks = msg["content"].as_array().expect("content");
        let block = blocks.iter().find(|b| b["type"] == "tool_use").unwrap_or_else(|| panic!("tool_use: {msg}"));
        let schema = match block["name"].as_str() {
            Some("get_forecast") => forecast_schema(),
            Some("get_weather") => weather_tool()["input_schema"].clone(),
            other => panic!("{choice}: a call of {other:?}: {msg}"),
        };
        assert!(validates(&schema, &block["input"]), "{choice}: {msg}");
        assert_eq!(msg["stop_reason"], "tool_use", "{msg}");
    }
}

#[tokio::test]
async fn stop_sequences_end_with_stop_sequence() {
    let server = own_smol();
    let (_, plain) = post(&server.at("/v1/messages"), &body("Write a sentence about the sea.", 16)).await;
    let text = text_of(&plain);
    let words: Vec<&str> = text.split_whitespace().collect();
    assert!(words.len() >= 4, "need a few words: {text:?}");
    let stop = format!(" {}", words[2]);
    let mut req = body("Write a sentence about the sea.", 16);
    req["stop_sequences"] = json!([stop]);
    let (_, cut) = post(&server.at("/v1/messages"), &req).await;
    assert_eq!(cut["stop_reason"], "stop_sequence");
    assert_eq!(cut["stop_sequence"], json!(stop));
    assert_eq!(text_of(&cut), &text[..text.find(&stop).expect("stop in text")]);
}

#[tokio::test]
async fn reasoning_comes_as_thinking_blocks() {
    let server = smol_with_template(THINKING_TEMPLATE);
    let mut req = body("Why is the sky blue?", 8);
    req["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
    let (status, msg) = post(&server.at("/v1/messages"), &req).await;
    assert_eq!(status, 200, "{msg}");
    let block = &msg["content"][0];
    assert_eq!((block["type"].as_str(), block["signature"].as_str()), (Some("thinking"), Some("")));
    let thinking = block["thinking"].as_str().expect("thinking");
    assert!(!thinking.is_empty());
    req["stream"] = json!(true);
    let events = post_events(&server.at("/v1/messages"), &req).await;
    assert_eq!(events[2].1["content_block"], json!({"type": "thinking", "thinking": "", "signature": ""}));
    let streamed: String = events
        .iter()
        .filter(|(_, d)| d["delta"]["type"] == "thinking_delta")
        .map(|(_, d)| d["delta"]["thinking"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(streamed, thinking);
}

#[tokio::test]
async fn request_errors_have_anthropics_shape() {
    let url = smol().at("/v1/messages");
    let mut no_max = body("x", 1);
    no_max.as_object_mut().expect("object").remove("max_tokens");
    assert_anthropic_error(post(&url, &no_max).await, 400, "invalid_request_error", "max_tokens is required");
    let mut image = body("x", 1);
    image["messages"] = json!([{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]);
    assert_anthropic_error(post(&url, &image).await, 400, "invalid_request_error", "'image' are not supported");
    let mut no_model = body("x", 1);
    no_model.as_object_mut().expect("object").remove("model");
    assert_anthropic_error(post(&url, &no_model).await, 400, "invalid_request_error", "model");
    assert_anthropic_error(
        post_raw(&url, b"{\"model\": ".to_vec()).await,
        400,
        "invalid_request_error",
        "not valid JSON",
    );
    let mut other = body("x", 1);
    other["model"] = json!("claude-sonnet-4");
    assert_anthropic_error(post(&url, &other).await, 404, "not_found_error", "claude-sonnet-4");
    let mut tool = body("x", 1);
    // Server tools (web search, …) are left out instead (tests/api/agents.rs); other typed tools are refused.
    tool["tools"] = json!([{"type": "bash_20250124", "name": "bash"}]);
    assert_anthropic_error(post(&url, &tool).await, 400, "invalid_request_error", "client tools");
    let (status, text) = get(&smol().at("/v1/messages/nope")).await;
    let parsed = serde_json::from_str(&text).expect("json");
    assert_anthropic_error((status, parsed), 404, "not_found_error", "no route");
    let (status, text) = get(&url).await;
    assert_anthropic_error((status, serde_json::from_str(&text).expect("json")), 405, "invalid_request_error", "GET");
    // Other routes keep OpenAI's shape.
    let (_, openai) = post(&smol().at("/v1/chat/completions"), &json!({"messages": "x"})).await;
    assert!(openai["error"]["message"].is_string() && openai.get("type").is_none());
}

#[tokio::test]
async fn limits_and_auth_have_anthropics_shape() {
    // 413 over the body limit.
    let small = start(tiny_app("llama", ServerConfig { body_limit: 4096, ..ServerConfig::default() }));
    let big = body(&"word ".repeat(2000), 1);
    assert_anthropic_error(post(&small.at("/v1/messages"), &big).await, 413, "request_too_large", "larger than");
    // 401 without the key; x-api-key works.
    let keyed = start(smol_app(ServerConfig { api_key: Some("sekret".into()), ..ServerConfig::default() }));
    let url = keyed.at("/v1/messages/count_tokens");
    for key in [None, Some("wrong")] {
        let mut req = client().post(&url).json(&body("x", 1));
        if let Some(k) = key {
            req = req.header("x-api-key", k);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status();
        assert_anthropic_error((status, resp.json().await.expect("json")), 401, "authentication_error", "x-api-key");
    }
    let ok = client().post(&url).header("x-api-key", "sekret").json(&body("x", 1)).send().await.expect("request");
    assert_eq!(ok.status(), StatusCode::OK);
    // 429 when the queue is full, with Retry-After.
    let busy = start(smol_app(ServerConfig { max_queue: Some(1), ..ServerConfig::default() }));
    let long = json!({"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true, "stream": true});
    let mut first = client().post(busy.at("/v1/completions")).json(&long).send().await.expect("request");
    assert!(first.chunk().await.expect("read").is_some());
    let resp = client().post(busy.at("/v1/messages")).json(&body("x", 1)).send().await.expect("request");
    assert_eq!(resp.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
    let status = resp.status();
    assert_anthropic_error((status, resp.json().await.expect("json")), 429, "overloaded_error", "capacity");
    drop(first);
    tokio::time::sleep(Duration::from_millis(50)).await;
}
