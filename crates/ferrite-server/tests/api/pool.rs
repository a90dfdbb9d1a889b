//! The model pool: models load when a request names them, the least recently used idle one
//! is unloaded past `--max-loaded-models` or the memory budget, a busy one is never cut
//! short, a load that cannot fit is refused with 507, and an unknown model is 404 in the
//! OpenAI and the Anthropic shape.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use ferrite_server::pool::{ModelLoader, ModelPool, PoolConfig, PoolModel, Served};
use ferrite_server::{App, ModelInfo, ServerConfig};
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::common::*;

/// A test model: a tiny fixture (or SmolLM2 for `"smollm2"`) with a stated memory estimate,
/// counting its loads.
struct Counted {
    name: &'static str,
    bytes: u64,
    loads: AtomicUsize,
}

impl ModelLoader for Counted {
    fn estimate(&self) -> Result<Option<u64>, String> {
        Ok(Some(self.bytes))
    }

    fn load(&self) -> Result<Served, String> {
        self.loads.fetch_add(1, Relaxed);
        let (engine, info) = if self.name == "smollm2" {
            (engine(smollm2(), Some(512), false), ModelInfo::new(smollm2(), self.name.into(), vec![]))
        } else {
            let loaded = fixture(self.name);
            (engine(&loaded, None, true), ModelInfo::new(&loaded, self.name.into(), vec![]))
        };
        Ok(Served::new(Box::new(engine), info))
    }
}

fn pool_server(models: &[(&'static str, u64)], config: PoolConfig) -> (TestServer, Vec<Arc<Counted>>) {
    let loaders: Vec<Arc<Counted>> =
        models.iter().map(|&(name, bytes)| Arc::new(Counted { name, bytes, loads: AtomicUsize::new(0) })).collect();
    let pool = ModelPool::new(
        loaders
            .iter()
            .map(|l| PoolModel { name: l.name.into(), aliases: vec![format!("{}-alias", l.name)], loader: l.clone() })
            .collect(),
        config,
    );
    (start(App::with_pool(pool, ServerConfig::default())), loaders)
}

/// `/v1/models`: each model's id → status.
async fn states(server: &TestServer) -> Vec<(String, String)> {
    let (status, text) = get(&server.at("/v1/models")).await;
    assert_eq!(status, StatusCode::OK);
    let body: Value = serde_json::from_str(&text).expect("json");
    body["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| (m["id"].as_str().expect("id").to_string(), m["status"].as_str().expect("status").to_string()))
        .collect()
}

fn listed(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
}

async fn complete(server: &TestServer, model: &str) -> (StatusCode, Value) {
    let body = json!({"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0});
    post(&server.at("/v1/completions"), &body).await
}

#[tokio::test]
async fn models_load_on_demand_and_the_least_recently_used_one_is_unloaded() {
    let config = PoolConfig { max_loaded: Some(2), ..PoolConfig::default() };
    let (server, loads) = pool_server(&[("llama", 1), ("qwen2", 1), ("mistral", 1)], config);
    assert_eq!(states(&server).await, listed(&[("llama", "unloaded"), ("qwen2", "unloaded"), ("mistral", "unloaded")]));
    let (status, body) = complete(&server, "llama").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["model"], "llama");
    assert_eq!(complete(&server, "qwen2-alias").await.0, StatusCode::OK, "an alias picks its model");
    assert_eq!(states(&server).await, listed(&[("llama", "loaded"), ("qwen2", "loaded"), ("mistral", "unloaded")]));
    // llama is used again, so qwen2 is the least recently used when mistral needs room.
    assert_eq!(complete(&server, "llama").await.0, StatusCode::OK);
    assert_eq!(complete(&server, "mistral").await.0, StatusCode::OK);
    assert_eq!(states(&server).await, listed(&[("llama", "loaded"), ("qwen2", "unloaded"), ("mistral", "loaded")]));
    let counts: Vec<usize> = loads.iter().map(|l| l.loads.load(Relaxed)).collect();
    assert_eq!(counts, [1, 1, 1], "resident models are not loaded again");
    // Without a model field the first model answers; qwen2 comes back on demand.
    let (status, body) = post(&server.at("/v1/completions"), &json!({"prompt": [1, 2], "max_tokens": 1})).await;
    assert_eq!((status, body["model"].as_str()), (StatusCode::OK, Some("llama")));
    assert_eq!(complete(&server, "qwen2").await.0, StatusCode::OK);
    assert_eq!(loads[1].loads.load(Relaxed), 2);
    assert_eq!(states(&server).await, listed(&[("llama", "loaded"), ("qwen2", "loaded"), ("mistral", "unloaded")]));
}

#[tokio::test]
async fn a_load_waits_for_the_busy_model_it_must_unload_and_does_not_cut_its_stream() {
    let config = PoolConfig { max_loaded: Some(1), ..PoolConfig::default() };
    let (server, _) = pool_server(&[("smollm2", 1), ("llama", 1)], config);
    let long = json!({"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let mut stream = client().post(server.at("/v1/completions")).json(&long).send().await.expect("stream");
    assert_eq!(stream.status(), StatusCode::OK);
    let first = stream.chunk().await.expect("chunk").expect("a first event");
    assert!(String::from_utf8_lossy(&first).contains("data:"));
    // smollm2 is generating: the request for the unloaded llama waits for it to finish.
    let other = tokio::spawn({
        let url = server.at("/v1/completions");
        async move { post(&url, &json!({"model": "llama", "prompt": [1, 2, 3], "max_tokens": 2})).await }
    });
    let mut text = String::from_utf8_lossy(&first).into_owned();
    while let Some(chunk) = stream.chunk().await.expect("chunk") {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let events: Vec<Value> =
        sse_data(&text).iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).expect("event")).collect();
    assert!(text.trim_end().ends_with("data: [DONE]"), "the stream ran to its end: {text}");
    assert!(events.iter().all(|e| e.get("error").is_none()), "no error in the stream: {text}");
    assert_eq!(events.iter().filter_map(|e| e["choices"][0]["finish_reason"].as_str()).collect::<Vec<_>>(), ["length"]);
    let (status, body) = other.await.expect("task");
    assert_eq!((status, body["model"].as_str()), (StatusCode::OK, Some("llama")), "{body}");
    assert_eq!(states(&server).await, listed(&[("smollm2", "unloaded"), ("llama", "loaded")]));
}

#[tokio::test]
async fn a_request_for_an_unloaded_model_is_served_while_another_model_generates() {
    let (server, _) = pool_server(&[("smollm2", 1), ("llama", 1)], PoolConfig::default());
    let long = json!({"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let mut stream = client().post(server.at("/v1/completions")).json(&long).send().await.expect("stream");
    assert!(stream.chunk().await.expect("chunk").is_some());
    let (status, body) = complete(&server, "llama").await;
    assert_eq!((status, body["model"].as_str()), (StatusCode::OK, Some("llama")), "{body}");
    let mut rest = String::new();
    while let Some(chunk) = stream.chunk().await.expect("chunk") {
        rest.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(rest.contains("\"finish_reason\":\"length\"") && rest.trim_end().ends_with("data: [DONE]"), "{rest}");
    assert_eq!(states(&server).await, listed(&[("smollm2", "loaded"), ("llama", "loaded")]));
}

#[tokio::test]
async fn the_memory_budget_unloads_what_it_must_and_refuses_what_cannot_fit() {
    let config = PoolConfig { memory_budget: Some(10_000), ..PoolConfig::default() };
    let (server, loads) = pool_server(&[("llama", 6_000), ("qwen2", 6_000), ("mistral", 20_000)], config);
    assert_eq!(complete(&server, "llama").await.0, StatusCode::OK);
    assert_eq!(complete(&server, "qwen2").await.0, StatusCode::OK);
    assert_eq!(states(&server).await, listed(&[("llama", "unloaded"), ("qwen2", "loaded"), ("mistral", "unloaded")]));
    let refused = assert_error(complete(&server, "mistral").await, 507, Some("model"), "memory budget");
    assert_eq!(refused["error"]["code"], "insufficient_memory");
    assert_eq!(loads[2].loads.load(Relaxed), 0, "a load that cannot fit is never tried");
    assert_eq!(states(&server).await, listed(&[("llama", "unloaded"), ("qwen2", "loaded"), ("mistral", "unloaded")]));
}

#[tokio::test]
async fn an_unknown_model_is_404_in_each_api_shape_and_loads_nothing() {
    let (server, loads) = pool_server(&[("llama", 1), ("qwen2", 1)], PoolConfig::default());
    let body = assert_error(complete(&server, "gpt-4o").await, 404, Some("model"), "'gpt-4o' does not exist");
    assert_eq!(body["error"]["code"], "model_not_found");
    let message = body["error"]["message"].as_str().expect("message");
    assert!(message.contains("'llama'") && message.contains("'qwen2'"), "names what is served: {message}");
    let anthropic = json!({"model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let (status, body) = post(&server.at("/v1/messages"), &anthropic).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        (body["type"].as_str(), body["error"]["type"].as_str()),
        (Some("error"), Some("not_found_error")),
        "{body}"
    );
    let (status, _) = get(&server.at("/v1/models/claude-x")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, text) = get(&server.at("/v1/models/qwen2-alias")).await;
    let model: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(
        (status, model["id"].as_str(), model["status"].as_str()),
        (StatusCode::OK, Some("qwen2"), Some("unloaded"))
    );
    assert!(loads.iter().all(|l| l.loads.load(Relaxed) == 0));
}
