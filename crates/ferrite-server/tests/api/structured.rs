//! Structured output over HTTP: `response_format` (json_schema, json_object) on chat,
//! vLLM's `guided_*` fields on completions and chat, `text.format` on Responses; outputs
//! follow the constraint, streamed or not; constraints that cannot compile are 400s.

use serde_json::{json, Value};

use crate::common::*;

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "format": "email", "maxLength": 30}
        },
        "required": ["name", "age", "email"],
        "additionalProperties": false
    })
}

/// `v` has exactly the person schema's keys with the right types and bounds.
fn assert_person(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let obj = v.as_object().unwrap_or_else(|| panic!("not an object: {text}"));
    assert_eq!(obj.keys().collect::<Vec<_>>(), ["name", "age", "email"], "{text}");
    assert!(v["name"].as_str().is_some_and(|s| s.chars().count() <= 20), "{text}");
    assert!(v["age"].as_u64().is_some_and(|a| a <= 120), "{text}");
    assert!(v["email"].as_str().is_some_and(|s| s.contains('@')), "{text}");
}

fn chat_with(extra: Value) -> Value {
    let mut body = chat_body("Reply in JSON with a person named Ann, aged 31.", 80);
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

#[tokio::test]
async fn chat_response_format_json_schema_strict() {
    let format =
        json!({"type": "json_schema", "json_schema": {"name": "person", "schema": person_schema(), "strict": true}});
    let (status, body) = post(&smol().at("/v1/chat/completions"), &chat_with(json!({"response_format": format}))).await;
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{body}");
    assert_person(choice["message"]["content"].as_str().expect("content"));
    // Streamed, the deltas make the same kind of document.
    let mut streaming = chat_with(json!({"response_format": format, "stream": true}));
    streaming["temperature"] = json!(0.7);
    streaming["seed"] = json!(5);
    let chunks = post_stream(&smol().at("/v1/chat/completions"), &streaming).await;
    let text: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_string)).collect();
    assert_person(&text);
}

#[tokio::test]
async fn chat_response_format_json_object_and_guided_choice() {
    let mut body = chat_body("Repeat this JSON object exactly: {\"animal\": \"cat\", \"legs\": 4}", 80);
    body["response_format"] = json!({"type": "json_object"});
    let (status, body) = post(&smol().at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{body}");
    let content = body["choices"][0]["message"]["content"].as_str().expect("content");
    let v: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content}"));
    assert!(v.is_object(), "{content}");
    let mut body = chat_body("Is water wet? Answer yes or no.", 10);
    body["guided_choice"] = json!(["yes", "no"]);
    body["n"] = json!(3);
    body["temperature"] = json!(1.0);
    let (status, body) = post(&smol().at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{body}");
    for c in body["choices"].as_array().expect("choices") {
        let text = c["message"]["content"].as_str().expect("content");
        assert!(text == "yes" || text == "no", "{text:?}");
    }
}

#[tokio::test]
async fn completions_guided_fields() {
    let url = smol().at("/v1/completions");
    let base = json!({"prompt": "My phone number is", "max_tokens": 30, "temperature": 0});
    let cases = [
        ("guided_regex", json!(" [0-9]{3}-[0-9]{4}")),
        ("guided_grammar", json!("start: \" call me at \" NUM\nNUM: /[0-9]{4}/")),
        ("guided_json", json!("{\"type\": \"integer\", \"minimum\": 1000, \"maximum\": 9999}")),
        ("guided_choice", json!([" secret", " unlisted"])),
    ];
    for (field, value) in cases {
        let mut body = base.clone();
        body[field] = value;
        let (status, out) = post(&url, &body).await;
        assert_eq!(status, 200, "{field}: {out}");
        let text = out["choices"][0]["text"].as_str().expect("text");
        assert_eq!(out["choices"][0]["finish_reason"], "stop", "{field}: {text:?}");
        let ok = match field {
            "guided_regex" => text.len() == 9 && text.as_bytes()[4] == b'-',
            "guided_grammar" => text.starts_with(" call me at ") && text.len() == 16,
            "guided_json" => text.parse::<u32>().is_ok_and(|n| (1000..=9999).contains(&n)),
            _ => text == " secret" || text == " unlisted",
        };
        assert!(ok, "{field} gave {text:?}");
    }
}

#[tokio::test]
async fn responses_text_format_json_schema() {
    let body = json!({
        "input": "Reply in JSON with a person named Bob, aged 40.",
        "max_output_tokens": 80,
        "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "person", "schema": person_schema(), "strict": true}}
    });
    let (status, out) = post(&smol().at("/v1/responses"), &body).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["text"]["format"]["type"], "json_schema", "the format is echoed");
    let message = out["output"].as_array().expect("output").iter().find(|o| o["type"] == "message").expect("message");
    assert_person(message["content"][0]["text"].as_str().expect("text"));
}

#[tokio::test]
async fn bad_constraints_are_400() {
    let chat = smol().at("/v1/chat/completions");
    let unresolvable =
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nowhere"}}});
    let got = post(&chat, &chat_with(json!({"response_format": unresolvable}))).await;
    let body = assert_error(got, 400, None, "does not compile");
    assert_eq!(body["error"]["code"], "invalid_constraint");
    let got = post(&chat, &chat_with(json!({"guided_regex": "(open"}))).await;
    assert_error(got, 400, None, "does not compile");
    let both = json!({"guided_regex": "a", "guided_choice": ["a"]});
    assert_error(post(&chat, &chat_with(both)).await, 400, Some("guided_choice"), "only one");
    let mixed = json!({"guided_regex": "a", "response_format": {"type": "json_object"}});
    assert_error(post(&chat, &chat_with(mixed)).await, 400, Some("guided_regex"), "cannot both");
    let no_schema = json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}});
    assert_error(post(&chat, &chat_with(no_schema)).await, 400, Some("response_format.schema"), "needs a schema");
    // The fixture model has no tokenizer, so nothing to constrain text with.
    let body = json!({"prompt": [1, 2], "max_tokens": 2, "response_format": {"type": "json_object"}});
    assert_error(post(&tiny().at("/v1/completions"), &body).await, 400, None, "needs a tokenizer");
    // Plain text is no constraint at all.
    assert_eq!(post(&chat, &chat_with(json!({"response_format": {"type": "text"}}))).await.0, 200);
}
