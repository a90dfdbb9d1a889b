//! The KV precision extensions over HTTP (`kv_cache_dtype`, `quantized_kv_start`): a request
//! that sets its own start on an int8 server gets what a server started with that start
//! gives, and prefix-cache hits only from requests of its start and precision; the chat, messages and responses surfaces take both fields; an unknown type, a type
//! or a start the pools cannot serve, and a start past the full-precision pools are each a
//! 400 naming the field and what the server serves.

use ferrite_engine::{Engine, EngineConfig};
use ferrite_models::LoadedModel;
use ferrite_runtime::{KvDtype, KvScheme};
use ferrite_server::{App, ModelInfo, ServerConfig};
use serde_json::{json, Value};

use crate::common::*;

/// A server of `loaded` (named `name`) with int8 KV in groups of `group` turning at `start`.
fn int8_server(loaded: &LoadedModel, name: &str, group: usize, turn_at: usize) -> TestServer {
    let cfg = EngineConfig {
        max_model_len: Some(256),
        max_num_seqs: 8,
        kv_scheme: KvScheme { dtype: KvDtype::Int8 { group }, ..KvScheme::default() },
        quantized_kv_start: turn_at,
        ..EngineConfig::default()
    };
    let engine =
        Engine::start(loaded.model.clone(), loaded.tokenizer.clone(), loaded.eos_token_ids(), &cfg).expect("engine");
    start(App::new(engine, ModelInfo::new(loaded, name.into(), vec![]), ServerConfig::default()))
}

/// `body` with `fields` set.
fn with(mut body: Value, fields: Value) -> Value {
    for (k, v) in fields.as_object().expect("fields") {
        body[k] = v.clone();
    }
    body
}

#[tokio::test]
async fn a_request_with_its_own_start_gets_what_a_server_with_that_start_gives() {
    let loaded = fixture("llama");
    let prompt = ids(&fixture_reference("llama")["prompts"][1]);
    let body = json!({"model": "llama", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": true,
                      "return_token_ids": true});
    let server = int8_server(&loaded, "llama", 16, 9);
    let (status, own) =
        post(&server.at("/v1/completions"), &with(body.clone(), json!({"quantized_kv_start": 22}))).await;
    assert_eq!(status, 200, "{own}");
    let other = int8_server(&loaded, "llama", 16, 22);
    let (status, flag) = post(&other.at("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{flag}");
    let tokens = ids(&own["choices"][0]["token_ids"]);
    assert_eq!(tokens.len(), 16);
    assert_eq!(tokens, ids(&flag["choices"][0]["token_ids"]));
    // Full precision on the int8 server is what an f16 server gives.
    let (status, full) =
        post(&server.at("/v1/completions"), &with(body.clone(), json!({"kv_cache_dtype": "f16"}))).await;
    assert_eq!(status, 200, "{full}");
    let (status, f16) = post(&tiny().at("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{f16}");
    assert_eq!(ids(&full["choices"][0]["token_ids"]), ids(&f16["choices"][0]["token_ids"]));
}

#[tokio::test]
async fn a_prefix_is_served_only_to_the_start_that_made_it() {
    let loaded = fixture("llama");
    let server = int8_server(&loaded, "llama", 16, 9);
    let prompt: Vec<u32> = (1..=40).collect();
    let cached = |fields: Value| {
        let body = with(json!({"model": "llama", "prompt": prompt, "max_tokens": 2, "temperature": 0}), fields);
        let url = server.at("/v1/completions");
        async move {
            let (status, resp) = post(&url, &body).await;
            assert_eq!(status, 200, "{resp}");
            resp["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached tokens")
        }
    };
    // Turned at 22: its f16 block (positions 0..16) and its int8 chain of start 22.
    assert_eq!(cached(json!({"quantized_kv_start": 22})).await, 0);
    assert_eq!(cached(json!({"quantized_kv_start": 22})).await, 32);
    // The server's start (9) takes neither: no f16 block lies before 9, no chain turned there.
    assert_eq!(cached(json!({})).await, 0);
    assert_eq!(cached(json!({})).await, 32);
    // Full precision takes the f16 block.
    assert_eq!(cached(json!({"kv_cache_dtype": "f16"})).await, 16);
    let (_, text) = get(&server.at("/metrics")).await;
    let turned = text.lines().find_map(|l| l.strip_prefix("ferrite_kv_transitions_total "));
    assert_eq!(turned, Some("2"), "the first request of each start turned; the second took its chain");
}

/// A 400 naming `param` (Anthropic's error body names none) whose message holds `needle`.
fn refused(got: (reqwest::StatusCode, Value), path: &str, param: &str, needle: &str) {
    if path == "/v1/messages" {
        let (status, body) = got;
        assert_eq!(status, 400, "{body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{message:?} should contain {needle:?}");
    } else {
        assert_error(got, 400, Some(param), needle);
    }
}

#[tokio::test]
async fn every_surface_takes_the_fields_and_refuses_what_the_pools_cannot_serve() {
    // f16 pools for 8 rows × 16 positions.
    let server = int8_server(smollm2(), "smollm2", 64, 16);
    let chat = json!({"model": "smollm2", "max_tokens": 4, "temperature": 0,
                      "messages": [{"role": "user", "content": "Hi"}]});
    let responses = json!({"model": "smollm2", "max_output_tokens": 4, "input": "Hi"});
    let surfaces = [("/v1/chat/completions", &chat), ("/v1/messages", &chat), ("/v1/responses", &responses)];
    for (path, body) in surfaces {
        let at = server.at(path);
        for fields in [
            json!({"quantized_kv_start": 3}),
            json!({"kv_cache_dtype": "int8", "quantized_kv_start": 0}),
            json!({"kv_cache_dtype": "bf16"}),
        ] {
            let (status, resp) = post(&at, &with(body.clone(), fields.clone())).await;
            assert_eq!(status, 200, "{path} {fields}: {resp}");
        }
        let ask = |fields: Value| with(body.clone(), fields);
        let unknown = post(&at, &ask(json!({"kv_cache_dtype": "int9"}))).await;
        refused(unknown, path, "kv_cache_dtype", "unknown kv_cache_dtype 'int9'");
        let other = post(&at, &ask(json!({"kv_cache_dtype": "int4"}))).await;
        refused(other, path, "kv_cache_dtype", "a request may ask kv_cache_dtype 'int8'");
        let fp8 = post(&at, &ask(json!({"kv_cache_dtype": "fp8"}))).await;
        refused(fp8, path, "kv_cache_dtype", "'fp8' is not served");
        let both = post(&at, &ask(json!({"kv_cache_dtype": "f16", "quantized_kv_start": 4}))).await;
        refused(both, path, "quantized_kv_start", "not full precision");
        // 200 positions before the start do not fit the f16 pools.
        let long = json!({"quantized_kv_start": 200, "max_tokens": 200, "max_output_tokens": 200});
        let (status, resp) = post(&at, &ask(long)).await;
        assert_eq!(status, 400, "{resp}");
        let message = resp["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("needs 200 KV positions but the cache holds 128"), "{resp}");
    }
    // An f16 server serves full precision only.
    let at = smol().at("/v1/chat/completions");
    let start = post(&at, &with(chat.clone(), json!({"quantized_kv_start": 0}))).await;
    assert_error(start, 400, Some("quantized_kv_start"), "needs a quantized KV cache");
    let int8 = post(&at, &with(chat, json!({"kv_cache_dtype": "int8"}))).await;
    assert_error(int8, 400, Some("kv_cache_dtype"), "kv_cache_dtype 'f16'");
}
