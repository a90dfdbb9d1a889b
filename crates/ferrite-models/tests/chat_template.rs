//! Chat templates: every real template in the test assets renders a standard conversation,
//! the output matches transformers byte for byte (fixtures from
//! scripts/goldens/chat_template_fixtures.py), and errors say what went wrong.

use std::path::{Path, PathBuf};

use chrono::NaiveDateTime;
use ferrite_models::chat_template::{ChatRenderRequest, ChatTemplate, ChatTemplateError, ModelChatTemplates};
use serde_json::{json, Value};

fn assets_dir() -> PathBuf {
    let dir = ferrite_models::paths::test_assets_dir();
    let templates = dir.join("llama.cpp-models").join("templates");
    assert!(
        templates.is_dir(),
        "{} is missing: run scripts/fetch_test_assets.sh to fetch the test assets",
        templates.display()
    );
    dir
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/chat_templates")
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}
        }, "required": ["city"]}
    }})
}

/// system, user, assistant tool call (OpenAI shape: `content: null`, arguments as a JSON
/// string), tool result, assistant answer, user.
fn standard_conversation() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "You are a helpful assistant."}),
        json!({"role": "user", "content": "What's the weather in Paris?"}),
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]}),
        json!({"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
            "content": "{\"temperature\": 18, \"condition\": \"sunny\"}"}),
        json!({"role": "assistant", "content": "It is 18 °C and sunny in Paris."}),
        json!({"role": "user", "content": "Thanks! And in Zürich?"}),
    ]
}

fn simple_conversation() -> Vec<Value> {
    vec![
        json!({"role": "user", "content": "Hello! Who are you?"}),
        json!({"role": "assistant", "content": "I am a helpful assistant."}),
        json!({"role": "user", "content": "Tell me a joke."}),
    ]
}

/// Templates that refuse the standard conversation, what they are given instead, and why.
/// A template listed here that stops refusing fails the test (the list must stay true).
enum Fallback {
    /// user / assistant / user: no system message, no tools, no tool messages.
    Simple,
    /// The standard conversation with a 9-character alphanumeric tool-call id.
    NineCharToolIds,
    /// The simple conversation with the tool and the `functions`/`datetime` variables the
    /// template reads.
    FirefunctionVariables,
}

const REFUSES_STANDARD: &[(&str, Fallback, &str)] = &[
    ("google-gemma-2-2b-it.jinja", Fallback::Simple, "raise_exception: System role not supported"),
    (
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        Fallback::NineCharToolIds,
        "raise_exception: Tool call IDs should be alphanumeric strings with length 9!",
    ),
    (
        "Mistral-Small-3.2-24B-Instruct-2506.jinja",
        Fallback::NineCharToolIds,
        "raise_exception: Tool call IDs should be alphanumeric strings with length 9!",
    ),
    // Not raise_exception, and transformers fails the same way:
    ("Kimi-K2-Instruct.jinja", Fallback::Simple, "tool results: list.append, refused by HF's sandbox too"),
    ("Kimi-K2-Thinking.jinja", Fallback::Simple, "tool results: list.append, refused by HF's sandbox too"),
    (
        "fireworks-ai-llama-3-firefunction-v2.jinja",
        Fallback::FirefunctionVariables,
        "reads `functions` and `datetime` variables instead of `tools` (undefined in HF too)",
    ),
];

fn fixed_now() -> NaiveDateTime {
    NaiveDateTime::parse_from_str("2025-03-14T09:26:53", "%Y-%m-%dT%H:%M:%S").expect("valid date")
}

fn compile(path: &Path) -> ChatTemplate {
    let source = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    ChatTemplate::new(&source, Some("<s>".into()), Some("</s>".into()))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .with_fixed_now(fixed_now())
}

#[test]
fn every_real_template_renders_a_standard_conversation() {
    let dir = assets_dir().join("llama.cpp-models").join("templates");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("templates dir")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "jinja"))
        .collect();
    paths.sort();
    assert!(paths.len() >= 50, "expected the llama.cpp templates in {}", dir.display());

    let tools = [weather_tool()];
    let standard = standard_conversation();
    let simple = simple_conversation();
    let mut failures = Vec::new();
    for path in &paths {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let template = compile(path);
        let req = ChatRenderRequest { tools: Some(&tools), ..ChatRenderRequest::new(&standard) };
        let result = template.render(&req);
        let special = REFUSES_STANDARD.iter().find(|(n, _, _)| *n == name);
        match (result, special) {
            (Ok(out), None) => {
                if !out.contains("Zürich") {
                    failures.push(format!("{name}: the last user message is missing from the output"));
                }
            }
            (Ok(_), Some(_)) => {
                failures.push(format!("{name}: listed as refusing the standard conversation, but renders it"))
            }
            (Err(e), None) => failures.push(format!("{name}: {e}")),
            (Err(e), Some((_, fallback, reason))) => {
                let nine_char_ids: Vec<Value> = standard_conversation()
                    .into_iter()
                    .map(|m| serde_json::from_str(&m.to_string().replace("call_1", "abcDEF123")).expect("json"))
                    .collect();
                let req = match fallback {
                    Fallback::Simple => ChatRenderRequest::new(&simple),
                    Fallback::NineCharToolIds => {
                        ChatRenderRequest { tools: Some(&tools), ..ChatRenderRequest::new(&nine_char_ids) }
                    }
                    Fallback::FirefunctionVariables => {
                        let mut req = ChatRenderRequest { tools: Some(&tools), ..ChatRenderRequest::new(&simple) };
                        req.extra.insert("functions".into(), json!(weather_tool().to_string()));
                        req.extra.insert("datetime".into(), json!("2025-03-14"));
                        req
                    }
                };
                match template.render(&req) {
                    Ok(out) if out.contains("Tell me a joke.") || out.contains("Zürich") => {}
                    Ok(_) => failures.push(format!("{name}: fallback output misses the last user message")),
                    Err(e2) => failures.push(format!("{name} ({reason}): standard: {e}; fallback: {e2}")),
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} templates failed:\n{}", failures.len(), paths.len(), failures.join("\n"));
}

/// Where two renderings first differ, for a readable failure.
fn first_difference(expected: &str, got: &str) -> String {
    let at = expected.chars().zip(got.chars()).take_while(|(a, b)| a == b).count();
    let context = |s: &str| s.chars().skip(at.saturating_sub(40)).take(100).collect::<String>();
    format!("first difference at char {at}:\n  expected: {:?}\n  got:      {:?}", context(expected), context(got))
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The fixture files of one kind: every `<template>.json` (not the shared inputs).
fn template_fixtures() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .expect("tests/fixtures/chat_templates")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .filter(|p| !p.ends_with("conversations.json") && !p.ends_with("jinja2_semantics.json"))
        .collect();
    files.sort();
    files
}

#[test]
fn renders_match_transformers_byte_for_byte() {
    let assets = assets_dir();
    let inputs = read_json(&fixtures_dir().join("conversations.json"));
    let tools = inputs["tools"].as_array().expect("tools").clone();
    let files = template_fixtures();
    assert!(files.len() >= 8, "expected at least 8 template fixtures, found {}", files.len());

    let mut failures = Vec::new();
    let mut compared = 0;
    for file in &files {
        let fixture = read_json(file);
        let reference = fixture["template"].as_str().expect("template");
        let source = if reference.ends_with(".json") {
            read_json(&assets.join(reference))["chat_template"].as_str().expect("chat_template string").to_string()
        } else if assets.join(reference).is_file() {
            std::fs::read_to_string(assets.join(reference)).expect("template")
        } else {
            std::fs::read_to_string(fixtures_dir().join(reference)).expect("stored template")
        };
        assert_eq!(fixture["now"].as_str(), Some("2025-03-14T09:26:53"), "{reference}: fixture time");
        let token = |k: &str| fixture[k].as_str().map(str::to_string);
        let template = ChatTemplate::new(&source, token("bos_token"), token("eos_token"))
            .unwrap_or_else(|e| panic!("{reference}: {e}"))
            .with_fixed_now(fixed_now());
        for case in fixture["cases"].as_array().expect("cases") {
            let name = format!("{reference} [{}]", case["name"].as_str().unwrap_or("?"));
            let conversation = case["conversation"].as_str().expect("conversation");
            let messages = inputs["conversations"][conversation].as_array().expect("known conversation");
            let req = ChatRenderRequest {
                messages,
                tools: case["tools"].as_bool().expect("tools flag").then_some(&tools[..]),
                add_generation_prompt: case["add_generation_prompt"].as_bool().expect("add_generation_prompt"),
                extra: case["extra"].as_object().cloned().unwrap_or_default(),
            };
            compared += 1;
            match (template.render(&req), &case["expected"], &case["expected_raise"]) {
                (Ok(got), Value::String(expected), _) if &got == expected => {}
                (Ok(got), Value::String(expected), _) => {
                    failures.push(format!("{name}: {}", first_difference(expected, &got)))
                }
                (Err(ChatTemplateError::Raised(msg)), _, Value::String(expected)) if &msg == expected => {}
                (got, expected, raised) => failures.push(format!(
                    "{name}: expected {}, got {got:?}",
                    if raised.is_string() {
                        format!("raise_exception({raised})")
                    } else {
                        format!("{} chars of text", expected.as_str().map_or(0, str::len))
                    }
                )),
            }
        }
    }
    assert!(compared >= 40, "only {compared} cases compared");
    assert!(
        failures.is_empty(),
        "{} of {compared} cases differ from transformers:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Small expressions whose Jinja2 output (under HF's settings) the fixtures record: Python
/// spellings of values, Jinja2 tests and filters, Python methods, loop controls, trimming.
#[test]
fn jinja2_semantics_match_transformers() {
    let fixture = read_json(&fixtures_dir().join("jinja2_semantics.json"));
    let mut failures = Vec::new();
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(cases.len() >= 15);
    for case in cases {
        let src = case["src"].as_str().expect("src");
        let expected = case["expected"].as_str().expect("expected");
        match ChatTemplate::new(src, None, None).and_then(|t| t.render(&ChatRenderRequest::default())) {
            Ok(got) if got == expected => {}
            got => failures.push(format!("{src:?}\n  expected {expected:?}\n  got      {got:?}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn render_simple(source: &str) -> Result<String, ChatTemplateError> {
    let messages = simple_conversation();
    ChatTemplate::new(source, Some("<s>".into()), None)?.render(&ChatRenderRequest::new(&messages))
}

#[test]
fn syntax_error_names_the_problem_and_line() {
    let err = ChatTemplate::new("{% for m in messages %}\n{{ m.content }\n{% endfor %}", None, None)
        .expect_err("must not compile");
    let text = err.to_string();
    assert!(matches!(err, ChatTemplateError::Syntax { line: Some(2), .. }), "{text}");
    assert!(text.contains("syntax error") && text.contains("line 2"), "{text}");
    assert!(!text.contains('\n'), "one line: {text}");

    let err = ChatTemplate::new("{% if true %}never closed", None, None).expect_err("unclosed block");
    assert!(err.to_string().contains("syntax error"), "{err}");
}

#[test]
fn raise_exception_carries_the_message() {
    let src = "{% for m in messages %}{% if m.role == 'user' %}{{ raise_exception('Conversation roles must alternate x') }}{% endif %}{% endfor %}";
    match render_simple(src) {
        Err(ChatTemplateError::Raised(msg)) => assert_eq!(msg, "Conversation roles must alternate x"),
        other => panic!("expected Raised, got {other:?}"),
    }
    // Raised from inside a macro, too.
    let src = "{% macro check(m) %}{{ raise_exception('x') }}{% endmacro %}{{ check(messages[0]) }}";
    let err = render_simple(src).expect_err("raises");
    assert!(matches!(&err, ChatTemplateError::Raised(m) if m == "x"), "{err:?}");
    assert!(err.to_string().contains('x'));
}

#[test]
fn render_errors_say_where() {
    let err = render_simple("line one\n{{ messages[0].content.nope.deeper }}").expect_err("undefined attribute");
    let text = err.to_string();
    assert!(matches!(err, ChatTemplateError::Render { line: Some(2), .. }), "{text}");
    assert!(!text.contains('\n'), "{text}");
}

fn render_with(template: &ChatTemplate, messages: &[Value]) -> String {
    template.render(&ChatRenderRequest::new(messages)).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn strftime_now_uses_the_fixed_clock_or_local_time() {
    let src = "{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%Y-%m-%d %H:%M') }}";
    let template = ChatTemplate::new(src, None, None).expect("compiles");
    let live = render_with(&template, &[]);
    let year = chrono::Local::now().format("%Y").to_string();
    assert!(live.contains(&year), "{live}");
    let fixed = template.with_fixed_now(fixed_now());
    assert_eq!(render_with(&fixed, &[]), "14 Mar 2025|2025-03-14 09:26");

    let bad = ChatTemplate::new("{{ strftime_now('%Q') }}", None, None).expect("compiles");
    let err = bad.render(&ChatRenderRequest::default()).expect_err("unknown specifier");
    assert!(err.to_string().contains("strftime_now"), "{err}");
}

#[test]
fn template_variables_are_those_of_apply_chat_template() {
    let src = "{{ tools is none }}|{{ documents is none }}|{{ bos_token is defined }}|{{ eos_token }}|\
               {{ add_generation_prompt }}|{{ enable_thinking }}|{{ reasoning_effort }}|{{ messages|length }}";
    let template = ChatTemplate::new(src, None, Some("</s>".into())).expect("compiles");
    let messages = simple_conversation();
    let mut req = ChatRenderRequest::new(&messages);
    req.extra.insert("enable_thinking".into(), json!(false));
    req.extra.insert("reasoning_effort".into(), json!("high"));
    req.extra.insert("messages".into(), json!("cannot override"));
    assert_eq!(template.render(&req).expect("renders"), "True|True|False|</s>|True|False|high|3");
}

#[test]
fn tool_call_arguments_may_be_a_json_string_or_a_mapping() {
    let dir = assets_dir().join("llama.cpp-models").join("templates");
    let tools = [weather_tool()];
    let as_string = standard_conversation();
    let as_mapping: Vec<Value> = as_string
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if let Some(args) = m.pointer_mut("/tool_calls/0/function/arguments") {
                *args = serde_json::from_str(args.as_str().expect("string arguments")).expect("JSON");
            }
            m
        })
        .collect();
    for name in ["meta-llama-Llama-3.1-8B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja", "google-gemma-4-31B-it.jinja"] {
        let template = compile(&dir.join(name));
        let render = |messages: &[Value]| {
            template.render(&ChatRenderRequest { tools: Some(&tools), ..ChatRenderRequest::new(messages) }).expect(name)
        };
        let out = render(&as_string);
        assert_eq!(out, render(&as_mapping), "{name}");
        assert!(out.contains("Paris") && !out.contains("\\\"city\\\""), "{name}: arguments rendered as a mapping");
    }
    // functionary v3.2 concatenates the arguments as text: the string as sent is used.
    let template = compile(&dir.join("meetkai-functionary-medium-v3.2.jinja"));
    let out = template
        .render(&ChatRenderRequest { tools: Some(&tools), ..ChatRenderRequest::new(&as_string) })
        .expect("renders");
    assert!(out.contains(">>>get_weather\n{\"city\": \"Paris\", \"unit\": \"celsius\"}"), "{out}");
}

#[test]
fn content_parts_are_joined_for_templates_that_print_strings() {
    let smollm2 = std::fs::read_to_string(fixtures_dir().join("smollm2.jinja")).expect("stored SmolLM2 template");
    let template = ChatTemplate::new(&smollm2, None, Some("<|im_end|>".into())).expect("compiles");
    assert!(!template.accepts_content_parts());
    let messages = [
        json!({"role": "system", "content": null}),
        json!({"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "this."}]}),
    ];
    assert_eq!(
        render_with(&template, &messages),
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nDescribe\nthis.<|im_end|>\n<|im_start|>assistant\n"
    );

    let qwen35 = compile(&assets_dir().join("llama.cpp-models/templates/Qwen3.5-4B.jinja"));
    assert!(qwen35.accepts_content_parts(), "Qwen3.5 iterates content parts itself");
}

#[test]
fn bos_emitted_by_the_template_is_reported() {
    let dir = assets_dir().join("llama.cpp-models").join("templates");
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).expect("template");
    let llama =
        ChatTemplate::new(&read("meta-llama-Llama-3.1-8B-Instruct.jinja"), Some("<|begin_of_text|>".into()), None)
            .expect("compiles");
    assert!(llama.renders_bos());
    let out = render_with(&llama, &simple_conversation());
    assert!(llama.starts_with_bos(&out) && out.starts_with("<|begin_of_text|>"));

    let qwen = ChatTemplate::new(&read("Qwen-Qwen2.5-7B-Instruct.jinja"), Some("<|endoftext|>".into()), None)
        .expect("compiles");
    assert!(!qwen.renders_bos());
    let no_bos = ChatTemplate::new(&read("Qwen-Qwen2.5-7B-Instruct.jinja"), None, None).expect("compiles");
    assert!(!no_bos.renders_bos() && !no_bos.starts_with_bos("<s>x"));
}

/// A fresh, empty directory under the system temp dir.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrite-chat-template-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

#[test]
fn model_dir_templates_are_found_like_transformers() {
    let dir = scratch_dir("model-dir");
    assert_eq!(ModelChatTemplates::from_model_dir(&dir).expect("empty dir"), ModelChatTemplates::default());

    let config = json!({
        "bos_token": {"content": "<s>", "lstrip": false},
        "eos_token": "</s>",
        "chat_template": [
            {"name": "default", "template": "D{{ messages|length }}"},
            {"name": "tool_use", "template": "T{{ tools|length }}"}
        ]
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write");
    let found = ModelChatTemplates::from_model_dir(&dir).expect("reads");
    assert_eq!(found.get(None), Some("D{{ messages|length }}"));
    assert_eq!(found.get(Some("tool_use")), Some("T{{ tools|length }}"));
    assert_eq!(found.names(), ["default", "tool_use"]);
    assert_eq!((found.bos_token.as_deref(), found.eos_token.as_deref()), (Some("<s>"), Some("</s>")));
    let messages = simple_conversation();
    assert_eq!(render_with(&found.compile(None).expect("compiles"), &messages), "D3");
    let err = found.compile(Some("rag")).expect_err("no such template");
    assert!(err.to_string().contains("rag") && err.to_string().contains("tool_use"), "{err}");

    // chat_template.jinja overrides the config's default; additional_chat_templates adds names.
    std::fs::write(dir.join("chat_template.jinja"), "J").expect("write");
    std::fs::create_dir_all(dir.join("additional_chat_templates")).expect("mkdir");
    std::fs::write(dir.join("additional_chat_templates/rag.jinja"), "R").expect("write");
    let found = ModelChatTemplates::from_model_dir(&dir).expect("reads");
    assert_eq!(
        (found.get(None), found.get(Some("rag")), found.get(Some("tool_use"))),
        (Some("J"), Some("R"), Some("T{{ tools|length }}"))
    );

    std::fs::write(dir.join("tokenizer_config.json"), "{not json").expect("write");
    let err = ModelChatTemplates::from_model_dir(&dir).expect_err("malformed");
    assert!(
        matches!(err, ChatTemplateError::Config { .. }) && err.to_string().contains("tokenizer_config.json"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);

    // A real tokenizer_config.json with a string template.
    let gemma = ModelChatTemplates::from_model_dir(&assets_dir().join("lenml/gemma3/models")).expect("reads");
    let template = gemma.compile(None).expect("compiles");
    assert_eq!(template.bos_token(), Some("<bos>"));
    assert!(template.renders_bos());
}

#[test]
fn chat_template_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<ChatTemplate>();
}

#[test]
fn a_tag_whose_close_overlaps_its_open_is_an_error_not_a_panic() {
    // Found by the chat_template fuzz target: in `{%}` the `%}` overlaps the `{%`, and
    // stripping `{% generation %}` tags sliced backwards. A GGUF's template is model input.
    for source in ["{%}", "text {%} more", "{%-}{% generation %}x{% endgeneration %}"] {
        assert!(ChatTemplate::new(source, None, None).is_err(), "{source}");
    }
    let t = ChatTemplate::new("{%- generation -%}a{%- endgeneration -%}", None, None).expect("compiles");
    assert_eq!(t.render(&ChatRenderRequest::new(&[])).expect("renders"), "a");
}
