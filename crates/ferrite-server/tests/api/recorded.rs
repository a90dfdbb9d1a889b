//! The requests Claude Code (Anthropic Messages) and Codex (Responses) send, recorded with
//! scripts/record_agent_requests.py under tests/fixtures/agents/ (a default turn, a
//! tool-call turn, a tool-result turn each), replayed against SmolLM2 with their recorded
//! headers. As recorded (only the reply's token budget lowered) each is accepted: answered,
//! or — their prompts being longer than SmolLM2's context — refused with the provider's own
//! context-overflow wording, which the clients act on. With their long texts shortened (the
//! shape kept exactly) each is answered whole and streamed, well formed.

use std::path::{Path, PathBuf};

use ferrite_server::{App, ModelInfo, ServerConfig};
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::common::*;

/// SmolLM2 at its full context (8192), prefix cache on (the turns of a client share theirs).
fn long_smol() -> &'static TestServer {
    static SERVER: std::sync::OnceLock<TestServer> = std::sync::OnceLock::new();
    SERVER.get_or_init(|| {
        let loaded = smollm2();
        let info = ModelInfo::new(loaded, "smollm2".into(), vec![]);
        start(App::new(engine(loaded, Some(8192), true), info, ServerConfig::default()))
    })
}

fn recordings(client: &str) -> Vec<(PathBuf, Value)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/agents").join(client);
    let mut out: Vec<(PathBuf, Value)> = std::fs::read_dir(&dir)
        .expect("fixtures dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            let v = serde_json::from_str(&std::fs::read_to_string(&p).expect("read")).expect("fixture JSON");
            (p, v)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(out.len(), 3, "a default, a tool-call and a tool-result turn in {dir:?}");
    out
}

/// `v` with every string longer than `max` characters cut to `max`.
fn shortened(v: &Value, max: usize) -> Value {
    match v {
        Value::String(s) if s.chars().count() > max => Value::String(s.chars().take(max).collect()),
        Value::Array(a) => Value::Array(a.iter().map(|x| shortened(x, max)).collect()),
        Value::Object(o) => Value::Object(o.iter().map(|(k, x)| (k.clone(), shortened(x, max))).collect()),
        other => other.clone(),
    }
}

/// Send `rec` (its path, headers and `body`); the status and the response text.
async fn replay(rec: &Value, body: &Value) -> (StatusCode, String) {
    let path = rec["path"].as_str().expect("path");
    let mut req = client().post(long_smol().at(path)).json(body);
    for (name, value) in rec["headers"].as_object().expect("headers") {
        req = req.header(name.as_str(), value.as_str().expect("header value"));
    }
    let resp = req.send().await.expect("request");
    let status = resp.status();
    (status, resp.text().await.expect("body"))
}

fn check_message(m: &Value) {
    assert_eq!((m["type"].as_str(), m["role"].as_str()), (Some("message"), Some("assistant")), "{m}");
    assert!(m["content"].is_array(), "{m}");
    assert!(["end_turn", "max_tokens", "tool_use", "stop_sequence"].contains(&m["stop_reason"].as_str().unwrap_or("")));
    assert!(m["usage"]["output_tokens"].as_u64().is_some_and(|n| n > 0), "{m}");
}

fn check_message_stream(events: &[(String, Value)]) {
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"), "{names:?}");
    assert_eq!(names.last(), Some(&"message_stop"), "{names:?}");
    assert_eq!(
        names.iter().filter(|n| **n == "content_block_start").count(),
        names.iter().filter(|n| **n == "content_block_stop").count()
    );
    let delta = &events.iter().find(|(n, _)| n == "message_delta").expect("message_delta").1;
    assert!(delta["delta"]["stop_reason"].is_string(), "{delta}");
}

fn check_response(r: &Value) {
    assert_eq!(r["object"], "response", "{r}");
    assert!(["completed", "incomplete"].contains(&r["status"].as_str().unwrap_or("")), "{r}");
    assert!(r["output"].as_array().is_some_and(|o| !o.is_empty()), "{r}");
    assert!(r["usage"]["output_tokens"].as_u64().is_some_and(|n| n > 0), "{r}");
}

fn check_response_stream(events: &[(String, Value)]) {
    let first = &events.first().expect("events").0;
    assert_eq!(first, "response.created");
    let (last, done) = events.last().expect("events");
    assert!(last == "response.completed" || last == "response.incomplete", "{last}");
    check_response(&done["response"]);
    let seq: Vec<u64> = events.iter().map(|(_, d)| d["sequence_number"].as_u64().expect("sequence_number")).collect();
    assert!(seq.windows(2).all(|w| w[1] == w[0] + 1), "{seq:?}");
}

/// A refusal in the provider's context-overflow wording (`anthropic`: Anthropic's).
fn check_overflow(text: &str, anthropic: bool) {
    let err: Value = serde_json::from_str(text).expect("error JSON");
    let message = err["error"]["message"].as_str().expect("message");
    if anthropic {
        assert!(message.starts_with("prompt is too long: ") && message.ends_with(" maximum"), "{message}");
    } else {
        assert!(message.contains("maximum context length is 8192 tokens"), "{message}");
        assert_eq!(err["error"]["code"], "context_length_exceeded");
    }
}

#[tokio::test]
async fn claude_code_requests_are_answered() {
    for (path, rec) in recordings("claude-code") {
        let mut body = rec["body"].clone();
        assert_eq!(body["stream"], true, "{path:?} streams");
        body["max_tokens"] = json!(16);
        let (status, count) = post(&long_smol().at("/v1/messages/count_tokens"), &body).await;
        assert_eq!(status, 200, "{path:?}: {count}");
        let (status, text) = replay(&rec, &body).await;
        match status.as_u16() {
            200 => check_message_stream(&named_events(&text)),
            400 => check_overflow(&text, true),
            s => panic!("{path:?}: {s} {text}"),
        }
        let mut short = shortened(&body, 120);
        short["temperature"] = json!(0);
        let (status, text) = replay(&rec, &short).await;
        assert_eq!(status, 200, "{path:?}: {text}");
        check_message_stream(&named_events(&text));
        short["stream"] = json!(false);
        let (status, text) = replay(&rec, &short).await;
        assert_eq!(status, 200, "{path:?}: {text}");
        check_message(&serde_json::from_str(&text).expect("message JSON"));
    }
}

#[tokio::test]
async fn codex_requests_are_answered() {
    for (path, rec) in recordings("codex") {
        let mut body = rec["body"].clone();
        assert_eq!(body["stream"], true, "{path:?} streams");
        body["max_output_tokens"] = json!(16);
        let (status, text) = replay(&rec, &body).await;
        match status.as_u16() {
            200 => check_response_stream(&named_events(&text)),
            400 => check_overflow(&text, false),
            s => panic!("{path:?}: {s} {text}"),
        }
        let mut short = shortened(&body, 120);
        short["temperature"] = json!(0);
        let (status, text) = replay(&rec, &short).await;
        assert_eq!(status, 200, "{path:?}: {text}");
        check_response_stream(&named_events(&text));
        short["stream"] = json!(false);
        let (status, text) = replay(&rec, &short).await;
        assert_eq!(status, 200, "{path:?}: {text}");
        check_response(&serde_json::from_str(&text).expect("response JSON"));
    }
}
