//! Regressions of the hostile probe (issue 26): oversized and wrapping request fields,
//! unknown fields, the sequence count of `--max-queue`, empty conversations, bounded stored
//! metadata and structured-output constraints that must be 400s with short messages.

use ferrite_server::ServerConfig;
use serde_json::json;

use crate::common::*;

#[tokio::test]
async fn wrapping_max_tokens_and_min_tokens_are_400() {
    let url = smol().at("/v1/chat/completions");
    let mut body = chat_body("Hi", 4);
    body["max_tokens"] = json!(u64::MAX);
    assert_error(post(&url, &body).await, 400, None, "maximum context length");
    let mut body = chat_body("Hi", 4);
    body["min_tokens"] = json!(u64::MAX);
    assert_error(post(&url, &body).await, 400, Some("min_tokens"), "min_tokens");
    let completions = json!({"model": "smollm2", "prompt": "Hi", "max_tokens": u64::MAX - 1});
    assert_error(post(&smol().at("/v1/completions"), &completions).await, 400, None, "maximum context length");
}

#[tokio::test]
async fn a_prompt_too_long_for_the_context_is_refused_before_tokenizing() {
    let huge = "hello world, ".repeat(2 << 20);
    let (tokenize_url, chat_url, health_url) =
        (smol().at("/tokenize"), smol().at("/v1/chat/completions"), smol().at("/health"));
    let (tokenize_body, chat_body) = (json!({"prompt": huge}), chat_body(&huge, 4));
    let (tokenize, chat, health) =
        tokio::join!(post(&tokenize_url, &tokenize_body), post(&chat_url, &chat_body), get(&health_url));
    assert_error(tokenize, 400, None, "bytes");
    assert_error(chat, 400, None, "bytes");
    assert_eq!(health.0, 200);
}

#[tokio::test]
async fn unknown_fields_of_any_size_are_skipped() {
    let mut body = chat_body("Say hi", 2);
    body["unknown_extra"] = json!(vec![vec![json!({"k": [1, 2, 3]}); 64]; 2048]);
    let (status, reply) = post(&smol().at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["usage"]["completion_tokens"], json!(2));
    // A wrong type in a known field is still named.
    let mut body = chat_body("Say hi", 2);
    body["temperature"] = json!("hot");
    assert_error(post(&smol().at("/v1/chat/completions"), &body).await, 400, Some("temperature"), "temperature");
}

#[tokio::test]
async fn max_queue_counts_sequences_and_refuses_what_never_fits() {
    let server = start(smol_app(ServerConfig { max_queue: Some(2), ..ServerConfig::default() }));
    let three = json!({"model": "smollm2", "prompt": ["a", "b", "c"], "max_tokens": 1});
    assert_error(post(&server.at("/v1/completions"), &three).await, 400, Some("n"), "--max-queue");
    let mut n3 = chat_body("Hi", 1);
    n3["n"] = json!(3);
    assert_error(post(&server.at("/v1/chat/completions"), &n3).await, 400, Some("n"), "3 sequences");
    let mut n2 = chat_body("Hi", 1);
    n2["n"] = json!(2);
    let (status, reply) = post(&server.at("/v1/chat/completions"), &n2).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(server.app.admission.active(), 0, "permits released");
}

#[tokio::test]
async fn bearer_scheme_is_case_insensitive() {
    let server = start(tiny_app("llama", ServerConfig { api_key: Some("k3y".into()), ..ServerConfig::default() }));
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let resp = client().get(server.at("/v1/models")).header("authorization", format!("{scheme} k3y")).send().await;
        assert_eq!(resp.expect("request").status(), 200, "{scheme}");
    }
    let resp = client().get(server.at("/v1/models")).header("authorization", "BEARER wrong").send().await;
    assert_eq!(resp.expect("request").status(), 401);
}

#[tokio::test]
async fn empty_conversations_are_400() {
    let anthropic = json!({"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": []}]});
    let (status, body) = post(&smol().at("/v1/messages"), &anthropic).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["type"], json!("invalid_request_error"));
    let responses = json!({"model": "smollm2", "input": [], "max_output_tokens": 4});
    assert_error(post(&smol().at("/v1/responses"), &responses).await, 400, Some("input"), "at least one");
}

#[tokio::test]
async fn a_forced_tool_with_string_parameters_is_400() {
    let mut body = chat_body("Call f", 8);
    body["tools"] = json!([{"type": "function", "function": {"name": "f", "parameters": "{\"type\": \"object\"}"}}]);
    body["tool_choice"] = json!({"type": "function", "function": {"name": "f"}});
    let got = post(&smol().at("/v1/chat/completions"), &body).await;
    assert_error(got, 400, Some("tools[0].function.parameters"), "JSON Schema object");
}

#[tokio::test]
async fn stored_metadata_is_bounded() {
    let url = smol().at("/v1/responses");
    let base = json!({"model": "smollm2", "input": "Hi", "max_output_tokens": 1, "temperature": 0});
    let with = |metadata: serde_json::Value| {
        let mut b = base.clone();
        b["metadata"] = metadata;
        b
    };
    let keys: serde_json::Map<String, serde_json::Value> = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    assert_error(post(&url, &with(json!(keys))).await, 400, Some("metadata"), "16 keys");
    assert_error(post(&url, &with(json!({"k".repeat(65): "v"}))).await, 400, Some("metadata"), "64 characters");
    assert_error(post(&url, &with(json!({"k": "v".repeat(513)}))).await, 400, Some("metadata.k"), "512");
    assert_error(post(&url, &with(json!({"k": 3}))).await, 400, Some("metadata.k"), "strings");
    let (status, reply) = post(&url, &with(json!({"k": "v".repeat(512)}))).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["metadata"]["k"].as_str().map(str::len), Some(512));
}

#[tokio::test]
async fn oversized_or_costly_constraints_are_short_400s() {
    let url = smol().at("/v1/chat/completions");
    let choices: Vec<String> = (0..100_000).map(|i| format!("choice {i}")).collect();
    let alternatives: Vec<String> = (0..50_000).map(|i| format!("\"word{i}\"")).collect();
    let cases = [
        ("guided_choice", json!(choices)),
        ("guided_grammar", json!(format!("start: {}", alternatives.join(" | ")))),
        ("guided_regex", json!("(a{1000}){1000}")),
    ];
    for (field, value) in cases {
        let mut body = chat_body("Answer", 8);
        body[field] = value;
        let (status, reply) = post(&url, &body).await;
        assert_eq!(status, 400, "{field}: {reply}");
        let message = reply["error"]["message"].as_str().unwrap_or_default();
        assert!(message.len() < 400, "{field}: a short message, got {} bytes", message.len());
        for leak in ["panicked", "backtrace", "stack", ".rs:"] {
            assert!(!message.contains(leak), "{field}: {message}");
        }
    }
}
