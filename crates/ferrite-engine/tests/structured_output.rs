//! Structured output on the real SmolLM2: every output of 60 JSON schemas (real-world shapes:
//! nested objects, arrays with bounds, enums, `$ref`, string formats, anyOf/oneOf/allOf) parses
//! and validates under greedy and seeded sampling; regex, Lark and choice constraints hold;
//! constrained rows share a batch without changing free rows' tokens; n > 1 forks follow the
//! grammar; bad constraints are typed errors; forced tokens and rollback work; sequences of
//! text, JSON and special tokens (forced tool calls' shape) hold.

mod common;

use std::sync::OnceLock;

use common::*;
use ferrite_engine::structured::Guide;
use ferrite_engine::{
    Constraint, EngineConfig, EngineCore, EngineError, FinishReason, GuideError, Output, Piece, Request, RequestParams,
    SamplingParams,
};
use ferrite_models::tokenizer::Tokenizer;
use ferrite_models::{paths, registry, LoadedModel};
use serde_json::Value;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

fn smollm2() -> &'static LoadedModel {
    static MODEL: OnceLock<LoadedModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = registry::resolve("smollm2", &paths::models_dir()).expect("smollm2 (run `ferrite pull smollm2`)");
        ferrite_models::load(&path).expect("load smollm2")
    })
}

fn tokenizer() -> &'static Tokenizer {
    smollm2().tokenizer.as_deref().expect("tokenizer")
}

/// A core over SmolLM2 with its tokenizer and end tokens.
fn guided_core(max_num_seqs: usize) -> EngineCore {
    let m = smollm2();
    let cfg = EngineConfig { max_model_len: Some(768), max_num_seqs, ..EngineConfig::default() };
    EngineCore::new(m.model.clone(), m.tokenizer.clone(), m.eos_token_ids(), &cfg).expect("engine core")
}

/// SmolLM2's chat format around one user message.
fn chat(user: &str) -> Vec<u32> {
    let text = format!("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n");
    tokenizer().encode(&text, false).expect("encode")
}

fn constrained(max_tokens: usize, constraint: Constraint, sampling: SamplingParams) -> RequestParams {
    RequestParams { max_tokens: Some(max_tokens), constraint: Some(constraint), sampling, ..Default::default() }
}

fn greedy_sampling() -> SamplingParams {
    SamplingParams::default()
}

fn seeded_sampling(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.8, top_p: 0.95, seed, ..Default::default() }
}

/// One finished choice: its text, tokens and ending.
struct Done {
    text: String,
    tokens: Vec<u32>,
    reason: FinishReason,
    error: Option<String>,
}

fn add_to(core: &mut EngineCore, id: u64, prompt: Vec<u32>, params: RequestParams) -> UnboundedReceiver<Output> {
    let (tx, rx) = unbounded_channel();
    core.add_request(id, Request { prompt, params }, tx).expect("valid request");
    rx
}

fn finish(rx: &mut UnboundedReceiver<Output>, n: usize) -> Vec<Done> {
    let mut out: Vec<Done> = (0..n)
        .map(|_| Done { text: String::new(), tokens: vec![], reason: FinishReason::Abort, error: None })
        .collect();
    let mut ended = 0;
    while let Ok(o) = rx.try_recv() {
        let d = &mut out[o.choice];
        d.text.push_str(&o.text);
        d.tokens.extend(&o.token_ids);
        if let Some(f) = o.finished {
            d.reason = f.reason;
            d.error = f.error;
            ended += 1;
        }
    }
    assert_eq!(ended, n, "every choice finishes once");
    out
}

/// Run `requests` together on one core; one result per request (first choice).
fn run_batch(requests: Vec<(Vec<u32>, RequestParams)>) -> Vec<Done> {
    let mut core = guided_core(requests.len().max(1));
    let mut rxs: Vec<_> =
        requests.into_iter().enumerate().map(|(i, (p, params))| add_to(&mut core, i as u64, p, params)).collect();
    run_to_end(&mut core);
    rxs.iter_mut().map(|rx| finish(rx, 1).remove(0)).collect()
}

fn schemas() -> Vec<Value> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/structured/schemas.json");
    let all: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("schemas.json")).expect("json");
    all.as_array().expect("a list").clone()
}

#[test]
fn every_json_schema_output_validates() {
    let cases = schemas();
    assert!(cases.len() >= 50, "at least 50 schemas");
    let mut requests = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let schema = case["schema"].clone();
        let prompt = chat(&format!("Reply in JSON with {}.", case["task"].as_str().expect("task")));
        let c = Constraint::JsonSchema(schema);
        // A 135M model falls into digit and syllable loops inside unbounded numbers and
        // strings; a mild repetition penalty keeps it out (the grammar still decides).
        let greedy = SamplingParams { repetition_penalty: 1.15, ..greedy_sampling() };
        let seeded = SamplingParams { repetition_penalty: 1.15, ..seeded_sampling(i as u64) };
        requests.push((prompt.clone(), constrained(160, c.clone(), greedy)));
        requests.push((prompt, constrained(160, c, seeded)));
    }
    let results = run_batch(requests);
    let mut failures = Vec::new();
    for (k, done) in results.iter().enumerate() {
        let case = &cases[k / 2];
        let name = case["name"].as_str().expect("name");
        let mode = if k % 2 == 0 { "greedy" } else { "seeded" };
        let validator =
            jsonschema::options().should_validate_formats(true).build(&case["schema"]).expect("a valid schema");
        if done.reason != FinishReason::Stop {
            failures.push(format!("{name} ({mode}): ended {:?} {:?}: {}", done.reason, done.error, done.text));
            continue;
        }
        match serde_json::from_str::<Value>(&done.text) {
            Err(e) => failures.push(format!("{name} ({mode}): not JSON ({e}): {}", done.text)),
            Ok(v) => {
                let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
                if !errors.is_empty() {
                    failures.push(format!("{name} ({mode}): {errors:?}: {}", done.text));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} outputs failed:\n{}", failures.len(), results.len(), failures.join("\n"));
}

#[test]
fn regex_lark_and_choice_constraints_hold() {
    let regex = r"[0-9]{3}-[0-9]{4}";
    let lark = r#"
        start: "The answer is " ANSWER "."
        ANSWER: /(yes|no|maybe)/
    "#;
    let choices = vec!["Paris".to_string(), "London".to_string(), "Rome".to_string()];
    let mut requests = Vec::new();
    for sampling in [greedy_sampling(), seeded_sampling(7), seeded_sampling(8)] {
        requests.push((
            chat("Give me a phone number."),
            constrained(40, Constraint::Regex(regex.into()), sampling.clone()),
        ));
        requests.push((chat("Is the sky green?"), constrained(40, Constraint::Lark(lark.into()), sampling.clone())));
        requests.push((chat("Capital of France?"), constrained(20, Constraint::Choice(choices.clone()), sampling)));
    }
    // Any object at all: at temperature > 0 a 135M model rambles through keys, so greedy only.
    let ask = "Repeat this JSON object exactly: {\"animal\": \"cat\", \"legs\": 4}";
    requests.push((chat(ask), constrained(120, Constraint::JsonObject, greedy_sampling())));
    let results = run_batch(requests);
    let rx = |pattern: &str, text: &str| matches_whole(&format!("^(?:{pattern})$"), text);
    for (k, done) in results.iter().enumerate() {
        assert_eq!(done.reason, FinishReason::Stop, "case {k} ended {:?}: {:?}", done.reason, done.text);
        match (k == results.len() - 1, k % 3) {
            (true, _) => {
                let v: Value = serde_json::from_str(&done.text).unwrap_or_else(|e| panic!("{e}: {}", done.text));
                assert!(v.is_object(), "json_object output {:?}", done.text);
            }
            (_, 0) => assert!(rx(regex, &done.text), "regex output {:?}", done.text),
            (_, 1) => assert!(rx(r"The answer is (yes|no|maybe)\.", &done.text), "lark output {:?}", done.text),
            _ => assert!(choices.contains(&done.text), "choice output {:?}", done.text),
        }
    }
}

/// A sequence constraint (the shape of a forced tool call): one of two alternatives, each
/// text with quotes in it, JSON under its schema, then a special token (the end token here,
/// so the row stops on it). The output is exactly one alternative.
#[test]
fn sequences_of_text_json_and_tokens_hold() {
    let eos = smollm2().eos_token_ids()[0];
    let schema =
        |key: &str| serde_json::json!({"type": "object", "required": [key], "properties": {key: {"type": "integer"}}});
    let alt = |name: &str, key: &str| {
        vec![Piece::Text(format!("{name}\", \"args\": ")), Piece::Json(schema(key)), Piece::Token(eos)]
    };
    let constraint = Constraint::Sequences(vec![alt("add\"one", "n"), alt("sub", "m")]);
    let prompt = chat("Call a tool.");
    let results = run_batch(vec![
        (prompt.clone(), constrained(40, constraint.clone(), greedy_sampling())),
        (prompt, constrained(40, constraint, seeded_sampling(3))),
    ]);
    for done in results {
        assert_eq!(done.reason, FinishReason::Stop, "{:?}: {:?}", done.text, done.error);
        assert_eq!(done.tokens.last(), Some(&eos), "{:?}", done.text);
        let (name, key) = if done.text.starts_with("add\"one") { ("add\"one", "n") } else { ("sub", "m") };
        let args =
            done.text.strip_prefix(&format!("{name}\", \"args\": ")).unwrap_or_else(|| panic!("{:?}", done.text));
        let v: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{e}: {:?}", done.text));
        assert!(jsonschema::validator_for(&schema(key)).expect("schema").is_valid(&v), "{:?}", done.text);
    }
}

/// Whether `text` matches `pattern`, through the jsonschema crate's `pattern` keyword (a real
/// regex engine), so the test needs no extra regex dependency.
fn matches_whole(pattern: &str, text: &str) -> bool {
    let schema = serde_json::json!({"type": "string", "pattern": pattern});
    jsonschema::validator_for(&schema).expect("pattern").is_valid(&Value::from(text))
}

#[test]
fn free_rows_are_unchanged_by_constrained_neighbours() {
    let free_prompts = [chat("Write a haiku about rust."), chat("Count from one to ten.")];
    let free: Vec<RequestParams> = vec![
        RequestParams { max_tokens: Some(24), ..Default::default() },
        RequestParams { max_tokens: Some(24), sampling: seeded_sampling(3), ..Default::default() },
    ];
    let alone: Vec<Vec<u32>> = free_prompts
        .iter()
        .zip(&free)
        .map(|(p, params)| run_batch(vec![(p.clone(), params.clone())]).remove(0).tokens)
        .collect();
    let schema = serde_json::json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
    let mut mixed = vec![
        (chat("A number in JSON."), constrained(30, Constraint::JsonSchema(schema), greedy_sampling())),
        (free_prompts[0].clone(), free[0].clone()),
        (chat("Pick one."), constrained(10, Constraint::Choice(vec!["a".into(), "b".into()]), seeded_sampling(1))),
        (free_prompts[1].clone(), free[1].clone()),
    ];
    mixed.push((chat("Digits."), constrained(12, Constraint::Regex("[0-9]{5}".into()), greedy_sampling())));
    let results = run_batch(mixed);
    assert_eq!(results[1].tokens, alone[0], "greedy free row changed in a mixed batch");
    assert_eq!(results[3].tokens, alone[1], "seeded free row changed in a mixed batch");
    assert!(results[0].text.starts_with("{\"n\": "), "{:?}", results[0].text);
    assert!(["a", "b"].contains(&results[2].text.as_str()), "{:?}", results[2].text);
    assert_eq!(results[4].text.len(), 5, "{:?}", results[4].text);
}

#[test]
fn forked_choices_each_follow_the_grammar() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"animal": {"enum": ["cat", "dog", "cow", "owl"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
        "required": ["animal", "legs"]
    });
    let mut core = guided_core(8);
    let params = RequestParams { n: 4, ..constrained(40, Constraint::JsonSchema(schema.clone()), seeded_sampling(11)) };
    let mut rx = add_to(&mut core, 1, chat("An animal in JSON."), params);
    run_to_end(&mut core);
    let validator = jsonschema::validator_for(&schema).expect("schema");
    for d in finish(&mut rx, 4) {
        assert_eq!(d.reason, FinishReason::Stop, "{:?}", d.text);
        let v: Value = serde_json::from_str(&d.text).unwrap_or_else(|e| panic!("{e}: {}", d.text));
        assert!(validator.is_valid(&v), "{v}");
    }
}

#[test]
fn bad_constraints_are_typed_errors() {
    let mut core = guided_core(1);
    let bad = [
        Constraint::JsonSchema(serde_json::json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})),
        Constraint::JsonSchema(serde_json::json!({"type": "strange"})),
        Constraint::Regex("(unclosed".into()),
        Constraint::Lark("start: undefined_rule".into()),
        Constraint::Choice(vec![]),
    ];
    for c in bad {
        let (tx, _rx) = unbounded_channel();
        let req = Request { prompt: chat("hi"), params: constrained(8, c.clone(), greedy_sampling()) };
        match core.add_request(1, req, tx) {
            Err(EngineError::Guide(GuideError::Compile(msg))) => assert!(!msg.is_empty(), "{c:?}"),
            other => panic!("{c:?} gave {other:?}"),
        }
    }
    // A core without a tokenizer cannot constrain.
    let m = smollm2();
    let mut bare = EngineCore::new(m.model.clone(), None, vec![], &EngineConfig::default()).expect("core");
    let (tx, _rx) = unbounded_channel();
    let req = Request { prompt: vec![1, 2], params: constrained(8, Constraint::JsonObject, greedy_sampling()) };
    assert!(matches!(bare.add_request(1, req, tx), Err(EngineError::Guide(GuideError::NoTokenizer))));
}

#[test]
fn forced_tokens_commit_and_rollback() {
    let core = guided_core(1);
    let grammars = core.grammars();
    let phrase = "The quick brown fox";
    let mut guide: Guide = grammars.compile(&Constraint::Choice(vec![phrase.into()])).expect("compiles");
    let forced = guide.forced_tokens();
    assert_eq!(forced, tokenizer().encode(phrase, false).expect("encode"), "a single choice is wholly forced");
    guide.commit(&forced[..2]).expect("commit");
    assert_eq!(guide.forced_tokens(), forced[2..].to_vec());
    guide.rollback(2).expect("rollback");
    assert_eq!(guide.forced_tokens(), forced, "rollback restores the start");
    guide.commit(&forced).expect("commit all");
    assert!(guide.is_finished());
    // A schema forces its fixed opening.
    let schema =
        serde_json::json!({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]});
    let mut guide = grammars.compile(&Constraint::JsonSchema(schema)).expect("compiles");
    let text = tokenizer().decode(&guide.forced_tokens(), false).expect("decode");
    assert!(text.len() >= "{\"name\":".len() && "{\"name\": \"".starts_with(&text), "forced {text:?}");
    // A free choice forces nothing, and a token outside the grammar is refused.
    let mut guide = grammars.compile(&Constraint::Choice(vec!["yes".into(), "no".into()])).expect("compiles");
    assert!(guide.forced_tokens().is_empty());
    let bad = tokenizer().encode("maybe", false).expect("encode");
    assert!(guide.commit(&bad).is_err());
}

/// Fill strict on a constrained row: the tokens the grammar forces (keys, punctuation) are
/// appended without sampling, so the request takes fewer forward passes, and its output is
/// plain decoding's, token for token — alone, batched with a free row, and again over the
/// prefix cache the first batch left.
#[test]
fn fill_strict_asserts_grammar_forced_tokens() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
            "country": {"type": "string", "enum": ["France"]}
        },
        "required": ["city", "population_millions", "country"]
    });
    let prompt = chat("Give the capital of France and its population in JSON.");
    let validator = jsonschema::validator_for(&schema).expect("schema");
    let mut runs = Vec::new();
    for fill in [ferrite_engine::FillMode::Off, ferrite_engine::FillMode::Strict] {
        let mut core = guided_core(1);
        let params = RequestParams {
            fill: Some(fill),
            ..constrained(64, Constraint::JsonSchema(schema.clone()), greedy_sampling())
        };
        let mut rx = add_to(&mut core, 1, prompt.clone(), params);
        run_to_end(&mut core);
        let (mut text, mut tokens, mut injected) = (String::new(), Vec::new(), None);
        while let Ok(o) = rx.try_recv() {
            text.push_str(&o.text);
            tokens.extend(o.token_ids);
            if let Some(f) = o.finished {
                assert_eq!(f.reason, FinishReason::Stop, "{fill:?}: {:?}", f.error);
                injected = Some(f.usage.fill.injected_tokens);
            }
        }
        let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{fill:?}: {text:?}: {e}"));
        assert!(validator.is_valid(&value), "{fill:?}: {text}");
        let steps = core.metrics().steps.load(std::sync::atomic::Ordering::Relaxed);
        runs.push((tokens, injected.expect("finished"), steps));
    }
    let ((plain, off_injected, off_steps), (strict, strict_injected, strict_steps)) = (&runs[0], &runs[1]);
    assert_eq!(strict, plain, "fill strict changed the output");
    assert_eq!(*off_injected, 0, "fill off asserts nothing");
    assert!(*strict_injected > 0, "the grammar forces keys and punctuation");
    assert_eq!(strict_steps + *strict_injected as u64, *off_steps, "one forward pass saved per asserted token");

    let free_prompt = chat("Name a river.");
    let free = RequestParams { max_tokens: Some(16), ..Default::default() };
    let free_alone = run_batch(vec![(free_prompt.clone(), free.clone())]).remove(0).tokens;
    let mut core = guided_core(2);
    for round in 0..2 {
        let params = RequestParams {
            fill: Some(ferrite_engine::FillMode::Strict),
            ..constrained(64, Constraint::JsonSchema(schema.clone()), greedy_sampling())
        };
        let mut rx = add_to(&mut core, 10 * round, prompt.clone(), params);
        let mut free_rx = add_to(&mut core, 10 * round + 1, free_prompt.clone(), free.clone());
        run_to_end(&mut core);
        assert_eq!(&finish(&mut rx, 1).remove(0).tokens, plain, "batched, round {round}");
        assert_eq!(finish(&mut free_rx, 1).remove(0).tokens, free_alone, "the free row, round {round}");
    }
    assert!(core.metrics().prefix_hit_rate() > 0.0, "no prefix hit");
}

/// The grammar constrains verification: a constrained request with prompt-lookup speculation,
/// or with a draft model (SmolLM2 as its own draft, which drafts without the grammar), gives,
/// at temperature 0, exactly the tokens it gives without, and drafts were verified.
#[test]
fn speculation_on_constrained_rows_equals_plain() {
    let schema = serde_json::json!({
        "type": "array",
        "minItems": 3,
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 10}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["name", "score"]
        }
    });
    let prompt = chat("List three players with a name and a score from 0 to 9, in JSON.");
    let mut outputs = Vec::new();
    let m = smollm2();
    let methods = [
        ferrite_engine::Speculation::Off,
        ferrite_engine::Speculation::Ngram,
        ferrite_engine::Speculation::Draft(m.model.clone()),
    ];
    for speculation in methods {
        let cfg = EngineConfig { max_model_len: Some(768), max_num_seqs: 1, speculation, ..EngineConfig::default() };
        let mut core = EngineCore::new(m.model.clone(), m.tokenizer.clone(), m.eos_token_ids(), &cfg).expect("core");
        let params = constrained(96, Constraint::JsonSchema(schema.clone()), greedy_sampling());
        let mut rx = add_to(&mut core, 1, prompt.clone(), params);
        run_to_end(&mut core);
        let done = finish(&mut rx, 1).remove(0);
        assert_eq!(done.reason, FinishReason::Stop, "{:?}", done.error);
        let proposed = core.metrics().verify_proposed_tokens.load(std::sync::atomic::Ordering::Relaxed);
        outputs.push((done.tokens, done.text, proposed));
    }
    let value: Value = serde_json::from_str(&outputs[0].1).expect("JSON");
    assert!(jsonschema::validator_for(&schema).expect("schema").is_valid(&value), "{}", outputs[0].1);
    assert_eq!(outputs[0].2, 0);
    for (name, (tokens, _, proposed)) in ["prompt lookup", "draft model"].iter().zip(&outputs[1..]) {
        assert!(*proposed > 0, "{name} proposed nothing");
        assert_eq!(tokens, &outputs[0].0, "{name} changed a constrained greedy output");
    }
}
