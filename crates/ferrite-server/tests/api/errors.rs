//! Every error class: status and OpenAI-style body (`error.message/type/param/code`).

use ferrite_server::ServerConfig;
use reqwest::StatusCode;
use serde_json::json;

use crate::common::*;

#[tokio::test]
async fn malformed_bodies_are_400() {
    let url = tiny().at("/v1/completions");
    assert_error(post_raw(&url, b"{\"prompt\": [1, 2".to_vec()).await, 400, None, "not valid JSON");
    assert_error(post_raw(&url, b"{\"prompt\": \"\xff\xfe\"}".to_vec()).await, 400, None, "not valid UTF-8");
    assert_error(post_raw(&url, b"[1, 2, 3]".to_vec()).await, 400, None, "must be a JSON object");
    assert_error(post_raw(&url, b"{}".to_vec()).await, 400, None, "missing field `prompt`");
    // JSON has no NaN: a body that writes one is not JSON.
    let nan = b"{\"prompt\": [1], \"temperature\": NaN}".to_vec();
    assert_error(post_raw(&url, nan).await, 400, None, "not valid JSON");
    let chat = tiny().at("/v1/chat/completions");
    assert_error(post_raw(&chat, b"{\"model\": \"llama\"}".to_vec()).await, 400, None, "missing field `messages`");
}

#[tokio::test]
async fn wrong_types_name_the_field_and_unknown_fields_are_ignored() {
    let url = tiny().at("/v1/completions");
    let ok = json!({"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, "user": "me", "some_new_field": {"x": 1}});
    assert_eq!(post(&url, &ok).await.0, 200);
    let cases = [
        (json!({"prompt": [1, 2], "temperature": "hot"}), "temperature"),
        (json!({"prompt": [1, 2], "max_tokens": -3}), "max_tokens"),
        (json!({"prompt": [1, 2], "n": 1.5}), "n"),
        (json!({"prompt": [1, 2], "stream": "yes"}), "stream"),
        (json!({"prompt": [1, 2], "logit_bias": {"5": "up"}}), "logit_bias.5"),
        (json!({"prompt": [1, 2], "stop": 7}), "stop"),
    ];
    for (body, param) in cases {
        assert_error(post(&url, &body).await, 400, Some(param), "invalid");
    }
    assert_error(post(&url, &json!({"prompt": {"a": 1}})).await, 400, Some("prompt"), "'prompt' must be");
    assert_error(post(&url, &json!({"prompt": [1, "a"]})).await, 400, Some("prompt"), "'prompt' must be");
    let chat = smol().at("/v1/chat/completions");
    let bad_messages = [
        (json!("hi"), "messages", "must be an array"),
        (json!([]), "messages", "at least one"),
        (json!([{"role": "wizard", "content": "x"}]), "messages[0].role", "must be one of"),
        (json!([{"role": "user", "content": 5}]), "messages[0].content", "must be a string"),
        (json!([{"role": "user"}]), "messages[0].content", "is required"),
        (
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages[0].content[0].type",
            "only text",
        ),
        (
            json!([{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": 3}}]}]),
            "messages[0].tool_calls[0].function.name",
            "must be a string",
        ),
    ];
    for (messages, param, needle) in bad_messages {
        assert_error(post(&chat, &json!({"messages": messages, "max_tokens": 1})).await, 400, Some(param), needle);
    }
}

#[tokio::test]
async fn unknown_model_is_404() {
    let body = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]});
    let err = assert_error(post(&smol().at("/v1/chat/completions"), &body).await, 404, Some("model"), "gpt-4o");
    assert_eq!(err["error"]["code"], "model_not_found");
    let body = json!({"model": "gpt-4o", "prompt": [1, 2]});
    assert_error(post(&tiny().at("/v1/completions"), &body).await, 404, Some("model"), "does not exist");
}

#[tokio::test]
async fn prompts_over_the_context_say_the_counts() {
    let url = tiny().at("/v1/completions");
    let long: Vec<u32> = (0..300).map(|i| i % 300).collect();
    let err = assert_error(post(&url, &json!({"prompt": long})).await, 400, None, "300");
    assert!(err["error"]["message"].as_str().is_some_and(|m| m.contains("256")), "{err}");
    assert_eq!(err["error"]["code"], "context_length_exceeded");
    let err = assert_error(post(&url, &json!({"prompt": [1, 2, 3], "max_tokens": 1000})).await, 400, None, "1000");
    assert!(err["error"]["message"].as_str().is_some_and(|m| m.contains("256")), "{err}");
    // Chat too (SmolLM2 serves 512 here).
    let body = json!({"messages": [{"role": "user", "content": "word ".repeat(600)}]});
    let err = assert_error(post(&smol().at("/v1/chat/completions"), &body).await, 400, None, "512");
    assert_eq!(err["error"]["code"], "context_length_exceeded");
}

#[tokio::test]
async fn invalid_values_are_400_with_the_engine_message() {
    let url = tiny().at("/v1/completions");
    let cases = [
        (json!({"prompt": [1], "max_tokens": 0}), Some("max_tokens"), "at least 1"),
        (json!({"prompt": [1], "n": 0}), Some("n"), "n must be"),
        (json!({"prompt": [1], "temperature": -1}), Some("temperature"), "temperature"),
        (json!({"prompt": [1], "temperature": -1e-38}), Some("temperature"), "temperature"),
        (json!({"prompt": [1], "temperature": 1e39}), Some("temperature"), "temperature"),
        (json!({"prompt": [1], "top_p": 0}), Some("top_p"), "top_p"),
        (json!({"prompt": [1], "presence_penalty": 3}), Some("presence_penalty"), "presence_penalty"),
        (json!({"prompt": [1], "logit_bias": {"abc": 1}}), Some("logit_bias"), "token ids"),
        (json!({"prompt": [1], "logit_bias": {"100000": 1}}), Some("logit_bias"), "outside the vocabulary"),
        (json!({"prompt": [1], "logprobs": 21}), Some("logprobs"), "at most 20"),
        (json!({"prompt": [100000]}), Some("prompt"), "outside the vocabulary"),
        (json!({"prompt": [1], "suffix": "end"}), Some("suffix"), "suffix is not supported"),
        (json!({"prompt": [1], "echo": true, "logprobs": 1}), Some("logprobs"), "echo"),
        (json!({"prompt": [1], "best_of": 3}), Some("best_of"), "best_of"),
        (json!({"prompt": [1], "stop": ["x"]}), Some("stop"), "tokenizer"),
        (json!({"prompt": "text"}), None, "no tokenizer"),
    ];
    for (body, param, needle) in cases {
        assert_error(post(&url, &body).await, 400, param, needle);
    }
    let chat = smol().at("/v1/chat/completions");
    let m = json!([{"role": "user", "content": "x"}]);
    let cases = [
        (json!({"messages": m, "top_logprobs": 2}), "top_logprobs", "needs logprobs"),
        (json!({"messages": m, "logprobs": true, "top_logprobs": 21}), "top_logprobs", "at most 20"),
        (json!({"messages": m, "tool_choice": "required"}), "tool_choice", "needs at least one tool"),
        (
            json!({"messages": m, "tool_choice": {"type": "function", "function": {"name": "f"}}}),
            "tool_choice",
            "not among the tools",
        ),
        (json!({"messages": m, "tool_choice": {"type": "function"}}), "tool_choice.function.name", "must be a string"),
        (json!({"messages": m, "tool_choice": 3}), "tool_choice", "must be 'none'"),
        (json!({"messages": m, "tools": [{"type": "code_interpreter"}]}), "tools[0].type", "function"),
    ];
    for (body, param, needle) in cases {
        assert_error(post(&chat, &body).await, 400, Some(param), needle);
    }
}

#[tokio::test]
async fn chat_without_a_template_is_400() {
    let body = json!({"messages": [{"role": "user", "content": "x"}]});
    assert_error(post(&tiny().at("/v1/chat/completions"), &body).await, 400, None, "no chat template");
}

#[tokio::test]
async fn unknown_routes_and_methods() {
    let (status, body) = get(&tiny().at("/v1/nothing")).await;
    assert_eq!(status, 404);
    assert!(body.contains("no route for GET /v1/nothing"), "{body}");
    let (status, body) = get(&tiny().at("/v1/completions")).await;
    assert_eq!(status, 405);
    assert!(body.contains("\"error\""), "{body}");
}

#[tokio::test]
async fn bodies_over_the_limit_are_413() {
    let server = start(tiny_app("llama", ServerConfig { body_limit: 4096, ..ServerConfig::default() }));
    let big = json!({"prompt": vec![1; 3000], "max_tokens": 1});
    assert_error(post(&server.at("/v1/completions"), &big).await, 413, None, "larger than the server's limit");
    assert_eq!(post(&server.at("/v1/completions"), &json!({"prompt": [1, 2], "max_tokens": 1})).await.0, 200);
    assert_eq!(ServerConfig::default().body_limit, 32 << 20);
}

#[tokio::test]
async fn api_key_is_enforced() {
    let server = start(tiny_app("llama", ServerConfig { api_key: Some("sekret".into()), ..ServerConfig::default() }));
    let url = server.at("/v1/completions");
    let body = json!({"prompt": [1, 2], "max_tokens": 1});
    let send = |auth: Option<(&'static str, &'static str)>| {
        let mut req = client().post(&url).json(&body);
        if let Some((k, v)) = auth {
            req = req.header(k, v);
        }
        req.send()
    };
    for auth in
        [None, Some(("authorization", "Bearer wrong")), Some(("authorization", "sekret")), Some(("x-api-key", "nope"))]
    {
        let resp = send(auth).await.expect("request");
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{auth:?}");
        let err: serde_json::Value = resp.json().await.expect("json");
        assert_eq!(err["error"]["type"], "authentication_error");
        assert_eq!(err["error"]["code"], "invalid_api_key");
    }
    for auth in [Some(("authorization", "Bearer sekret")), Some(("x-api-key", "sekret"))] {
        assert_eq!(send(auth).await.expect("request").status(), StatusCode::OK, "{auth:?}");
    }
    let models = client().get(server.at("/v1/models")).send().await.expect("request");
    assert_eq!(models.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(get(&server.at("/health")).await.0, 200);
    assert_eq!(get(&server.at("/metrics")).await.0, 200);
}
