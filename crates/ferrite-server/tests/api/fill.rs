//! Fill and speculation over HTTP: a tiny-llama server that speculates with the model as its
//! own draft reproduces the greedy reference and reports `usage.speculation`; the per-request
//! `fill` field is honoured on every surface and a bad value is a 400 naming it.

use ferrite_engine::{Engine, EngineConfig, Speculation};
use ferrite_server::{App, ModelInfo, ServerConfig};
use serde_json::json;

use crate::common::*;

#[tokio::test]
async fn speculating_server_reports_usage_and_takes_fill() {
    let loaded = fixture("llama");
    let cfg = EngineConfig {
        speculation: Speculation::Draft(loaded.model.clone()),
        num_draft_tokens: 3,
        ..EngineConfig::default()
    };
    let engine = Engine::start(loaded.model.clone(), None, loaded.eos_token_ids(), &cfg).expect("engine");
    let server = start(App::new(engine, ModelInfo::new(&loaded, "llama".into(), vec![]), ServerConfig::default()));
    let r = fixture_reference("llama");
    let (prompt, want) = (ids(&r["prompts"][1]), ids(&r["greedy"][1])[..16].to_vec());
    let body = json!({"model": "llama", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": true,
                      "return_token_ids": true, "fill": "echo"});
    let (status, resp) = post(&server.at("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(ids(&resp["choices"][0]["token_ids"]), want);
    let spec = &resp["usage"]["speculation"];
    assert!(spec["rounds"].as_u64().is_some_and(|r| r > 0), "{resp}");
    assert_eq!(spec["drafted"], spec["accepted"], "the model as its own draft is always right greedily");
    assert_eq!(spec["acceptance_rate"], 1.0);
    let bad = json!({"model": "llama", "prompt": prompt, "max_tokens": 4, "fill": "always"});
    let (status, resp) = post(&server.at("/v1/completions"), &bad).await;
    assert_eq!(status, 400, "{resp}");
    assert_eq!(resp["error"]["param"], "fill", "{resp}");
}

#[tokio::test]
async fn fill_field_on_chat_messages_and_responses() {
    let s = smol();
    let chat = json!({"model": "smollm2", "max_tokens": 4, "temperature": 0,
                      "messages": [{"role": "user", "content": "Hi"}], "fill": "strict"});
    let (status, resp) = post(&s.at("/v1/chat/completions"), &chat).await;
    assert_eq!(status, 200, "{resp}");
    let msgs =
        json!({"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "fill": "echo"});
    let (status, resp) = post(&s.at("/v1/messages"), &msgs).await;
    assert_eq!(status, 200, "{resp}");
    let bad =
        json!({"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "fill": "x"});
    let (status, resp) = post(&s.at("/v1/messages"), &bad).await;
    assert_eq!(status, 400, "{resp}");
    let responses = json!({"model": "smollm2", "max_output_tokens": 4, "input": "Hi", "fill": "off"});
    let (status, resp) = post(&s.at("/v1/responses"), &responses).await;
    assert_eq!(status, 200, "{resp}");
}
