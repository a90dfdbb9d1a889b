//! Speculation and fill on real weights (`ferrite pull smollm2`, `qwen2.5-coder-0.5b`): at
//! temperature 0 prompt lookup, echo fill and draft models (SmolLM2 as its own draft and cut
//! to its first 20 layers) give exactly plain decoding's tokens on a prompt whose answer
//! repeats it, with lookups that are right; and a tool call under `--fill strict` (Qwen's
//! scaffold, found from its chat template) equals plain decoding in fewer forward passes —
//! alone, batched with a plain row, over the prefix cache, and with the next step queued
//! before the host reads a pick (as on the GPU).
//!
//! The kernels run in `KernelMode::Reference` (exact f32 math): the fast quantized kernels
//! are not yet batch-invariant for steps of 8 or more tokens, and a verify step is one.

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};

use common::queued::Queueing;
use common::*;
use ferrite_engine::fill::{ScaffoldCursor, ToolScaffold};
use ferrite_engine::{EngineConfig, EngineCore, FillMode, RequestParams, Speculation, Usage};
use ferrite_models::chat_template::ChatRenderRequest;
use ferrite_models::{paths, registry, LoadOptions, LoadedModel};
use ferrite_runtime::cpu::{set_kernel_mode, KernelMode};
use ferrite_runtime::cuda::DeviceChoice;
use serde_json::{json, Value};
use tokio::sync::mpsc::unbounded_channel;

fn load(name: &str, opts: LoadOptions) -> LoadedModel {
    set_kernel_mode(KernelMode::Reference);
    let path =
        registry::resolve(name, &paths::models_dir()).unwrap_or_else(|_| panic!("{name} (run `ferrite pull {name}`)"));
    ferrite_models::load_with(&path, DeviceChoice::Cpu, &opts).expect("load")
}

fn smollm2() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| load("smollm2", LoadOptions::default()))
}

fn chat_ids(m: &LoadedModel, messages: &[Value], tools: Option<&[Value]>) -> Vec<u32> {
    let tmpl = m.chat_template.as_ref().expect("chat template");
    let req = ChatRenderRequest { messages, tools, add_generation_prompt: true, extra: Default::default() };
    let text = tmpl.render(&req).expect("render");
    m.tokenizer.as_ref().expect("tokenizer").encode(&text, false).expect("encode")
}

/// Run `prompt` on a fresh core over `m` with `cfg`: (tokens, usage, forward passes).
fn run(m: &LoadedModel, cfg: EngineConfig, prompt: Vec<u32>, params: RequestParams) -> (Vec<u32>, Usage, u64) {
    let mut core = EngineCore::new(m.model.clone(), m.tokenizer.clone(), m.eos_token_ids(), &cfg).expect("core");
    let (tx, mut rx) = unbounded_channel();
    core.add_request(1, ferrite_engine::Request { prompt, params }, tx).expect("request");
    run_to_end(&mut core);
    let (mut toks, mut usage) = (Vec::new(), None);
    while let Ok(o) = rx.try_recv() {
        toks.extend(o.token_ids);
        usage = o.finished.map(|f| f.usage).or(usage);
    }
    (toks, usage.expect("finished"), core.metrics().steps.load(Relaxed))
}

fn base_cfg() -> EngineConfig {
    EngineConfig { max_model_len: Some(1024), max_num_seqs: 4, ..EngineConfig::default() }
}

#[test]
fn smollm2_speculation_and_echo_equal_plain() {
    let m = smollm2();
    let code = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n";
    let msg = json!({"role": "user", "content": format!("Rename the function add to plus in this code:\n{code}")});
    let prompt = chat_ids(m, &[msg], None);
    let params = RequestParams { max_tokens: Some(40), ..Default::default() };
    let (plain, _, plain_steps) = run(m, base_cfg(), prompt.clone(), params.clone());
    let weak = load("smollm2", LoadOptions { max_layers: Some(20), ..Default::default() }).model;
    let cases = [
        ("ngram", EngineConfig { speculation: Speculation::Ngram, ..base_cfg() }, None),
        ("echo", base_cfg(), Some(FillMode::Echo)),
        ("self draft", EngineConfig { speculation: Speculation::Draft(m.model.clone()), ..base_cfg() }, None),
        ("weak draft", EngineConfig { speculation: Speculation::Draft(weak), num_draft_tokens: 3, ..base_cfg() }, None),
    ];
    for (name, cfg, fill) in cases {
        let (toks, usage, steps) = run(m, cfg, prompt.clone(), RequestParams { fill, ..params.clone() });
        assert_eq!(toks, plain, "{name}");
        let (s, f) = (usage.speculation, usage.fill);
        match name {
            "echo" => assert!(f.verify_accepted > 0 && steps < plain_steps, "{name}: {f:?}, {steps} steps"),
            "self draft" => assert_eq!(s.accepted, s.drafted, "{name}"),
            "weak draft" => assert!(s.accepted > 0 && s.accepted < s.drafted, "{name}: {s:?}"),
            _ => assert!(s.accepted > 0 && steps < plain_steps, "{name}: {s:?}, {steps} steps"),
        }
    }
}

#[test]
fn qwen_tool_call_fill_strict_equals_plain_in_fewer_passes() {
    let m = load("qwen2.5-coder-0.5b", LoadOptions::default());
    let tok = m.tokenizer.as_ref().expect("tokenizer");
    let scaffold = ToolScaffold::discover(m.chat_template.as_ref().expect("template"), tok, &m.eos_token_ids())
        .expect("Qwen's template has a tool-call scaffold");
    let runs: Vec<String> = scaffold.runs().iter().map(|r| tok.decode(r, false).expect("decode")).collect();
    assert_eq!(runs, ["<tool_call>\n{\"name\": \"", "\", \"arguments\":", "</tool_call>"]);
    let tools = [json!({"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})];
    // As with a forced tool choice, the prompt ends with the call's opening (this model
    // rarely opens one by itself): the name, then the scaffold's later runs, are generated.
    let msg = json!({"role": "user", "content": "What is the weather in Paris?"});
    let mut prompt = chat_ids(&m, &[msg], Some(&tools));
    // The system prompt shows the call syntax (`<tool_call>\n{"name": <function-name>, …`):
    // that opens no call, so a plain answer is not asserted into.
    assert_eq!(scaffold.cursor_after(&prompt), ScaffoldCursor::default());
    prompt.extend(tok.encode(&runs[0], false).expect("encode"));
    assert_ne!(scaffold.cursor_after(&prompt), ScaffoldCursor::default(), "the prompt opens a call");
    let params = RequestParams { max_tokens: Some(40), ..Default::default() };
    let cfg = EngineConfig { tool_scaffold: Some(Arc::new(scaffold)), ..base_cfg() };
    let (plain, _, plain_steps) = run(&m, cfg.clone(), prompt.clone(), params.clone());
    let text = tok.decode(&plain, false).expect("decode");
    assert!(text.starts_with("get_weather\", \"arguments\":"), "{text}");
    let strict_params = RequestParams { fill: Some(FillMode::Strict), ..params.clone() };
    let (strict, usage, steps) = run(&m, cfg.clone(), prompt.clone(), strict_params.clone());
    assert_eq!(strict, plain, "{text}");
    assert!(usage.fill.injected_tokens >= 3, "{:?}", usage.fill);
    assert_eq!(steps + usage.fill.injected_tokens as u64, plain_steps, "one pass saved per asserted token");
    // Through a model that queues steps as the GPU does: the scaffold's runs are asserted
    // after picks the host had not read when the step after them was queued.
    let queued = Queueing::new(m.model.clone());
    let mut core = EngineCore::new(queued.clone(), m.tokenizer.clone(), m.eos_token_ids(), &cfg).expect("core");
    let (tx, mut rx) = unbounded_channel();
    let req = ferrite_engine::Request { prompt: prompt.clone(), params: strict_params.clone() };
    core.add_request(1, req, tx).expect("request");
    run_to_end(&mut core);
    assert_eq!(collect(&mut rx, 1)[0], plain, "overlapped");
    assert!(queued.carried_steps() > 0, "no step overlapped");
    // Batched with a plain row of the same prompt, then again over the prefix cache.
    let mut core = EngineCore::new(m.model.clone(), m.tokenizer.clone(), m.eos_token_ids(), &cfg).expect("core");
    for round in 0..2u64 {
        let mut rxs: Vec<_> = [&strict_params, &params]
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let (tx, rx) = unbounded_channel();
                let req = ferrite_engine::Request { prompt: prompt.clone(), params: p.clone() };
                core.add_request(10 * round + i as u64, req, tx).expect("request");
                rx
            })
            .collect();
        run_to_end(&mut core);
        for rx in &mut rxs {
            assert_eq!(collect(rx, 1)[0], plain, "batched, round {round}");
        }
    }
    assert!(core.metrics().prefix_hit_rate() > 0.0, "no prefix hit");
}
