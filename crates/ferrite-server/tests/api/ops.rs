//! `/v1/models`, `/health`, `/tokenize`, `/detokenize` and `/metrics`.

use ferrite_server::ServerConfig;
use serde_json::{json, Value};

use crate::common::*;

#[tokio::test]
async fn models_lists_and_retrieves_by_any_name() {
    let (status, body) = get(&smol().at("/v1/models")).await;
    assert_eq!(status, 200);
    let body: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(body["object"], "list");
    assert_eq!(body["data"][0]["id"], "smollm2");
    assert_eq!(body["data"][0]["object"], "model");
    assert_eq!(body["data"][0]["max_model_len"], 512);
    for name in ["smollm2", "SmolLM2-135M-Instruct.Q4_1"] {
        let (status, m) = get(&smol().at(&format!("/v1/models/{name}"))).await;
        assert_eq!(status, 200, "{name}: {m}");
        assert_eq!(serde_json::from_str::<Value>(&m).expect("json")["id"], "smollm2");
    }
    let (status, m) = get(&smol().at("/v1/models/gpt-4o")).await;
    assert_eq!(status, 404);
    assert_eq!(serde_json::from_str::<Value>(&m).expect("json")["error"]["code"], "model_not_found");
    // The file stem works as the model of a request too.
    let mut body = chat_body("Hi", 1);
    body["model"] = json!("SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(post(&smol().at("/v1/chat/completions"), &body).await.0, 200);
}

#[tokio::test]
async fn health_is_ok() {
    let (status, body) = get(&smol().at("/health")).await;
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<Value>(&body).expect("json")["status"], "ok");
}

#[tokio::test]
async fn tokenize_and_detokenize_round_trip() {
    let tok = smollm2().tokenizer.as_ref().expect("tokenizer");
    let text = "Hello, world! Ünïcödé ✓";
    let (status, body) = post(&smol().at("/tokenize"), &json!({"prompt": text, "return_token_strs": true})).await;
    assert_eq!(status, 200, "{body}");
    let tokens = ids(&body["tokens"]);
    assert_eq!(tokens, tok.encode(text, true).expect("encode"));
    assert_eq!(body["count"], tokens.len());
    assert_eq!(body["max_model_len"], 512);
    let strs: Vec<String> = tokens.iter().map(|&t| tok.id_to_token(t).expect("piece")).collect();
    assert_eq!(body["token_strs"], json!(strs));
    let (status, back) = post(&smol().at("/detokenize"), &json!({"tokens": tokens})).await;
    assert_eq!(status, 200, "{back}");
    assert_eq!(back["prompt"], text);
    // Messages go through the chat template, without added special tokens.
    let messages = json!([{"role": "user", "content": "Hi"}]);
    let (_, chat) = post(&smol().at("/tokenize"), &json!({"messages": messages})).await;
    let rendered = smollm2()
        .chat_template
        .as_ref()
        .expect("template")
        .render(&ferrite_models::chat_template::ChatRenderRequest::new(messages.as_array().expect("array")))
        .expect("render");
    assert_eq!(ids(&chat["tokens"]), tok.encode(&rendered, false).expect("encode"));
    assert!(chat["token_strs"].is_null());
    // Errors: both or neither input, an id outside the vocabulary.
    assert_error(
        post(&smol().at("/tokenize"), &json!({"prompt": "a", "messages": messages})).await,
        400,
        None,
        "exactly one",
    );
    assert_error(
        post(&smol().at("/detokenize"), &json!({"tokens": [99999999]})).await,
        400,
        Some("tokens"),
        "outside the vocabulary",
    );
    assert_error(post(&smol().at("/detokenize"), &json!({"tokens": "abc"})).await, 400, Some("tokens"), "invalid type");
}

/// The value of the sample line `name` (with its labels) in a Prometheus text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
        .parse()
        .expect("number")
}

#[tokio::test]
async fn metrics_count_requests_latencies_tokens_and_kv() {
    let server = start(tiny_app("llama", ServerConfig::default()));
    let prompt: Vec<u32> = (1..=20).collect();
    let body = json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": true});
    assert_eq!(post(&server.at("/v1/completions"), &body).await.0, 200);
    assert_eq!(post(&server.at("/v1/completions"), &json!({"prompt": prompt, "max_tokens": 0})).await.0, 400);
    assert_eq!(get(&server.at("/no/such/route")).await.0, 404);
    // The engine updates its gauges just after it sends a request's last token.
    let mut text = String::new();
    for _ in 0..100 {
        let (status, t) = get(&server.at("/metrics")).await;
        assert_eq!(status, 200);
        text = t;
        if metric(&text, "ferrite_num_requests_running") == 0.0 && metric(&text, "ferrite_kv_blocks_used") == 0.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(text.contains("# TYPE ferrite_time_to_first_token_seconds histogram"));
    let requests = |endpoint: &str, status: u16| {
        metric(&text, &format!("ferrite_http_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}}"))
    };
    assert_eq!(requests("/v1/completions", 200), 1.0);
    assert_eq!(requests("/v1/completions", 400), 1.0);
    assert_eq!(requests("unmatched", 404), 1.0);
    for h in [
        "ferrite_time_to_first_token_seconds",
        "ferrite_time_per_output_token_seconds",
        "ferrite_e2e_request_latency_seconds",
    ] {
        assert_eq!(metric(&text, &format!("{h}_count")), 1.0, "{h}");
        assert_eq!(metric(&text, &format!("{h}_bucket{{le=\"+Inf\"}}")), 1.0, "{h}");
        assert!(metric(&text, &format!("{h}_sum")) > 0.0, "{h}");
    }
    assert_eq!(metric(&text, "ferrite_prompt_tokens_total"), 20.0);
    assert_eq!(metric(&text, "ferrite_generation_tokens_total"), 10.0);
    assert_eq!(metric(&text, "ferrite_num_requests_running"), 0.0);
    assert_eq!(metric(&text, "ferrite_num_requests_waiting"), 0.0);
    assert_eq!(metric(&text, "ferrite_kv_blocks_used"), 0.0);
    let total = served(&server).await.engine.metrics().kv_blocks_total.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(metric(&text, "ferrite_kv_blocks_free"), total as f64);
    assert!(metric(&text, "ferrite_kv_bytes_per_token") > 0.0);
    assert!(metric(&text, "ferrite_kv_capacity_tokens") > 0.0);
    // The same prompt again hits the prefix cache (its full blocks).
    assert_eq!(post(&server.at("/v1/completions"), &body).await.0, 200);
    let (_, text) = get(&server.at("/metrics")).await;
    assert!(metric(&text, "ferrite_prefix_cache_hit_rate") > 0.0);
    assert!(metric(&text, "ferrite_http_requests_total{endpoint=\"/metrics\",status=\"200\"}") >= 1.0);
}
