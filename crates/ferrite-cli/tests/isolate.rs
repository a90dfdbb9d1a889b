//! `ferrite serve --isolate` with two models, each engine in its own child process: a
//! `kill -9` of one child mid-stream ends that stream with an error event, the other model's
//! stream runs on untouched, the next request is served by the restarted child, and after
//! more crashes than the restart limit allows the model is reported down on `/health` (503
//! for its requests) while the other model still serves.

mod serve_common;

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use serve_common::{client, serve, Server};

fn start() -> Server {
    let args = ["--isolate", "--model", "a=smollm2", "--model", "b=smollm2", "--threads", "1"].into_iter().chain([
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "67108864",
    ]);
    serve(&args.map(String::from).collect::<Vec<_>>())
}

async fn model(server: &Server, name: &str) -> Value {
    let body: Value = client()
        .get(format!("{}/v1/models/{name}", server.url))
        .send()
        .await
        .expect("request")
        .json()
        .await
        .expect("json");
    body
}

async fn pid(server: &Server, name: &str) -> u32 {
    let m = model(server, name).await;
    m["pid"].as_u64().unwrap_or_else(|| panic!("a pid for {name}: {m}")) as u32
}

fn kill9(pid: u32) {
    let status = Command::new("kill").args(["-9", &pid.to_string()]).status().expect("kill");
    assert!(status.success(), "kill -9 {pid}");
}

/// Wait until `name` runs in a process other than `old`; its new pid.
async fn restarted(server: &Server, name: &str, old: u32) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let m = model(server, name).await;
        if let (Some("loaded"), Some(p)) = (m["status"].as_str(), m["pid"].as_u64()) {
            if p as u32 != old {
                return p as u32;
            }
        }
        assert!(Instant::now() < deadline, "{name} was not restarted: {m}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn complete(server: &Server, name: &str) -> (u16, Value) {
    let body = json!({"model": name, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let resp = client().post(format!("{}/v1/completions", server.url)).json(&body).send().await.expect("request");
    (resp.status().as_u16(), resp.json().await.expect("json"))
}

async fn open_stream(server: &Server, name: &str, max_tokens: usize) -> reqwest::Response {
    let body = json!({"model": name, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let mut resp = client().post(format!("{}/v1/completions", server.url)).json(&body).send().await.expect("stream");
    assert_eq!(resp.status().as_u16(), 200);
    // Hold back until the stream carries generated text.
    let first = resp.chunk().await.expect("chunk").expect("a first event");
    assert!(String::from_utf8_lossy(&first).contains("data:"));
    resp
}

/// The stream's remaining `data:` payloads.
async fn rest(mut resp: reqwest::Response) -> Vec<String> {
    let mut text = String::new();
    while let Some(chunk) = resp.chunk().await.expect("chunk") {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_string).collect()
}

#[test]
fn a_killed_engine_fails_its_stream_restarts_and_leaves_the_other_model_alone() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let server = start();
        assert_eq!(complete(&server, "b").await.0, 200, "b loads on demand in its own process");
        let (pa, pb) = (pid(&server, "a").await, pid(&server, "b").await);
        assert_ne!(pa, pb);

        let a_stream = open_stream(&server, "a", 400).await;
        let b_stream = open_stream(&server, "b", 64).await;
        kill9(pa);
        let a_events = rest(a_stream).await;
        assert_eq!(a_events.last().map(String::as_str), Some("[DONE]"), "{a_events:?}");
        let events: Vec<Value> = a_events.iter().filter_map(|e| serde_json::from_str(e).ok()).collect();
        let message = events
            .iter()
            .find_map(|e| e["error"]["message"].as_str())
            .unwrap_or_else(|| panic!("an error event: {a_events:?}"));
        assert!(message.contains("'a'") && message.contains("signal 9"), "{message}");
        let b_events = rest(b_stream).await;
        assert!(b_events.iter().all(|e| !e.contains("error")), "b is untouched: {b_events:?}");
        assert!(b_events.iter().any(|e| e.contains("\"finish_reason\":\"length\"")), "{b_events:?}");

        // The next request for a waits for the restart and is served.
        let (status, body) = complete(&server, "a").await;
        assert_eq!(status, 200, "{body}");
        let mut pa = restarted(&server, "a", pa).await;
        assert_eq!(pid(&server, "b").await, pb, "b kept its process");

        // Three more crashes within the minute: past the restart limit, a stays down.
        for crash in 2..=4 {
            kill9(pa);
            if crash < 4 {
                pa = restarted(&server, "a", pa).await;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        let health = loop {
            let resp = client().get(format!("{}/health", server.url)).send().await.expect("health");
            let body: Value = resp.json().await.expect("json");
            if body["status"] == "degraded" || Instant::now() > deadline {
                break body;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(health["down"]["a"].is_string(), "a is down on /health: {health}");
        assert!(health["down"].get("b").is_none(), "{health}");
        assert_eq!(model(&server, "a").await["status"], "down");
        let (status, body) = complete(&server, "a").await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(complete(&server, "b").await.0, 200, "b still serves");
    });
}
