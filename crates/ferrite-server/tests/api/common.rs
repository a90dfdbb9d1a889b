//! Test servers and HTTP helpers. Each server runs `ferrite_server::serve` on 127.0.0.1:0 on
//! its own thread and runtime (so it outlives any one test's runtime); the shared ones start
//! once per test binary. SmolLM2 (real tokenizer and chat template) is loaded once and shared
//! by every engine that needs it; the tiny fixtures have neither.

use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use ferrite_engine::{Engine, EngineConfig};
use ferrite_models::{paths, registry, LoadedModel};
use ferrite_server::pool::Lease;
use ferrite_server::{App, ModelInfo, ServerConfig, Shutdown};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::oneshot;

pub struct TestServer {
    pub url: String,
    pub app: Arc<App>,
    stop: Mutex<Option<oneshot::Sender<()>>>,
    ended: Mutex<Option<oneshot::Receiver<Shutdown>>>,
}

impl TestServer {
    pub fn at(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// Signal shutdown and wait (bounded) for `serve` to return.
    pub async fn shutdown(&self) -> Shutdown {
        if let Some(stop) = self.stop.lock().expect("lock").take() {
            let _ = stop.send(());
        }
        let ended = self.ended.lock().expect("lock").take().expect("shut down once");
        tokio::time::timeout(Duration::from_secs(60), ended).await.expect("serve returned").expect("serve result")
    }
}

pub fn smollm2() -> &'static LoadedModel {
    static MODEL: OnceLock<LoadedModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = registry::resolve("smollm2", &paths::models_dir()).expect("smollm2 (run `ferrite pull smollm2`)");
        ferrite_models::load(&path).expect("load smollm2")
    })
}

pub fn fixture(name: &str) -> LoadedModel {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name);
    ferrite_models::load(&dir).expect("load fixture")
}

pub fn fixture_reference(name: &str) -> Value {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name).join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("reference.json")).expect("json")
}

pub fn engine(loaded: &LoadedModel, max_model_len: Option<usize>, prefix_cache: bool) -> Engine {
    let cfg = EngineConfig { max_model_len, max_num_seqs: 8, prefix_cache, ..EngineConfig::default() };
    Engine::start(loaded.model.clone(), loaded.tokenizer.clone(), loaded.eos_token_ids(), &cfg).expect("engine")
}

pub fn smol_app(config: ServerConfig) -> App {
    let loaded = smollm2();
    let info = ModelInfo::new(loaded, "smollm2".into(), vec!["SmolLM2-135M-Instruct.Q4_1".into()]);
    App::new(engine(loaded, Some(512), true), info, config)
}

/// A SmolLM2 server of the calling test's own, prefix cache off: a quantized model's logits
/// depend (slightly) on batch shape, so tests that compare one request's output with
/// another's run them alone, one after the other, each computed cold.
pub fn own_smol() -> TestServer {
    start(own_smol_app())
}

pub fn own_smol_app() -> App {
    let loaded = smollm2();
    let info = ModelInfo::new(loaded, "smollm2".into(), vec![]);
    App::new(engine(loaded, Some(512), false), info, ServerConfig::default())
}

pub fn tiny_app(name: &str, config: ServerConfig) -> App {
    let loaded = fixture(name);
    let info = ModelInfo::new(&loaded, name.into(), vec![]);
    App::new(engine(&loaded, None, true), info, config)
}

/// A lease on `server`'s default model (its engine and `ModelInfo`).
pub async fn served(server: &TestServer) -> Lease {
    server.app.pool.acquire(None).await.expect("the default model")
}

/// Serve `app` on a fresh port.
pub fn start(app: App) -> TestServer {
    let app = Arc::new(app);
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let (ended_tx, ended_rx) = oneshot::channel();
    let served = app.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
            addr_tx.send(listener.local_addr().expect("local addr")).expect("send addr");
            let ended = ferrite_server::serve(listener, served, async {
                let _ = stop_rx.await;
            })
            .await
            .expect("serve");
            let _ = ended_tx.send(ended);
        });
    });
    let addr = addr_rx.recv_timeout(Duration::from_secs(30)).expect("server address");
    TestServer {
        url: format!("http://{addr}"),
        app,
        stop: Mutex::new(Some(stop_tx)),
        ended: Mutex::new(Some(ended_rx)),
    }
}

/// The shared SmolLM2 server (default settings).
pub fn smol() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| start(smol_app(ServerConfig::default())))
}

/// The shared tiny-llama server (no tokenizer, no chat template, context 256).
pub fn tiny() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| start(tiny_app("llama", ServerConfig::default())))
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(120)).build().expect("client")
}

/// POST JSON; the status and the JSON body.
pub async fn post(url: &str, body: &Value) -> (StatusCode, Value) {
    let resp = client().post(url).json(body).send().await.expect("request");
    let status = resp.status();
    let text = resp.text().await.expect("body");
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("non-JSON body ({e}): {text}")))
}

/// POST raw bytes; the status, the headers and the JSON body.
pub async fn post_raw(url: &str, body: Vec<u8>) -> (StatusCode, Value) {
    let resp = client().post(url).header("content-type", "application/json").body(body).send().await.expect("request");
    let status = resp.status();
    let text = resp.text().await.expect("body");
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("non-JSON body ({e}): {text}")))
}

pub async fn get(url: &str) -> (StatusCode, String) {
    let resp = client().get(url).send().await.expect("request");
    let status = resp.status();
    (status, resp.text().await.expect("body"))
}

/// The `data:` payloads of an SSE body, in order (`[DONE]` included as a string).
pub fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:"))))
        .map(|d| d.trim().to_string())
        .collect()
}

/// POST a streaming request; asserts 200 + `text/event-stream` and a final `[DONE]`; returns
/// the JSON events before it.
pub async fn post_stream(url: &str, body: &Value) -> Vec<Value> {
    let resp = client().post(url).json(body).send().await.expect("request");
    assert_eq!(resp.status(), StatusCode::OK);
    let ctype = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    assert!(ctype.starts_with("text/event-stream"), "content-type {ctype}");
    let data = sse_data(&resp.text().await.expect("body"));
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "stream ends with [DONE]: {data:?}");
    assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1);
    data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).expect("event JSON")).collect()
}

/// Assert an OpenAI-style error body with `status`, whose message contains `needle`.
pub fn assert_error(got: (StatusCode, Value), status: u16, param: Option<&str>, needle: &str) -> Value {
    let (s, body) = got;
    assert_eq!(s.as_u16(), status, "status; body {body}");
    let err = &body["error"];
    let message = err["message"].as_str().unwrap_or_else(|| panic!("error.message in {body}"));
    assert!(message.contains(needle), "message {message:?} should contain {needle:?}");
    assert!(err["type"].is_string(), "error.type in {body}");
    assert!(err.get("code").is_some(), "error.code in {body}");
    assert_eq!(err["param"].as_str(), param, "error.param in {body}");
    body
}

/// A short greedy chat request.
pub fn chat_body(user: &str, max_tokens: usize) -> Value {
    json!({"model": "smollm2", "messages": [{"role": "user", "content": user}], "max_tokens": max_tokens, "temperature": 0})
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// POST a streaming request to an API with named events (Anthropic, Responses); asserts 200
/// and `text/event-stream`; returns (event name, JSON data) pairs.
pub async fn post_events(url: &str, body: &Value) -> Vec<(String, Value)> {
    let resp = client().post(url).json(body).send().await.expect("request");
    assert_eq!(resp.status(), StatusCode::OK);
    let ctype = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    assert!(ctype.starts_with("text/event-stream"), "content-type {ctype}");
    named_events(&resp.text().await.expect("body"))
}

/// The (event name, JSON data) pairs of an SSE body with named events.
pub fn named_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty() && !e.starts_with(':'))
        .map(|event| {
            let field = |name: &str| {
                event.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_string()).unwrap_or_default()
            };
            let data = field("data:");
            (field("event:"), serde_json::from_str(&data).unwrap_or_else(|e| panic!("event data {data:?}: {e}")))
        })
        .collect()
}
