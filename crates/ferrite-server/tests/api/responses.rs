//! `/v1/responses` on SmolLM2: the response object and usage, the streaming event sequence
//! with sequence numbers, `previous_response_id` (and `store: false`), `GET
//! /v1/responses/{id}`, a forced function call (its arguments valid under the tool's schema)
//! and its output going back, and the 400s.

use serde_json::{json, Value};

use crate::common::*;
use crate::tools::{forecast_schema, validates, THINKING_TEMPLATE};

fn weather_tool() -> Value {
    json!({"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": true,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})
}

fn output_text(resp: &Value) -> String {
    let items = resp["output"].as_array().unwrap_or_else(|| panic!("output in {resp}"));
    items
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p["text"].as_str().map(str::to_string))
        .collect()
}

fn tokens(resp: &Value, field: &str) -> u64 {
    resp["usage"][field].as_u64().unwrap_or_else(|| panic!("usage.{field} in {resp}"))
}

async fn create(server: &TestServer, body: &Value) -> Value {
    let (status, resp) = post(&server.at("/v1/responses"), body).await;
    assert_eq!(status, 200, "{resp}");
    resp
}

#[tokio::test]
async fn a_response_matches_chat_and_is_stored() {
    let server = own_smol();
    let body = json!({"model": "smollm2", "input": "Name a color.", "instructions": "You are brief.",
                      "max_output_tokens": 12, "temperature": 0, "metadata": {"k": "v"}});
    let resp = create(&server, &body).await;
    assert!(resp["id"].as_str().is_some_and(|id| id.starts_with("resp_")));
    assert_eq!((resp["object"].as_str(), resp["model"].as_str()), (Some("response"), Some("smollm2")));
    let status = resp["status"].as_str().expect("status");
    match status {
        "completed" => assert!(resp["incomplete_details"].is_null()),
        "incomplete" => assert_eq!(resp["incomplete_details"], json!({"reason": "max_output_tokens"})),
        other => panic!("status {other}"),
    }
    let item = &resp["output"][0];
    assert_eq!(
        (item["type"].as_str(), item["role"].as_str(), item["status"].as_str()),
        (Some("message"), Some("assistant"), Some("completed"))
    );
    assert!(item["id"].as_str().is_some_and(|id| id.starts_with("msg_")));
    assert_eq!(item["content"][0]["type"], "output_text");
    assert_eq!((resp["instructions"].as_str(), resp["metadata"].clone()), (Some("You are brief."), json!({"k": "v"})));
    let chat = json!({"messages": [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}],
                      "max_tokens": 12, "temperature": 0});
    let (_, chat) = post(&server.at("/v1/chat/completions"), &chat).await;
    assert_eq!(output_text(&resp), chat["choices"][0]["message"]["content"].as_str().expect("content"));
    assert_eq!(resp["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    assert_eq!(resp["usage"]["output_tokens"], chat["usage"]["completion_tokens"]);
    assert!(resp["usage"]["input_tokens_details"]["cached_tokens"].is_u64());
    assert_eq!(tokens(&resp, "total_tokens"), tokens(&resp, "input_tokens") + tokens(&resp, "output_tokens"));
    let (code, stored) = get(&server.at(&format!("/v1/responses/{}", resp["id"].as_str().expect("id")))).await;
    assert_eq!(code, 200);
    assert_eq!(serde_json::from_str::<Value>(&stored).expect("json"), resp);
}

#[tokio::test]
async fn streaming_follows_the_responses_event_sequence() {
    let server = own_smol();
    let body = json!({"input": "Count to five.", "max_output_tokens": 12, "temperature": 0});
    let whole = create(&server, &body).await;
    let mut req = body.clone();
    req["stream"] = json!(true);
    let events = post_events(&server.at("/v1/responses"), &req).await;
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"].as_u64(), Some(i as u64), "sequence numbers count from 0");
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let n = names.len();
    assert_eq!(
        &names[..4],
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    );
    let end = if whole["status"] == "completed" { "response.completed" } else { "response.incomplete" };
    assert_eq!(
        &names[n - 4..],
        ["response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    );
    assert!(names[4..n - 4].iter().all(|&e| e == "response.output_text.delta"), "{names:?}");
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    assert_eq!(events[0].1["response"]["output"], json!([]));
    let item_id = events[2].1["item"]["id"].clone();
    let deltas: String = events[4..n - 4]
        .iter()
        .map(|(_, d)| {
            assert_eq!((&d["item_id"], d["output_index"].as_u64()), (&item_id, Some(0)));
            d["delta"].as_str().expect("delta").to_string()
        })
        .collect();
    assert_eq!(deltas, output_text(&whole));
    assert_eq!(events[n - 4].1["text"].as_str(), Some(deltas.as_str()));
    let last = &events[n - 1].1["response"];
    assert_eq!(output_text(last), deltas);
    assert_eq!(last["usage"], whole["usage"]);
    let (_, stored) = get(&server.at(&format!("/v1/responses/{}", last["id"].as_str().expect("id")))).await;
    assert_eq!(&serde_json::from_str::<Value>(&stored).expect("json"), last);
}

#[tokio::test]
async fn previous_response_id_continues_the_conversation() {
    let server = own_smol();
    let first = create(
        &server,
        &json!({"input": "My name is Ada.", "instructions": "Be brief.", "max_output_tokens": 8, "temperature": 0}),
    )
    .await;
    let id = first["id"].as_str().expect("id");
    let next =
        create(&server, &json!({"input": "What is my name?", "previous_response_id": id, "max_output_tokens": 4}))
            .await;
    assert_eq!(next["previous_response_id"], id);
    // The same conversation sent as items (instructions are not carried over).
    let items = json!([
        {"role": "user", "content": "My name is Ada."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": output_text(&first)}]},
        {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]},
    ]);
    let explicit = create(&server, &json!({"input": items, "max_output_tokens": 4})).await;
    assert_eq!(tokens(&next, "input_tokens"), tokens(&explicit, "input_tokens"));
    assert!(tokens(&next, "input_tokens") > tokens(&first, "input_tokens"));
    // store: false keeps nothing.
    let unstored = create(&server, &json!({"input": "Hi", "store": false, "max_output_tokens": 2})).await;
    assert_eq!(unstored["store"], false);
    let uid = unstored["id"].as_str().expect("id");
    assert_eq!(get(&server.at(&format!("/v1/responses/{uid}"))).await.0, 404);
    let follow = json!({"input": "Again", "previous_response_id": uid});
    assert_error(post(&server.at("/v1/responses"), &follow).await, 404, Some("previous_response_id"), uid);
}

#[tokio::test]
async fn a_forced_function_call_streams_and_its_output_goes_back() {
    let server = own_smol();
    let body = json!({"input": "What is the weather in Paris?", "tools": [weather_tool()],
                      "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 48, "temperature": 0});
    let resp = create(&server, &body).await;
    assert_eq!(resp["status"], "completed", "a forced call ends the reply: {resp}");
    let call =
        resp["output"].as_array().expect("output").iter().find(|i| i["type"] == "function_call").expect("call").clone();
    assert!(call["id"].as_str().is_some_and(|id| id.starts_with("fc_")), "{call}");
    assert!(call["call_id"].as_str().is_some_and(|id| id.starts_with("call_")), "{call}");
    assert_eq!((call["name"].as_str(), call["status"].as_str()), (Some("get_weather"), Some("completed")));
    let args: Value = serde_json::from_str(call["arguments"].as_str().expect("arguments")).expect("JSON arguments");
    assert!(args.is_object());
    assert_eq!(resp["tools"], json!([weather_tool()]));
    let mut req = body.clone();
    req["stream"] = json!(true);
    let events = post_events(&server.at("/v1/responses"), &req).await;
    let added = events
        .iter()
        .find(|(n, d)| n == "response.output_item.added" && d["item"]["type"] == "function_call")
        .expect("added");
    assert_eq!(
        (added.1["item"]["arguments"].as_str(), added.1["item"]["status"].as_str()),
        (Some(""), Some("in_progress"))
    );
    let streamed: String = events
        .iter()
        .filter(|(n, _)| n == "response.function_call_arguments.delta")
        .map(|(_, d)| d["delta"].as_str().expect("delta").to_string())
        .collect();
    assert_eq!(streamed, call["arguments"].as_str().expect("arguments"));
    let done = events.iter().find(|(n, _)| n == "response.function_call_arguments.done").expect("done");
    assert_eq!(done.1["arguments"], call["arguments"]);
    // The result goes back by previous_response_id.
    let output = json!([{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 24 C"}]);
    let follow =
        json!({"input": output, "previous_response_id": resp["id"], "tools": [weather_tool()], "max_output_tokens": 4});
    let answer = create(&server, &follow).await;
    assert!(matches!(answer["status"].as_str(), Some("completed" | "incomplete")));
}

#[tokio::test]
async fn forced_call_arguments_validate_even_with_a_text_format() {
    let forecast = json!({"type": "function", "name": "get_forecast", "parameters": forecast_schema()});
    let body = json!({"input": "Forecast for Paris?", "tools": [weather_tool(), forecast], "temperature": 0,
                      "tool_choice": {"type": "function", "name": "get_forecast"}, "max_output_tokens": 64,
                      "text": {"format": {"type": "json_object"}}});
    let resp = create(smol(), &body).await;
    let call =
        resp["output"].as_array().expect("output").iter().find(|i| i["type"] == "function_call").expect("call").clone();
    assert_eq!(call["name"], "get_forecast", "{resp}");
    let args: Value = serde_json::from_str(call["arguments"].as_str().expect("arguments")).expect("JSON arguments");
    assert!(validates(&forecast_schema(), &args), "{resp}");
}

#[tokio::test]
async fn reasoning_comes_as_a_reasoning_item() {
    let server = crate::tools::smol_with_template(THINKING_TEMPLATE);
    let resp =
        create(&server, &json!({"input": "Why is the sky blue?", "max_output_tokens": 8, "temperature": 0})).await;
    let item = &resp["output"][0];
    assert_eq!(item["type"], "reasoning", "{resp}");
    let text = item["content"][0]["text"].as_str().expect("reasoning text");
    assert!(!text.is_empty());
    assert!(
        tokens(&resp, "output_tokens")
            >= resp["usage"]["output_tokens_details"]["reasoning_tokens"].as_u64().expect("reasoning")
    );
    let events = post_events(
        &server.at("/v1/responses"),
        &json!({"input": "Why is the sky blue?", "max_output_tokens": 8, "stream": true}),
    )
    .await;
    let streamed: String = events
        .iter()
        .filter(|(n, _)| n == "response.reasoning_text.delta")
        .filter_map(|(_, d)| d["delta"].as_str().map(str::to_string))
        .collect();
    assert!(!streamed.is_empty());
}

#[tokio::test]
async fn unsupported_requests_are_refused() {
    let url = smol().at("/v1/responses");
    let cases = [
        (json!({"input": "x", "text": {"format": {"type": "xml"}}}), "text.format.type", "must be 'text'"),
        (json!({"input": "x", "tools": [{"type": "file_reader"}]}), "tools[0].type", "function"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input[0].content[0].type",
            "only text",
        ),
        (json!({"input": 3}), "input", "must be a string"),
        (json!({"input": "x", "tool_choice": "required"}), "tool_choice", "at least one tool"),
    ];
    for (body, param, needle) in cases {
        assert_error(post(&url, &body).await, 400, Some(param), needle);
    }
    assert_error(post(&url, &json!({"input": "x", "model": "gpt-5"})).await, 404, Some("model"), "gpt-5");
    let (status, body) = get(&smol().at("/v1/responses/resp_nope")).await;
    assert_eq!(status, 404, "{body}");
}
