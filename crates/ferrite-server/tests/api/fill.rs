//! Fill and speculation over HTTP: a tiny-llama server that speculates with the model as its
//! own draft reproduces the greedy reference and reports `usage.speculation`; the per-request
//! `fill` field is honoured on every surface and a bad value is a 400 naming it; forced tool
//! calls under `fill: strict` (the grammar of the call asserts its fixed tokens) give plain
//! decoding's tokens in fewer forward passes.

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

/// The engine's forward passes so far, from `/metrics`.
async fn forward_passes(server: &TestServer) -> u64 {
    let (_, text) = get(&server.at("/metrics")).await;
    let line = text.lines().find(|l| l.starts_with("ferrite_forward_passes_total ")).expect("forward passes metric");
    line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("a count")
}

#[tokio::test]
async fn tool_calls_with_fill_strict_equal_plain_in_fewer_passes() {
    // The server's own engine, one request at a time, so that the pass counts are each request's.
    let server = own_smol();
    let forecast = json!({"type": "function", "function": {"name": "get_forecast", "parameters": {
        "type": "object", "required": ["city", "days"],
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}});
    for choice in [json!("required"), json!({"type": "function", "function": {"name": "get_forecast"}})] {
        let body = |fill: &str| {
            json!({"messages": [{"role": "user", "content": "Forecast for Paris, 3 days?"}],
                   "tools": [crate::tools::weather_tool(), forecast], "tool_choice": choice, "max_tokens": 48,
                   "temperature": 0, "return_token_ids": true, "fill": fill})
        };
        let mut runs = Vec::new();
        for fill in ["off", "strict"] {
            let before = forward_passes(&server).await;
            let (status, resp) = post(&server.at("/v1/chat/completions"), &body(fill)).await;
            assert_eq!(status, 200, "{resp}");
            runs.push((resp, forward_passes(&server).await - before));
        }
        let [(plain, plain_passes), (strict, strict_passes)] = &runs[..] else { unreachable!() };
        let (p, s) = (&plain["choices"][0], &strict["choices"][0]);
        assert_eq!(s["token_ids"], p["token_ids"], "{choice}: fill strict = plain decode");
        assert_eq!(s["message"]["tool_calls"][0]["function"], p["message"]["tool_calls"][0]["function"]);
        assert_eq!(s["finish_reason"], "tool_calls", "{strict}");
        assert!(plain["usage"].get("fill").is_none(), "{plain}");
        let injected = strict["usage"]["fill"]["injected_tokens"].as_u64().expect("usage.fill");
        assert!(injected > 0, "{strict}");
        assert_eq!(strict_passes + injected, *plain_passes, "{choice}: one pass saved per asserted token");
    }
}
