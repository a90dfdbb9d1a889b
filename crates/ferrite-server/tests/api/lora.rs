//! LoRA adapters over HTTP: loaded, used, refused while in use, unloaded and reloaded at run
//! time while other requests (base and another adapter) keep running and keep their exact
//! tokens; listed in `/v1/models` with their base as `parent`; chosen by `model` on chat
//! completions, Anthropic messages and Responses; bad adapters are 400s and the server
//! carries on; the endpoints need the API key.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ferrite_server::ServerConfig;
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::common::*;

fn lora_dir(name: &str) -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/lora").join(name)
}

fn lora_reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(lora_dir("reference.json")).expect("reference.json")).expect("json")
}

/// POST a LoRA admin body; the status and the body text.
async fn admin(server: &TestServer, path: &str, body: &Value) -> (StatusCode, String) {
    let resp = client().post(server.at(path)).json(body).send().await.expect("request");
    let status = resp.status();
    (status, resp.text().await.expect("body"))
}

async fn load(server: &TestServer, name: &str, dir: &str) -> (StatusCode, String) {
    let body = json!({"lora_name": name, "lora_path": lora_dir(dir)});
    admin(server, "/v1/load_lora_adapter", &body).await
}

async fn unload(server: &TestServer, name: &str) -> (StatusCode, String) {
    admin(server, "/v1/unload_lora_adapter", &json!({"lora_name": name})).await
}

/// Greedy tokens of prompt `p` of the fixture's reference through `model`.
async fn tokens(server: &TestServer, model: &str, prompt: &[u32], n: usize) -> (StatusCode, Value) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": true,
                      "return_token_ids": true});
    post(&server.at("/v1/completions"), &body).await
}

#[tokio::test]
async fn adapters_load_serve_unload_and_reload_under_load() {
    let server = Arc::new(start(tiny_app("llama", ServerConfig::default())));
    let (base_ref, lora_ref) = (fixture_reference("llama"), lora_reference());
    let prompt = ids(&base_ref["prompts"][1]);
    let want = |adapter: Option<&str>| match adapter {
        None => ids(&base_ref["greedy"][1])[..16].to_vec(),
        Some(a) => ids(&lora_ref["adapters"][a]["greedy"][1]),
    };
    assert_eq!(load(&server, "all", "all").await.0, 200);

    // Load: base and "all" requests run all along and must keep their exact tokens.
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = [("llama", None), ("all", Some("all"))]
        .into_iter()
        .map(|(model, adapter)| {
            let (server, stop, prompt, want) = (server.clone(), stop.clone(), prompt.clone(), want(adapter));
            tokio::spawn(async move {
                let mut runs = 0;
                while !stop.load(Ordering::Relaxed) || runs == 0 {
                    let (status, resp) = tokens(&server, model, &prompt, 16).await;
                    assert_eq!(status, 200, "{model}: {resp}");
                    assert_eq!(ids(&resp["choices"][0]["token_ids"]), want, "{model} under load");
                    assert_eq!(resp["model"], model);
                    runs += 1;
                }
                runs
            })
        })
        .collect();

    for round in 0..2 {
        let (status, text) = load(&server, "qv", "qv").await;
        assert_eq!(status, 200, "round {round}: {text}");
        assert!(text.contains("'qv'"), "{text}");
        let (status, resp) = tokens(&server, "qv", &prompt, 16).await;
        assert_eq!(status, 200, "{resp}");
        assert_eq!(ids(&resp["choices"][0]["token_ids"]), want(Some("qv")), "round {round}");
        assert_eq!(resp["model"], "qv");

        // A request holding the adapter keeps it loaded.
        let held = server.app.pool.acquire(Some("qv")).await.expect("lease on the adapter");
        assert_eq!(held.adapter(), Some("qv"));
        let (status, text) = unload(&server, "qv").await;
        assert_eq!(status, 409, "{text}");
        assert!(text.contains("in use by 1 request"), "{text}");
        drop(held);
        let (status, text) = unload(&server, "qv").await;
        assert_eq!(status, 200, "{text}");
        assert_error(tokens(&server, "qv", &prompt, 4).await, 404, Some("model"), "'qv' does not exist");
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        assert!(w.await.expect("worker") > 0);
    }
}

#[tokio::test]
async fn adapters_are_listed_and_bad_ones_refused() {
    let server = start(tiny_app("llama", ServerConfig::default()));
    assert_eq!(load(&server, "mlp", "mlp-late").await.0, 200);
    let (status, text) = get(&server.at("/v1/models")).await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&text).expect("json");
    let data = models["data"].as_array().expect("data");
    assert_eq!(data.len(), 2, "{models}");
    assert_eq!(data[0]["id"], "llama");
    assert!(data[0]["parent"].is_null());
    assert_eq!(data[1]["id"], "mlp");
    assert_eq!(data[1]["parent"], "llama");
    assert!(data[1]["root"].as_str().is_some_and(|r| r.ends_with("mlp-late")), "{models}");
    let (status, one) = get(&server.at("/v1/models/mlp")).await;
    assert_eq!(status, 200);
    assert!(one.contains("\"parent\":\"llama\""), "{one}");

    let bad = [
        ("wide", "wide", "does not fit the base model"),
        ("dora", "dora", "DoRA"),
        ("gone", "no-such-adapter", "no such adapter directory"),
        ("mlp", "qv", "already served"),
        ("llama", "qv", "already served"),
    ];
    for (name, dir, says) in bad {
        let (status, text) = load(&server, name, dir).await;
        assert_eq!(status, 400, "{name}: {text}");
        assert!(text.contains(says), "{name}: {text}");
    }
    let (status, text) = unload(&server, "never-loaded").await;
    assert_eq!(status, 404, "{text}");
    // The server carries on: the base and the adapter still answer.
    let prompt = ids(&fixture_reference("llama")["prompts"][0]);
    assert_eq!(tokens(&server, "llama", &prompt, 4).await.0, 200);
    let (status, resp) = tokens(&server, "mlp", &prompt, 16).await;
    assert_eq!(status, 200);
    assert_eq!(ids(&resp["choices"][0]["token_ids"]), ids(&lora_reference()["adapters"]["mlp-late"]["greedy"][0]));
}

#[tokio::test]
async fn adapter_endpoints_need_the_api_key() {
    let server = start(tiny_app("llama", ServerConfig { api_key: Some("k3y".into()), ..ServerConfig::default() }));
    let (status, _) = load(&server, "qv", "qv").await;
    assert_eq!(status, 401);
    let resp = client()
        .post(server.at("/v1/load_lora_adapter"))
        .bearer_auth("k3y")
        .json(&json!({"lora_name": "qv", "lora_path": lora_dir("qv")}))
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 200);
    assert_eq!(unload(&server, "qv").await.0, 401);
}

#[tokio::test]
async fn every_chat_surface_picks_the_adapter_by_model() {
    let server = own_smol();
    assert_eq!(load(&server, "smol-lora", "smollm2").await.0, 200);
    let user = "Name three colors.";
    let chat = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": user}], "max_tokens": 12, "temperature": 0});
    let text_of = |v: &Value| v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
    let (status, base) = post(&server.at("/v1/chat/completions"), &chat("smollm2")).await;
    assert_eq!(status, 200, "{base}");
    let (status, adapted) = post(&server.at("/v1/chat/completions"), &chat("smol-lora")).await;
    assert_eq!(status, 200, "{adapted}");
    assert_eq!(adapted["model"], "smol-lora");
    assert_ne!(text_of(&base), text_of(&adapted), "the adapter changes the reply");

    let messages = json!({"model": "smol-lora", "max_tokens": 12, "temperature": 0,
                          "messages": [{"role": "user", "content": user}]});
    let (status, m) = post(&server.at("/v1/messages"), &messages).await;
    assert_eq!(status, 200, "{m}");
    assert_eq!(m["model"], "smol-lora");
    assert_eq!(m["content"][0]["text"].as_str().unwrap_or_default(), text_of(&adapted));

    let responses = json!({"model": "smol-lora", "input": user, "max_output_tokens": 12, "temperature": 0});
    let (status, r) = post(&server.at("/v1/responses"), &responses).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["model"], "smol-lora");
    let out = r["output"].as_array().expect("output");
    let said = out.iter().find(|o| o["type"] == "message").expect("a message")["content"][0]["text"].clone();
    assert_eq!(said.as_str().unwrap_or_default(), text_of(&adapted));
}
