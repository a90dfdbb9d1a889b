//! Real weights: SmolLM2-135M-Instruct Q4_1 through ferrite's engine must reproduce
//! transformers' greedy continuations token for token (transformers loads the same GGUF
//! dequantized to f32; `scripts/goldens/smollm2_reference.py`), and our GGUF-built tokenizer
//! must give transformers' prompt ids.

mod common;

use std::path::Path;

use common::*;
use ferrite_engine::EngineConfig;
use ferrite_models::{paths, registry};
use serde_json::Value;

#[test]
fn smollm2_matches_transformers() {
    let path = registry::resolve("smollm2", &paths::models_dir()).expect("smollm2 (run `ferrite pull smollm2`)");
    let loaded = ferrite_models::load(&path).expect("load");
    let tok = loaded.tokenizer.as_ref().expect("tokenizer");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2_reference.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(fixture).expect("fixture")).expect("json");
    let prompts = reference["prompts"].as_array().expect("prompts");
    assert!(prompts.len() >= 4);
    for case in prompts {
        let text = case["text"].as_str().expect("text");
        let prompt = ids(&case["ids"]);
        assert_eq!(tok.encode(text, true).expect("encode"), prompt, "prompt ids for {text:?}");
        let want = ids(&case["greedy"]);
        let cfg = EngineConfig { max_model_len: Some(512), max_num_seqs: 1, ..EngineConfig::default() };
        let got = alone(&loaded.model, cfg, prompt, greedy(want.len()));
        assert_eq!(got[0], want, "greedy continuation of {text:?}: {:?}", tok.decode(&got[0], false));
    }
}
