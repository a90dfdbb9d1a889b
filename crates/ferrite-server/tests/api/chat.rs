//! `/v1/chat/completions` on SmolLM2: whole and streamed responses, the prompt built through
//! the chat template, sampling fields, logprobs, and the output-parser hook.

use std::sync::{Arc, Mutex};

use ferrite_engine::{Request, RequestParams};
use ferrite_models::chat_template::ChatRenderRequest;
use ferrite_models::load::GenerationDefaults;
use ferrite_server::parser::{Delta, Finished, OutputParser, ParseContext, ParserFactory, ToolCallDelta};
use ferrite_server::{App, ModelInfo, ServerConfig};
use serde_json::{json, Value};

use crate::common::*;

fn content(body: &Value, i: usize) -> String {
    body["choices"][i]["message"]["content"].as_str().unwrap_or_else(|| panic!("content in {body}")).to_string()
}

/// What `server`'s engine generates greedily for `prompt` when driven directly (no HTTP).
async fn direct_greedy(server: &TestServer, prompt: Vec<u32>, max_tokens: usize) -> String {
    let params = RequestParams { max_tokens: Some(max_tokens), ..Default::default() };
    let mut stream = served(server).await.engine.submit(Request { prompt, params }).expect("submit");
    let mut out = String::new();
    while let Some(o) = stream.next().await {
        out.push_str(&o.text);
        if o.finished.is_some() {
            break;
        }
    }
    out
}

#[tokio::test]
async fn chat_matches_the_engine_and_reports_usage() {
    let body = json!({
        "model": "smollm2",
        "messages": [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}],
        "max_tokens": 12,
        "temperature": 0,
    });
    let server = own_smol();
    let (status, resp) = post(&server.at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["object"], "chat.completion");
    assert_eq!(resp["model"], "smollm2");
    assert!(resp["id"].as_str().is_some_and(|id| id.starts_with("chatcmpl-")));
    assert_eq!(resp["choices"][0]["message"]["role"], "assistant");
    let messages = body["messages"].as_array().expect("messages");
    let loaded = smollm2();
    let text =
        loaded.chat_template.as_ref().expect("template").render(&ChatRenderRequest::new(messages)).expect("render");
    let prompt = loaded.tokenizer.as_ref().expect("tokenizer").encode(&text, false).expect("encode");
    let want = direct_greedy(&server, prompt, 12).await;
    assert_eq!(content(&resp, 0), want);
    assert!(!want.is_empty());
    let finish = resp["choices"][0]["finish_reason"].as_str().expect("finish_reason");
    assert!(finish == "stop" || finish == "length", "{finish}");
    let (_, tok) = post(&smol().at("/tokenize"), &json!({"messages": body["messages"]})).await;
    let u = &resp["usage"];
    assert_eq!(u["prompt_tokens"], tok["count"]);
    let completion = u["completion_tokens"].as_u64().expect("completion_tokens");
    assert!((1..=12).contains(&completion));
    assert_eq!(u["total_tokens"].as_u64(), Some(tok["count"].as_u64().expect("count") + completion));
    assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());
}

#[tokio::test]
async fn streaming_chat_equals_whole_chat() {
    let server = own_smol();
    let mut body = chat_body("Count to five.", 12);
    let (_, whole) = post(&server.at("/v1/chat/completions"), &body).await;
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let events = post_stream(&server.at("/v1/chat/completions"), &body).await;
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    let mut finishes = Vec::new();
    for e in &events {
        assert_eq!(e["object"], "chat.completion.chunk");
        assert_eq!(e["id"], events[0]["id"]);
        for c in e["choices"].as_array().expect("choices") {
            text.push_str(c["delta"]["content"].as_str().unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                finishes.push(f.to_string());
            }
        }
    }
    assert_eq!(text, content(&whole, 0));
    assert_eq!(finishes, vec![whole["choices"][0]["finish_reason"].as_str().expect("finish").to_string()]);
    let last = events.last().expect("usage chunk");
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], whole["usage"]["completion_tokens"]);
    assert_eq!(last["usage"]["prompt_tokens"], whole["usage"]["prompt_tokens"]);
    assert!(events[..events.len() - 1].iter().all(|e| e["usage"].is_null()));
    // Without include_usage there is no usage chunk.
    body["stream_options"] = Value::Null;
    let events = post_stream(&server.at("/v1/chat/completions"), &body).await;
    assert!(events.iter().all(|e| e.get("usage").is_none() && !e["choices"].as_array().expect("choices").is_empty()));
}

/// A SmolLM2 server of the test's own whose model ships `defaults` as its generation config.
fn smol_with_defaults(defaults: GenerationDefaults) -> TestServer {
    let loaded = smollm2();
    let mut info = ModelInfo::new(loaded, "smollm2".into(), vec![]);
    info.defaults = defaults;
    start(App::new(engine(loaded, Some(512), false), info, ServerConfig::default()))
}

/// The reply to a seeded request with `sampling` merged into its body.
async fn seeded_reply(server: &TestServer, sampling: Value) -> String {
    let mut body = json!({"messages": [{"role": "user", "content": "List fruits: apple, apple, apple,"}],
                          "max_tokens": 12, "seed": 3});
    for (k, v) in sampling.as_object().expect("object") {
        body[k] = v.clone();
    }
    let (status, reply) = post(&server.at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{reply}");
    content(&reply, 0)
}

#[tokio::test]
async fn generation_config_defaults_follow_do_sample() {
    // A greedy config (do_sample false): its temperature is not used (OpenAI's 1.0 is), its
    // repetition penalty is.
    let greedy_config = GenerationDefaults {
        do_sample: Some(false),
        temperature: Some(0.0),
        repetition_penalty: Some(1.5),
        ..Default::default()
    };
    let server = smol_with_defaults(greedy_config);
    let defaulted = seeded_reply(&server, json!({})).await;
    assert_eq!(defaulted, seeded_reply(&server, json!({"temperature": 1.0, "repetition_penalty": 1.5})).await);
    let plain_greedy = seeded_reply(&server, json!({"temperature": 0.0, "repetition_penalty": 1.0})).await;
    assert_ne!(defaulted, plain_greedy, "the greedy config's temperature was used");
    let greedy = seeded_reply(&server, json!({"temperature": 0.0})).await;
    assert_eq!(greedy, seeded_reply(&server, json!({"temperature": 0.0, "repetition_penalty": 1.5})).await);
    assert_ne!(greedy, plain_greedy, "the config's repetition penalty was ignored");
    // A sampling config's temperature is the default.
    let sampling_config = GenerationDefaults { do_sample: Some(true), temperature: Some(0.0), ..Default::default() };
    let server = smol_with_defaults(sampling_config);
    assert_eq!(seeded_reply(&server, json!({})).await, seeded_reply(&server, json!({"temperature": 0.0})).await);
    assert_ne!(seeded_reply(&server, json!({})).await, seeded_reply(&server, json!({"temperature": 1.0})).await);
}

#[tokio::test]
async fn n_choices_with_a_seed_are_reproducible() {
    let server = own_smol();
    let url = server.at("/v1/chat/completions");
    let body = json!({"messages": [{"role": "user", "content": "Tell me a word."}], "n": 2, "seed": 7,
                      "temperature": 1.0, "max_completion_tokens": 8});
    let (status, a) = post(&url, &body).await;
    assert_eq!(status, 200, "{a}");
    let (_, b) = post(&url, &body).await;
    assert_eq!(a["choices"].as_array().expect("choices").len(), 2);
    for i in 0..2 {
        assert_eq!(a["choices"][i]["index"], i);
        assert_eq!(content(&a, i), content(&b, i), "choice {i} with the same seed");
    }
    assert_ne!(content(&a, 0), content(&a, 1), "the choices sample with their own seeds");
    let (_, one) =
        post(&url, &json!({"messages": body["messages"], "max_tokens": 8, "temperature": 1.0, "seed": 7})).await;
    assert!(a["usage"]["completion_tokens"].as_u64() > one["usage"]["completion_tokens"].as_u64());
    assert_eq!(a["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"], "the prompt counts once");
    // Streaming n=2: every choice gets its role chunk, its text and one finish.
    let mut body = body;
    body["stream"] = json!(true);
    let events = post_stream(&url, &body).await;
    let mut texts = [String::new(), String::new()];
    let (mut roles, mut finished) = ([0, 0], [0, 0]);
    for e in &events {
        for c in e["choices"].as_array().expect("choices") {
            let i = c["index"].as_u64().expect("index") as usize;
            texts[i].push_str(c["delta"]["content"].as_str().unwrap_or(""));
            roles[i] += usize::from(c["delta"]["role"] == "assistant");
            finished[i] += usize::from(!c["finish_reason"].is_null());
        }
    }
    assert_eq!((roles, finished), ([1, 1], [1, 1]));
    assert_eq!(texts, [content(&a, 0), content(&a, 1)]);
}

#[tokio::test]
async fn stop_strings_cut_the_output() {
    let server = own_smol();
    let url = server.at("/v1/chat/completions");
    let (_, plain) = post(&url, &chat_body("Write a sentence about the sea.", 16)).await;
    let text = content(&plain, 0);
    let words: Vec<&str> = text.split_whitespace().collect();
    assert!(words.len() >= 4, "need a few words: {text:?}");
    let stop = format!(" {}", words[2]);
    let cut = &text[..text.find(&stop).expect("stop in text")];
    for stop_field in [json!(stop), json!(["\u{1F600}never", stop])] {
        let mut body = chat_body("Write a sentence about the sea.", 16);
        body["stop"] = stop_field;
        let (_, resp) = post(&url, &body).await;
        assert_eq!(content(&resp, 0), cut);
        assert_eq!(resp["choices"][0]["finish_reason"], "stop");
    }
}

#[tokio::test]
async fn logprobs_name_tokens_with_bytes_and_alternatives() {
    let mut body = chat_body("Say hello.", 5);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let (status, resp) = post(&smol().at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{resp}");
    let entries = resp["choices"][0]["logprobs"]["content"].as_array().expect("logprobs.content");
    assert_eq!(entries.len() as u64, resp["usage"]["completion_tokens"].as_u64().expect("completion"));
    let mut joined = String::new();
    for e in entries {
        let token = e["token"].as_str().expect("token");
        joined.push_str(token);
        assert_eq!(e["bytes"], json!(token.as_bytes()));
        let lp = e["logprob"].as_f64().expect("logprob");
        assert!(lp <= 0.0);
        let top = e["top_logprobs"].as_array().expect("top_logprobs");
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], e["token"]);
        assert!((top[0]["logprob"].as_f64().expect("lp") - lp).abs() < 1e-4);
        assert!(top.windows(2).all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
    }
    if resp["choices"][0]["finish_reason"] == "length" {
        assert_eq!(joined, content(&resp, 0));
    }
    // Without logprobs the field is null.
    let (_, plain) = post(&smol().at("/v1/chat/completions"), &chat_body("Say hello.", 2)).await;
    assert!(plain["choices"][0]["logprobs"].is_null());
}

#[tokio::test]
async fn logit_bias_forces_a_token() {
    let (_, tok) = post(&smol().at("/tokenize"), &json!({"prompt": " banana", "add_special_tokens": false})).await;
    let banana = ids(&tok["tokens"])[0];
    let mut body = chat_body("Say hello.", 4);
    body["logit_bias"] = json!({banana.to_string(): 100});
    body["return_token_ids"] = json!(true);
    let (status, resp) = post(&smol().at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(ids(&resp["choices"][0]["token_ids"]), vec![banana; 4]);
}

#[tokio::test]
async fn the_prompt_carries_roles_parts_tools_and_kwargs() {
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let body = json!({
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": tools, "tool_choice": "auto", "max_tokens": 3, "temperature": 0, "return_token_ids": true,
        "chat_template_kwargs": {"enable_thinking": false}, "reasoning_effort": "low", "parallel_tool_calls": true,
    });
    let (status, resp) = post(&smol().at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{resp}");
    let tok = smollm2().tokenizer.as_ref().expect("tokenizer");
    let prompt = tok.decode(&ids(&resp["prompt_token_ids"]), false).expect("decode");
    assert!(prompt.contains("<|im_start|>system\nBe brief."), "developer → system: {prompt}");
    assert!(prompt.contains("Weather\nin Paris?"), "text parts joined: {prompt}");
    assert!(prompt.contains("sunny"), "tool result: {prompt}");
    assert!(prompt.ends_with("<|im_start|>assistant\n"), "generation prompt: {prompt}");
    assert_eq!(resp["usage"]["prompt_tokens"].as_u64(), Some(ids(&resp["prompt_token_ids"]).len() as u64));
}

/// A template that shows what it was given, to check tools and kwargs reach it.
#[tokio::test]
async fn tools_and_kwargs_reach_the_template() {
    let source = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                  {% if tools %}TOOLS={{ tools | length }};{% endif %}{% if enable_thinking %}THINK;{% endif %}\
                  {% if reasoning_effort %}EFFORT={{ reasoning_effort }};{% endif %}\
                  {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let mut info = ModelInfo::new(smollm2(), "smollm2".into(), vec![]);
    info.chat_template = Some(ferrite_models::chat_template::ChatTemplate::new(source, None, None).expect("template"));
    let server = start(App::new(engine(smollm2(), Some(512), true), info, ServerConfig::default()));
    let tools =
        json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]);
    let base = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0,
                      "return_token_ids": true});
    let prompt_of = |resp: &Value| -> String {
        smollm2().tokenizer.as_ref().expect("tok").decode(&ids(&resp["prompt_token_ids"]), false).expect("decode")
    };
    let mut body = base.clone();
    body["tools"] = tools.clone();
    body["chat_template_kwargs"] = json!({"enable_thinking": true});
    body["reasoning_effort"] = json!("high");
    let (_, resp) = post(&server.at("/v1/chat/completions"), &body).await;
    assert!(prompt_of(&resp).ends_with("TOOLS=2;THINK;EFFORT=high;<|im_start|>assistant\n"), "{}", prompt_of(&resp));
    // tool_choice "none" hides the tools; kwargs override reasoning_effort.
    body["tool_choice"] = json!("none");
    body["chat_template_kwargs"] = json!({"reasoning_effort": "medium"});
    let (_, resp) = post(&server.at("/v1/chat/completions"), &body).await;
    assert!(
        prompt_of(&resp).ends_with("user\nhi<|im_end|>\nEFFORT=medium;<|im_start|>assistant\n"),
        "{}",
        prompt_of(&resp)
    );
    let (_, resp) = post(&server.at("/v1/chat/completions"), &base).await;
    assert!(prompt_of(&resp).ends_with("hi<|im_end|>\n<|im_start|>assistant\n"));
}

/// Everything it is fed is reasoning; at the end it calls a tool `probe`.
struct ProbeParser;

impl OutputParser for ProbeParser {
    fn push(&mut self, text: &str) -> Vec<Delta> {
        if text.is_empty() {
            vec![]
        } else {
            vec![Delta::Reasoning(text.to_string())]
        }
    }
    fn finish(&mut self) -> Finished {
        let piece = |id: Option<&str>, name: Option<&str>, args: &str| {
            Delta::ToolCall(ToolCallDelta {
                index: 0,
                id: id.map(Into::into),
                name: name.map(Into::into),
                arguments: args.into(),
            })
        };
        let deltas = vec![piece(Some("call_probe"), Some("probe"), "{\"x\":"), piece(None, None, " 1}")];
        Finished { deltas, cut: None }
    }
}

/// Hands out `ProbeParser`s, remembering how many tools each request offered.
struct ProbeParsers(Arc<Mutex<Vec<usize>>>);

impl ParserFactory for ProbeParsers {
    fn parser(&self, ctx: &ParseContext<'_>) -> Box<dyn OutputParser> {
        self.0.lock().expect("lock").push(ctx.tools.len());
        Box::new(ProbeParser)
    }
}

#[tokio::test]
async fn parsed_reasoning_and_tool_calls_are_rendered() {
    let tools_seen = Arc::new(Mutex::new(Vec::new()));
    let server = start(own_smol_app().with_parsers(Box::new(ProbeParsers(tools_seen.clone()))));
    let mut body = chat_body("Say hello.", 6);
    body["tools"] = json!([{"type": "function", "function": {"name": "probe"}}]);
    let (_, tok) = post(&server.at("/tokenize"), &json!({"messages": body["messages"], "tools": body["tools"]})).await;
    let plain = direct_greedy(&server, ids(&tok["tokens"]), 6).await;
    let (status, resp) = post(&server.at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(*tools_seen.lock().expect("lock"), vec![1]);
    let msg = &resp["choices"][0]["message"];
    assert_eq!(msg["reasoning_content"].as_str(), Some(plain.as_str()));
    assert!(msg["content"].is_null());
    let call =
        json!({"id": "call_probe", "type": "function", "function": {"name": "probe", "arguments": "{\"x\": 1}"}});
    assert_eq!(msg["tool_calls"], json!([call]));
    let want_finish = if resp["usage"]["completion_tokens"] == 6 { "length" } else { "tool_calls" };
    assert_eq!(resp["choices"][0]["finish_reason"], want_finish);
    body["stream"] = json!(true);
    let events = post_stream(&server.at("/v1/chat/completions"), &body).await;
    let (mut reasoning, mut calls) = (String::new(), Vec::new());
    for e in &events {
        let d = &e["choices"][0]["delta"];
        reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        assert!(d.get("content").is_none_or(|c| c == ""), "no content: {e}");
        calls.extend(d["tool_calls"].as_array().cloned().unwrap_or_default());
    }
    assert_eq!(reasoning, plain);
    // The call's pieces that arrive in one chunk are one entry (issue 25).
    let whole = json!({"index": 0, "id": "call_probe", "type": "function", "function": {"name": "probe", "arguments": "{\"x\": 1}"}});
    assert_eq!(calls, vec![whole]);
}
