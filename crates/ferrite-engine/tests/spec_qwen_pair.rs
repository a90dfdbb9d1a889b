//! Draft-model speculation on the real pair (`ferrite pull qwen2.5-coder-1.5b` and
//! `qwen2.5-coder-0.5b`): the 1.5B target with the 0.5B as its draft gives, at temperature 0,
//! exactly the 1.5B's plain-decode tokens — one request alone, two batched, and the same two
//! again over a warm prefix cache — while the draft's tokens are mostly accepted and some
//! rejected (so rollbacks happen).
//!
//! Its own test binary: it runs the fast quantized kernels (the default), which give the same
//! logits for a row whatever the step's shape, while other binaries pin the exact f32
//! reference kernels for the whole process.

mod common;

use std::sync::atomic::Ordering::Relaxed;

use common::*;
use ferrite_engine::{EngineConfig, Output, SpecUsage, Speculation};
use ferrite_models::chat_template::ChatRenderRequest;
use ferrite_models::{paths, registry, LoadedModel};
use serde_json::json;
use tokio::sync::mpsc::UnboundedReceiver;

fn load(name: &str) -> LoadedModel {
    let path =
        registry::resolve(name, &paths::models_dir()).unwrap_or_else(|_| panic!("{name} (run `ferrite pull {name}`)"));
    ferrite_models::load(&path).expect("load")
}

fn chat(m: &LoadedModel, content: &str) -> Vec<u32> {
    let messages = [json!({"role": "user", "content": content})];
    let req =
        ChatRenderRequest { messages: &messages, tools: None, add_generation_prompt: true, extra: Default::default() };
    let text = m.chat_template.as_ref().expect("chat template").render(&req).expect("render");
    m.tokenizer.as_ref().expect("tokenizer").encode(&text, false).expect("encode")
}

/// A finished request's tokens and its speculation usage.
fn tokens_and_usage(rx: &mut UnboundedReceiver<Output>) -> (Vec<u32>, SpecUsage) {
    let (mut toks, mut usage) = (Vec::new(), None);
    while let Ok(o) = rx.try_recv() {
        toks.extend(o.token_ids);
        usage = o.finished.map(|f| f.usage.speculation).or(usage);
    }
    (toks, usage.expect("finished"))
}

#[test]
fn qwen_1_5b_with_0_5b_draft_equals_plain() {
    let target = load("qwen2.5-coder-1.5b");
    let draft = load("qwen2.5-coder-0.5b");
    let prompts = [
        chat(&target, "Rename `total` to `sum` in:\ndef f(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total\n"),
        chat(&target, "Write a Python function that returns the square of a number."),
    ];
    let params = greedy(20);
    let base = EngineConfig { max_model_len: Some(512), max_num_seqs: 4, ..EngineConfig::default() };
    let plain: Vec<Vec<u32>> =
        prompts.iter().map(|p| alone(&target.model, base.clone(), p.clone(), params.clone()).remove(0)).collect();
    let spec = EngineConfig { speculation: Speculation::Draft(draft.model.clone()), num_draft_tokens: 4, ..base };

    // Alone.
    let mut c = core(&target.model, spec.clone());
    let mut rx = add(&mut c, 0, prompts[0].clone(), params.clone());
    run_to_end(&mut c);
    assert_eq!(collect(&mut rx, 1)[0], plain[0], "alone");

    // Batched, then the same requests again over the prefix cache the first round left.
    let mut usage = SpecUsage::default();
    for round in ["batched", "prefix hits"] {
        let mut rxs: Vec<_> =
            prompts.iter().enumerate().map(|(i, p)| add(&mut c, 10 + i as u64, p.clone(), params.clone())).collect();
        let before = c.metrics().steps.load(Relaxed);
        run_to_end(&mut c);
        for (i, rx) in rxs.iter_mut().enumerate() {
            let (toks, spec) = tokens_and_usage(rx);
            assert_eq!(toks, plain[i], "{round}: request {i}");
            usage = usage + spec;
        }
        assert!(c.metrics().steps.load(Relaxed) > before, "{round}");
    }
    assert!(c.metrics().prefix_hit_rate() > 0.0, "no prefix hit");
    assert!(usage.accepted > 0 && usage.accepted < usage.drafted, "drafts accepted and rejected: {usage:?}");
    let (free, total) = c.kv_manager().free_blocks();
    assert_eq!(free, total, "KV blocks leaked");
}
