//! The text an engine streams for a prompt that has a tokenizer (issue 25, defect 9): the
//! first token is detokenized in the prompt's context, so a SentencePiece `▁word` keeps its
//! leading space and `decode(prompt) + streamed text == decode(prompt + generated)`; text held
//! back (an incomplete character, a possible stop string's start) comes out at the end.
//!
//! The tiny llama fixture (307 ids) runs with Llama 2's SentencePiece `tokenizer.json`, whose
//! first 307 ids are `<unk>`, `<s>`, `</s>`, the 256 byte pieces and short pieces (`▁the` is
//! 272). A logit bias of 100 makes the fixture pick the token the test names.

mod common;

use std::sync::Arc;

use common::*;
use ferrite_engine::{EngineConfig, EngineCore, FinishReason, Request, RequestParams, SamplingParams};
use ferrite_models::tokenizer::Tokenizer;
use tokio::sync::mpsc::unbounded_channel;

fn llama2_tokenizer() -> Arc<Tokenizer> {
    let path = ferrite_models::paths::test_assets_dir().join("lenml/llama2/models/tokenizer.json");
    Arc::new(Tokenizer::from_file(&path).unwrap_or_else(|e| panic!("{e} (run scripts/fetch_test_assets.sh)")))
}

/// `<s>` and the byte pieces of `text`: ids the fixture knows.
fn byte_prompt(tok: &Tokenizer, text: &str) -> Vec<u32> {
    let bytes = text.bytes().map(|b| tok.token_to_id(&format!("<0x{b:02X}>")).expect("byte piece"));
    std::iter::once(1).chain(bytes).collect()
}

/// Run `params` after `prompt`; per choice, the generated ids and the streamed text, and the
/// finish reason of choice 0.
fn run(tok: &Arc<Tokenizer>, prompt: &[u32], params: RequestParams) -> (Vec<(Vec<u32>, String)>, FinishReason) {
    let (model, _) = load_fixture("llama");
    let mut core = EngineCore::new(model, Some(tok.clone()), vec![2], &EngineConfig::default()).expect("engine core");
    let (tx, mut rx) = unbounded_channel();
    let n = params.n;
    core.add_request(1, Request { prompt: prompt.to_vec(), params }, tx).expect("valid request");
    run_to_end(&mut core);
    let mut out = vec![(Vec::new(), String::new()); n];
    let mut reason = None;
    while let Ok(o) = rx.try_recv() {
        out[o.choice].0.extend(&o.token_ids);
        out[o.choice].1.push_str(&o.text);
        if o.choice == 0 {
            reason = o.finished.map(|f| f.reason).or(reason);
        }
    }
    (out, reason.expect("choice 0 finished"))
}

fn biased(token: u32, max_tokens: usize) -> RequestParams {
    RequestParams {
        sampling: SamplingParams { logit_bias: vec![(token, 100.0)], ..Default::default() },
        ..greedy(max_tokens)
    }
}

#[test]
fn the_first_token_keeps_its_leading_space() {
    let tok = llama2_tokenizer();
    let the = tok.token_to_id("▁the").expect("▁the");
    let prompt = byte_prompt(&tok, "The capital of France is");
    assert_eq!(tok.decode(&prompt, true).unwrap(), "The capital of France is");
    // Two choices: the forked one is detokenized after the prompt too.
    let (out, reason) = run(&tok, &prompt, RequestParams { n: 2, ..biased(the, 3) });
    assert_eq!(reason, FinishReason::Length);
    for (ids, text) in out {
        assert_eq!(ids, vec![the; 3]);
        assert_eq!(text, " the the the");
        let all: Vec<u32> = prompt.iter().chain(&ids).copied().collect();
        assert_eq!(format!("The capital of France is{text}"), tok.decode(&all, true).unwrap());
    }
}

#[test]
fn held_text_comes_out_at_an_end_token() {
    let tok = llama2_tokenizer();
    let (the, a) = (tok.token_to_id("▁the").expect("▁the"), tok.token_to_id("▁a").expect("▁a"));
    let prompt = byte_prompt(&tok, "Once upon a time");
    // `▁the` is banned for 3 tokens (min_tokens), so `▁a` (bias 50) comes first; then `▁the`
    // (bias 100) wins and ends the choice.
    let mut params = RequestParams { stop_token_ids: vec![the], min_tokens: 3, ..biased(the, 8) };
    params.sampling.logit_bias.push((a, 50.0));
    let (out, reason) = run(&tok, &prompt, params.clone());
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(out[0], (vec![a, a, a, the], " a a a".to_string()));
    // A stop string that the whole text begins is held back until the end token releases it
    // (it used to be dropped).
    let (held, reason) = run(&tok, &prompt, RequestParams { stop: vec![" a a a never".into()], ..params });
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(held[0], out[0]);
}
