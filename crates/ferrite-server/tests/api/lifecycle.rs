//! Admission (`--max-queue` → 429 + Retry-After), a client disconnect aborting its request
//! and freeing its KV, and shutdown: drain in-flight streams, or drop them after the timeout.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrite_server::{ServerConfig, Shutdown};
use reqwest::StatusCode;
use serde_json::json;

use crate::common::*;

fn long_stream(max_tokens: usize) -> serde_json::Value {
    json!({"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": true, "temperature": 0, "stream": true})
}

/// Wait until `done()` holds, for at most `secs`.
async fn eventually(secs: u64, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_full_queue_is_429_and_a_disconnect_aborts() {
    let server = start(smol_app(ServerConfig { max_queue: Some(1), ..ServerConfig::default() }));
    let url = server.at("/v1/completions");
    let mut first = client().post(&url).json(&long_stream(400)).send().await.expect("request");
    assert_eq!(first.status(), StatusCode::OK);
    assert!(first.chunk().await.expect("read").is_some(), "first event");
    // The queue holds one request: the next is turned away.
    let busy = client().post(&url).json(&json!({"prompt": "Hi", "max_tokens": 1})).send().await.expect("request");
    assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(busy.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
    let err: serde_json::Value = busy.json().await.expect("json");
    assert_eq!(err["error"]["type"], "rate_limit_error");
    assert_eq!(err["error"]["code"], "queue_full");
    // The client goes away mid-stream: the engine aborts the request and frees its blocks.
    drop(first);
    let m = served(&server).await.engine.metrics().clone();
    eventually(20, "the aborted request to leave the engine", || {
        m.running.load(Relaxed) == 0
            && m.waiting.load(Relaxed) == 0
            && m.kv_blocks_free.load(Relaxed) == m.kv_blocks_total.load(Relaxed)
    })
    .await;
    let generated = m.generated_tokens.load(Relaxed);
    assert!(generated < 400, "aborted after {generated} tokens, not run to the end");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(m.generated_tokens.load(Relaxed), generated, "nothing generates after the abort");
    eventually(10, "the permit to be released", || server.app.admission.active() == 0).await;
    let (status, body) = post(&url, &json!({"prompt": "Hi", "max_tokens": 1})).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn shutdown_drains_in_flight_streams() {
    let server = Arc::new(start(smol_app(ServerConfig::default())));
    let mut resp = client().post(server.at("/v1/completions")).json(&long_stream(48)).send().await.expect("request");
    assert_eq!(resp.status(), StatusCode::OK);
    let mut text = String::from_utf8(resp.chunk().await.expect("read").expect("first event").to_vec()).expect("utf8");
    let stopping = server.clone();
    let shutdown = tokio::spawn(async move { stopping.shutdown().await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    // No new connections while draining...
    assert!(reqwest::Client::new().get(server.at("/health")).send().await.is_err(), "accepting while draining");
    // ...but the stream in flight runs to its end.
    text.push_str(&resp.text().await.expect("rest of the stream"));
    let data = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let last: serde_json::Value = serde_json::from_str(&data[data.len() - 2]).expect("json");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(shutdown.await.expect("join"), Shutdown::Drained);
}

#[tokio::test]
async fn shutdown_gives_up_after_its_timeout() {
    let config = ServerConfig { shutdown_timeout: Duration::from_millis(300), ..ServerConfig::default() };
    let server = start(smol_app(config));
    let mut resp = client().post(server.at("/v1/completions")).json(&long_stream(400)).send().await.expect("request");
    assert!(resp.chunk().await.expect("read").is_some());
    let t0 = Instant::now();
    assert_eq!(server.shutdown().await, Shutdown::TimedOut);
    assert!(t0.elapsed() < Duration::from_secs(10));
    // The dropped stream ends without [DONE], and the engine lets the request go.
    let rest = resp.text().await.unwrap_or_default();
    assert!(!rest.contains("[DONE]"));
    let m = served(&server).await.engine.metrics().clone();
    eventually(20, "the dropped request to leave the engine", || m.running.load(Relaxed) == 0).await;
    assert!(m.generated_tokens.load(Relaxed) < 400);
}

#[tokio::test]
async fn a_client_that_gives_up_on_a_whole_response_aborts_it() {
    let server = start(smol_app(ServerConfig::default()));
    let mut body = long_stream(400);
    body["stream"] = json!(false);
    let impatient = reqwest::Client::builder().timeout(Duration::from_millis(700)).build().expect("client");
    let m = served(&server).await.engine.metrics().clone();
    let gave_up = impatient.post(server.at("/v1/completions")).json(&body).send().await;
    assert!(gave_up.is_err_and(|e| e.is_timeout()), "the request should time out on the client");
    eventually(20, "the abandoned request to leave the engine", || {
        m.running.load(Relaxed) == 0 && m.kv_blocks_free.load(Relaxed) == m.kv_blocks_total.load(Relaxed)
    })
    .await;
    assert!(m.generated_tokens.load(Relaxed) < 400, "aborted, not run to the end");
}
