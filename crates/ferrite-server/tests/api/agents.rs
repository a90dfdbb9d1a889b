//! The protocol defects coding agents hit (issue 25), each over real HTTP on SmolLM2: a
//! `system` turn inside Anthropic `messages` (rendered in place, or merged for a template
//! that refuses it), Responses `namespace` and hosted tools, one `tool_calls` entry per
//! index per chat chunk, Anthropic `output_config.format`, parallel tool calls turned off on
//! the three surfaces, a call cut short reported as truncated, the providers' context-overflow
//! wording and the `max_tokens` cut,
//! one usage split in Anthropic streams, and images inside tool results.

use serde_json::{json, Value};

use crate::common::*;
use crate::tools::{forecast_schema, smol_with_template, streamed_calls, validates, weather_tool};

/// ChatML that raises on a system message anywhere but first.
const SYSTEM_FIRST_TEMPLATE: &str = "{%- for m in messages -%}\
{%- if m.role == 'system' and not loop.first -%}{{ raise_exception('System messages must come first') }}{%- endif -%}\
<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}\
{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}";

fn anthropic(messages: Value) -> Value {
    json!({"model": "smollm2", "max_tokens": 8, "temperature": 0, "messages": messages})
}

async fn count(server: &TestServer, body: &Value) -> u64 {
    let (status, count) = post(&server.at("/v1/messages/count_tokens"), body).await;
    assert_eq!(status, 200, "{count}");
    count["input_tokens"].as_u64().expect("input_tokens")
}

async fn tokenize(server: &TestServer, messages: Value) -> u64 {
    let (status, tok) = post(&server.at("/tokenize"), &json!({"messages": messages})).await;
    assert_eq!(status, 200, "{tok}");
    tok["count"].as_u64().expect("count")
}

#[tokio::test]
async fn a_system_turn_inside_anthropic_messages_is_rendered_or_merged() {
    let late = json!([{"role": "user", "content": "hi"}, {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]);
    // SmolLM2's ChatML renders it where it stands.
    let server = own_smol();
    let (status, msg) = post(&server.at("/v1/messages"), &anthropic(late.clone())).await;
    assert_eq!(status, 200, "{msg}");
    assert_eq!(msg["content"][0]["type"], "text");
    let in_place = json!([{"role": "user", "content": "hi"}, {"role": "system", "content": "Be brief."}]);
    assert_eq!(count(&server, &anthropic(late.clone())).await, tokenize(&server, in_place).await);
    // A template that refuses it gets it merged into the system prompt.
    let strict = smol_with_template(SYSTEM_FIRST_TEMPLATE);
    let mut body = anthropic(late);
    body["system"] = json!("Lead.");
    let (status, msg) = post(&strict.at("/v1/messages"), &body).await;
    assert_eq!(status, 200, "{msg}");
    let merged = json!([{"role": "system", "content": "Lead.\n\nBe brief."}, {"role": "user", "content": "hi"}]);
    assert_eq!(count(&strict, &body).await, tokenize(&strict, merged).await);
}

#[tokio::test]
async fn responses_flatten_namespaces_and_leave_hosted_tools_out() {
    let server = own_smol();
    let lookup = json!({"type": "function", "name": "lookup", "parameters": forecast_schema()});
    let body = json!({"model": "smollm2", "input": "Forecast for Oslo?", "max_output_tokens": 60, "temperature": 0,
        "tools": [{"type": "namespace", "name": "crm", "description": "d", "tools": [lookup]},
                  {"type": "web_search", "external_web_access": false}],
        "tool_choice": {"type": "function", "name": "lookup"}});
    let resp = client().post(server.at("/v1/responses")).json(&body).send().await.expect("request");
    assert_eq!(resp.status(), 200);
    let omitted = resp.headers().get("x-ferrite-omitted-tools").and_then(|v| v.to_str().ok()).map(str::to_string);
    assert_eq!(omitted.as_deref(), Some("web_search"));
    let out: Value = resp.json().await.expect("json");
    let call = &out["output"][0];
    assert_eq!((call["type"].as_str(), call["name"].as_str()), (Some("function_call"), Some("lookup")), "{out}");
    assert_eq!(call["namespace"], "crm", "{call}");
    let args: Value = serde_json::from_str(call["arguments"].as_str().expect("arguments")).expect("JSON arguments");
    assert!(validates(&forecast_schema(), &args), "{args}");
    // The same request streamed carries the header too; an unknown tool type is still a 400.
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let resp = client().post(server.at("/v1/responses")).json(&stream).send().await.expect("request");
    assert_eq!(resp.headers().get("x-ferrite-omitted-tools").and_then(|v| v.to_str().ok()), Some("web_search"));
    let bad = json!({"model": "smollm2", "input": "hi", "tools": [{"type": "teleport"}]});
    assert_error(post(&server.at("/v1/responses"), &bad).await, 400, Some("tools[0].type"), "namespace");
}

#[tokio::test]
async fn a_streamed_forced_call_has_one_entry_per_index_per_chunk() {
    let server = own_smol();
    for choice in [json!("required"), json!({"type": "function", "function": {"name": "get_weather"}})] {
        let body = json!({"stream": true, "max_tokens": 40, "temperature": 0, "tool_choice": choice,
                          "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [weather_tool()]});
        let events = post_stream(&server.at("/v1/chat/completions"), &body).await;
        for e in &events {
            let entries = e["choices"][0]["delta"]["tool_calls"].as_array().cloned().unwrap_or_default();
            let mut indexes: Vec<u64> = entries.iter().map(|c| c["index"].as_u64().expect("index")).collect();
            indexes.dedup();
            assert_eq!(indexes.len(), entries.len(), "one entry per index in {e}");
        }
        let calls = streamed_calls(&events);
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().expect("args")).expect("json");
        assert!(args["city"].is_string(), "{args}");
    }
}

#[tokio::test]
async fn anthropic_output_config_format_is_enforced() {
    let server = own_smol();
    let schema = forecast_schema();
    let mut body = anthropic(json!([{"role": "user", "content": "Give a forecast as JSON."}]));
    body["max_tokens"] = json!(60);
    body["output_config"] = json!({"format": {"type": "json_schema", "schema": schema}});
    let (status, msg) = post(&server.at("/v1/messages"), &body).await;
    assert_eq!(status, 200, "{msg}");
    let text = msg["content"][0]["text"].as_str().expect("text");
    let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("JSON ({e}): {text}"));
    assert!(validates(&schema, &value), "{value}");
    body["stream"] = json!(true);
    let events = post_events(&server.at("/v1/messages"), &body).await;
    let streamed: String = events.iter().filter_map(|(_, d)| d["delta"]["text"].as_str()).collect();
    assert_eq!(streamed, text);
    let mut bad = body.clone();
    bad["output_config"] = json!({"format": {"type": "yaml"}});
    let (status, err) = post(&server.at("/v1/messages"), &bad).await;
    assert_eq!((status.as_u16(), err["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{err}");
}

/// Two calls in the Hermes syntax the server describes tools in.
fn two_calls(a: &str, b: &str) -> String {
    let call = |city: &str| {
        format!("<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"{city}\"}}}}\n</tool_call>")
    };
    format!("{}\n{}", call(a), call(b))
}

/// Turns that get SmolLM2 (greedy) to write two calls: it repeats what it is asked to.
fn echo_turns() -> [(&'static str, String); 3] {
    [
        ("user", format!("Repeat exactly:\n{}", two_calls("Oslo", "Rome"))),
        ("assistant", two_calls("Oslo", "Rome")),
        ("user", format!("Repeat exactly:\n{}", two_calls("Paris", "Madrid"))),
    ]
}

#[tokio::test]
async fn parallel_tool_calls_off_allows_one_call_on_every_surface() {
    let server = own_smol();
    let messages: Vec<Value> = echo_turns().iter().map(|(role, text)| json!({"role": role, "content": text})).collect();
    // Chat: parallel_tool_calls false.
    let url = server.at("/v1/chat/completions");
    let mut body = json!({"messages": messages, "tools": [weather_tool()], "max_tokens": 80, "temperature": 0});
    let (_, free) = post(&url, &body).await;
    let calls = |v: &Value| v["choices"][0]["message"]["tool_calls"].as_array().map_or(0, Vec::len);
    assert_eq!(calls(&free), 2, "the model makes two calls when allowed: {free}");
    body["parallel_tool_calls"] = json!(false);
    let (status, one) = post(&url, &body).await;
    assert_eq!(status, 200, "{one}");
    assert_eq!(calls(&one), 1, "{one}");
    let first = |v: &Value| v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].clone();
    assert_eq!(first(&one), first(&free), "the first call is kept: {one}");
    assert_eq!(one["choices"][0]["finish_reason"], "tool_calls");
    assert!(
        one["usage"]["completion_tokens"].as_u64() < free["usage"]["completion_tokens"].as_u64(),
        "it stopped early"
    );
    body["stream"] = json!(true);
    assert_eq!(streamed_calls(&post_stream(&url, &body).await).len(), 1);
    // Anthropic: tool_choice.disable_parallel_tool_use.
    let tool = json!({"name": "get_weather", "input_schema": weather_tool()["function"]["parameters"]});
    let mut req =
        json!({"model": "smollm2", "max_tokens": 80, "temperature": 0, "messages": messages, "tools": [tool]});
    let uses = |m: &Value| m["content"].as_array().expect("content").iter().filter(|b| b["type"] == "tool_use").count();
    let (_, free) = post(&server.at("/v1/messages"), &req).await;
    assert_eq!(uses(&free), 2, "{free}");
    req["tool_choice"] = json!({"type": "auto", "disable_parallel_tool_use": true});
    let (_, one) = post(&server.at("/v1/messages"), &req).await;
    assert_eq!((uses(&one), one["stop_reason"].as_str()), (1, Some("tool_use")), "{one}");
    // Responses: parallel_tool_calls false.
    let f = &weather_tool()["function"];
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": f["parameters"]}]);
    let mut req =
        json!({"model": "smollm2", "input": messages, "tools": tools, "max_output_tokens": 80, "temperature": 0});
    let items =
        |r: &Value| r["output"].as_array().expect("output").iter().filter(|i| i["type"] == "function_call").count();
    let (_, free) = post(&server.at("/v1/responses"), &req).await;
    assert_eq!(items(&free), 2, "{free}");
    req["parallel_tool_calls"] = json!(false);
    let (_, one) = post(&server.at("/v1/responses"), &req).await;
    assert_eq!(items(&one), 1, "{one}");
    assert_eq!(one["parallel_tool_calls"], false);
}

/// The hostile probe's cut-off call: a stop string ends the reply inside the call's
/// arguments. It is not a complete call: a whole reply gives its text, a stream closes the
/// pieces it sent, and every surface reports the truncation.
#[tokio::test]
async fn a_tool_call_cut_short_is_reported_as_truncated_on_every_surface() {
    let server = smol();
    let call = two_calls("Oslo", "Rome");
    let messages = json!([
        {"role": "user", "content": format!("Repeat exactly:\n{call}")},
        {"role": "assistant", "content": call},
        {"role": "user", "content": format!("Repeat exactly:\n{}", two_calls("Paris", "Madrid"))},
    ]);
    let url = server.at("/v1/chat/completions");
    let mut body =
        json!({"messages": messages, "tools": [weather_tool()], "max_tokens": 80, "temperature": 0, "stop": ["Paris"]});
    let (status, v) = post(&url, &body).await;
    assert_eq!(status, 200, "{v}");
    // SmolLM2 writes one complete call, then the one the stop string cuts.
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{v}");
    let calls = choice["message"]["tool_calls"].as_array().expect("the complete call");
    assert_eq!(calls.len(), 1, "the cut call is not a call: {v}");
    let text = choice["message"]["content"].as_str().expect("the cut call's text");
    assert!(text.starts_with("<tool_call>") && text.ends_with("\"city\": \""), "{text:?}");
    body["stream"] = json!(true);
    let chunks = post_stream(&url, &body).await;
    let reasons: Vec<&Value> =
        chunks.iter().map(|c| &c["choices"][0]["finish_reason"]).filter(|r| !r.is_null()).collect();
    assert_eq!(reasons, [&json!("length")]);
    let streamed = streamed_calls(&chunks);
    assert_eq!(streamed.len(), 2, "the stream announced both calls");
    assert_eq!(streamed[0]["function"], calls[0]["function"]);
    let closed = streamed[1]["function"]["arguments"].as_str().expect("arguments");
    assert!(serde_json::from_str::<Value>(closed).is_ok_and(|a| a.is_object()), "closed into JSON: {closed}");
    // Anthropic.
    let tool = json!({"name": "get_weather", "input_schema": weather_tool()["function"]["parameters"]});
    let req = json!({"model": "smollm2", "max_tokens": 80, "temperature": 0, "messages": messages,
                     "tools": [tool], "stop_sequences": ["Paris"]});
    let (_, m) = post(&server.at("/v1/messages"), &req).await;
    assert_eq!(m["stop_reason"], "max_tokens", "{m}");
    let kinds: Vec<&Value> = m["content"].as_array().expect("content").iter().map(|b| &b["type"]).collect();
    assert_eq!(kinds, [&json!("tool_use"), &json!("text")], "{m}");
    // Responses (no stop strings): cut by the token budget inside the second call's arguments.
    let inside = v["usage"]["completion_tokens"].as_u64().expect("usage") - 1;
    let f = &weather_tool()["function"];
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": f["parameters"]}]);
    let req = json!({"model": "smollm2", "input": messages, "tools": tools, "max_output_tokens": inside,
                     "temperature": 0});
    let (_, r) = post(&server.at("/v1/responses"), &req).await;
    let status = (r["status"].as_str(), r["incomplete_details"]["reason"].as_str());
    assert_eq!(status, (Some("incomplete"), Some("max_output_tokens")), "{r}");
    let items = r["output"].as_array().expect("output");
    assert_eq!(items.iter().filter(|i| i["type"] == "function_call").count(), 1, "{r}");
}

#[tokio::test]
async fn context_overflow_uses_each_providers_wording_and_cuts_are_reported() {
    let server = smol();
    let long = "word ".repeat(600);
    let (status, err) = post(&server.at("/v1/messages"), &anthropic(json!([{"role": "user", "content": long}]))).await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["type"], "invalid_request_error");
    let message = err["error"]["message"].as_str().expect("message");
    let (prompt, max) = message
        .strip_prefix("prompt is too long: ")
        .and_then(|rest| rest.strip_suffix(" maximum"))
        .and_then(|rest| rest.split_once(" tokens > "))
        .unwrap_or_else(|| panic!("Anthropic's wording: {message}"));
    assert_eq!(max, "512");
    assert!(prompt.parse::<u64>().expect("count") > 512, "{message}");
    let chat = json!({"messages": [{"role": "user", "content": long}]});
    let err = assert_error(
        post(&server.at("/v1/chat/completions"), &chat).await,
        400,
        None,
        "maximum context length is 512 tokens",
    );
    assert_eq!(err["error"]["code"], "context_length_exceeded");
    let resp = json!({"input": long});
    let err =
        assert_error(post(&server.at("/v1/responses"), &resp).await, 400, None, "maximum context length is 512 tokens");
    assert_eq!(err["error"]["code"], "context_length_exceeded");
    // max_tokens past the room left is cut to it, and a reply that fills the context says so.
    let mut body = anthropic(json!([{"role": "user", "content": "word ".repeat(476)}]));
    body["max_tokens"] = json!(32000);
    let (status, msg) = post(&server.at("/v1/messages"), &body).await;
    assert_eq!(status, 200, "{msg}");
    let u = &msg["usage"];
    let total: u64 =
        ["input_tokens", "cache_read_input_tokens", "output_tokens"].iter().map(|k| u[*k].as_u64().expect("n")).sum();
    assert!(total <= 512, "{u}");
    if total == 512 {
        assert_eq!(msg["stop_reason"], "max_tokens", "{msg}");
    } else {
        assert_eq!(msg["stop_reason"], "end_turn", "{msg}");
    }
}

#[tokio::test]
async fn anthropic_stream_usage_agrees_with_itself_on_a_prefix_hit() {
    let server = smol();
    let mut body =
        anthropic(json!([{"role": "user", "content": "Tell me about the sea, the sky and the mountains, please."}]));
    body["system"] = json!("You are a poet who writes long answers about nature.");
    let (status, _) = post(&server.at("/v1/messages"), &body).await;
    assert_eq!(status, 200);
    body["stream"] = json!(true);
    let events = post_events(&server.at("/v1/messages"), &body).await;
    let start = &events.iter().find(|(n, _)| n == "message_start").expect("message_start").1["message"]["usage"];
    let delta = &events.iter().find(|(n, _)| n == "message_delta").expect("message_delta").1["usage"];
    assert!(start["cache_read_input_tokens"].as_u64().expect("cached") > 0, "a prefix hit: {start}");
    for key in ["input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"] {
        assert_eq!(start[key], delta[key], "{key}: start {start}, delta {delta}");
    }
}

#[tokio::test]
async fn an_image_inside_a_tool_result_becomes_a_placeholder() {
    let server = own_smol();
    let image =
        json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}});
    let with_image = |content: Value| {
        json!([{"role": "user", "content": "Read the picture."},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content}]}])
    };
    let tool =
        json!({"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}});
    let mut body = anthropic(with_image(json!([{"type": "text", "text": "a.png:"}, image.clone()])));
    body["tools"] = json!([tool]);
    let (status, msg) = post(&server.at("/v1/messages"), &body).await;
    assert_eq!(status, 200, "{msg}");
    // The placeholder is text in the prompt: the same count as writing it out.
    let mut written = body.clone();
    let placeholder = "[image omitted: this server cannot show images to the model]";
    written["messages"] = with_image(json!(format!("a.png:\n{placeholder}")));
    assert_eq!(count(&server, &body).await, count(&server, &written).await);
    // A top-level image from the user is still a clear 400.
    let top = anthropic(json!([{"role": "user", "content": [image]}]));
    let (status, err) = post(&server.at("/v1/messages"), &top).await;
    assert_eq!(status, 400, "{err}");
    let message = err["error"]["message"].as_str().expect("message");
    assert!(message.contains("'image' are not supported"), "{message}");
}
