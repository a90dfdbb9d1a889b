//! Embedding requests through the engine, against transformers / sentence-transformers on the
//! same weights (cosine ≥ 0.999 per input; `scripts/goldens/make_embedding_models.py`,
//! `scripts/goldens/embeddinggemma_reference.py`):
//!
//! - `qwen3-embed`: a Qwen3 backbone saved without its LM head, last-token pooling, normalised;
//! - `gemma3-embed`: an EmbeddingGemma-shaped bidirectional Gemma 3 (sliding and global
//!   layers), mean pooling, two Dense modules, normalised;
//! - `bert-embed`: a BERT encoder in all-MiniLM-L6-v2's layout with its WordPiece tokenizer
//!   trimmed (`scripts/goldens/make_bert_embed.py`), mean pooling, normalised, max_seq_length
//!   24: sentence-transformers' ids for its texts (truncated at max_seq_length) and embeddings
//!   within 1e-4 per value (keys and values go through the f16 KV cache);
//! - the real EmbeddingGemma-300M and all-MiniLM-L6-v2 when `scripts/fetch_embedding_models.sh`
//!   has fetched them (skipped with a note otherwise), their inputs tokenized by ferrite.
//!
//! Each input alone equals the same input in one batch with the others; an embedding request
//! in the same steps as a generation leaves the generation's tokens as they are alone; a
//! bidirectional model refuses to generate and keeps no prefix cache, and a generation-only
//! model refuses to embed.

mod common;

use std::sync::Arc;

use common::*;
use ferrite_engine::{EngineConfig, EngineCore, EngineError, Output, Request, RequestParams};
use ferrite_models::model::CausalLm;
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

fn embed_params() -> RequestParams {
    RequestParams { embed: true, ..Default::default() }
}

fn vectors(v: &Value) -> Vec<Vec<f32>> {
    let rows = v.as_array().expect("list of embeddings");
    rows.iter()
        .map(|r| r.as_array().expect("embedding").iter().map(|x| x.as_f64().expect("f32") as f32).collect())
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// The embedding an embedding request's one output carries.
fn embedding_of(rx: &mut UnboundedReceiver<Output>) -> Vec<f32> {
    let out = rx.try_recv().expect("an output");
    let finished = out.finished.as_ref().expect("the one output finishes the request");
    assert_eq!(finished.error, None);
    assert!(rx.try_recv().is_err(), "an embedding request has one output");
    out.embedding.expect("the output carries the embedding")
}

/// Embed every input of `inputs` on `core`, all added before the first step (one batch).
fn embed_all(core: &mut EngineCore, inputs: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let mut rxs: Vec<_> =
        (0..inputs.len()).map(|i| add(core, i as u64 + 1, inputs[i].clone(), embed_params())).collect();
    run_to_end(core);
    rxs.iter_mut().map(embedding_of).collect()
}

/// Every input of the fixture `name` alone against its reference (cosine ≥ 0.999, and each
/// value within `tolerance` when given) and against the same input batched with the others.
fn check_fixture(name: &str, tolerance: Option<f32>) {
    let (model, reference) = load_fixture(name);
    let inputs: Vec<Vec<u32>> = reference["inputs"].as_array().expect("inputs").iter().map(ids).collect();
    let want = vectors(&reference["embeddings"]);
    let batched = embed_all(&mut core(&model, EngineConfig::default()), &inputs);
    for (i, input) in inputs.iter().enumerate() {
        let one = embed_all(&mut core(&model, EngineConfig::default()), std::slice::from_ref(input)).remove(0);
        let cos = cosine(&one, &want[i]);
        assert!(cos >= 0.999, "{name} input {i} ({} tokens): cosine {cos} to the reference", input.len());
        if let Some(tol) = tolerance {
            let off = one.iter().zip(&want[i]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(off < tol, "{name} input {i}: a value is {off} from the reference");
        }
        let gap = one.iter().zip(&batched[i]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(gap < 1e-5, "{name} input {i}: batched differs from alone by {gap}");
        let norm = one.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "{name} input {i}: norm {norm}");
    }
}

#[test]
fn decoder_last_token_embeddings_match_transformers() {
    check_fixture("qwen3-embed", None);
}

#[test]
fn bidirectional_gemma3_embeddings_match_transformers() {
    check_fixture("gemma3-embed", None);
}

/// The BERT encoder: ferrite's WordPiece tokenizer gives sentence-transformers' ids (truncated
/// at max_seq_length), and the embeddings match (within 1e-4 per value: the f16 KV cache
/// rounds keys and values).
#[test]
fn bert_embeddings_match_sentence_transformers() {
    check_fixture("bert-embed", Some(1e-4));
    let loaded = ferrite_models::load(&fixture_dir("bert-embed")).expect("load bert-embed");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture_dir("bert-embed").join("reference.json")).expect("ref"))
            .expect("json");
    let spec = loaded.model.embedding().expect("an embedder").clone();
    assert_eq!((spec.dimensions, spec.normalized, spec.max_tokens), (32, true, Some(24)));
    assert_eq!(spec.pooling, ferrite_models::embedding::Pooling::Mean);
    assert!(!loaded.model.generates());
    let tok = loaded.tokenizer.as_ref().expect("tokenizer");
    let texts = reference["texts"].as_array().expect("texts");
    for (text, want) in texts.iter().zip(reference["text_ids"].as_array().expect("ids")) {
        let got = tok.encode_truncated(text.as_str().expect("text"), 24).expect("encode");
        assert_eq!(got, ids(want), "token ids of {text}");
    }
}

/// With a step budget smaller than the batch, embedding inputs wait for a step that holds
/// them whole instead of being cut into chunks.
#[test]
fn embedding_inputs_are_never_chunked() {
    let (model, reference) = load_fixture("gemma3-embed");
    let inputs: Vec<Vec<u32>> = reference["inputs"].as_array().expect("inputs").iter().map(ids).collect();
    let want = vectors(&reference["embeddings"]);
    let cfg = EngineConfig { max_num_batched_tokens: 80, ..Default::default() };
    let got = embed_all(&mut core(&model, cfg), &inputs);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(cosine(g, w) >= 0.999, "input {i}: cosine {}", cosine(g, w));
    }
    let mut small = core(&model, EngineConfig { max_num_batched_tokens: 16, ..Default::default() });
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let err = small.add_request(1, Request { prompt: inputs[5].clone(), params: embed_params() }, tx).unwrap_err();
    assert!(matches!(err, EngineError::EmbedInputTooLong { input: 70, max: 16 }), "{err}");
}

/// An embedding request sharing steps with a generation leaves the generated tokens as they
/// are alone, comes back with its own embedding and keeps no KV blocks.
#[test]
fn embeddings_and_generation_share_the_engine() {
    let (model, reference) = load_fixture("qwen3-embed");
    let inputs: Vec<Vec<u32>> = reference["inputs"].as_array().expect("inputs").iter().map(ids).collect();
    let want = vectors(&reference["embeddings"]);
    let prompt = inputs[3].clone();
    let mut only = core(&model, EngineConfig::default());
    let mut rx = add(&mut only, 1, prompt.clone(), greedy(12));
    run_to_end(&mut only);
    let solo = collect(&mut rx, 1);
    let mut c = core(&model, EngineConfig::default());
    let mut gen = add(&mut c, 1, prompt, greedy(12));
    c.step().expect("step");
    let mut a = add(&mut c, 2, inputs[4].clone(), embed_params());
    c.step().expect("step");
    let mut b = add(&mut c, 3, inputs[1].clone(), embed_params());
    run_to_end(&mut c);
    assert_eq!(collect(&mut gen, 1), solo);
    assert!(cosine(&embedding_of(&mut a), &want[4]) >= 0.999);
    assert!(cosine(&embedding_of(&mut b), &want[1]) >= 0.999);
    // The embeddings kept no blocks: the pools are as the generation alone left them.
    assert_eq!(c.kv_manager().free_blocks(), only.kv_manager().free_blocks());
}

#[test]
fn what_a_model_cannot_do_is_refused() {
    let (embedder, _) = load_fixture("gemma3-embed");
    assert!(!embedder.generates());
    let c = core(&embedder, EngineConfig::default());
    assert!(c.kv_manager().prefix_cache().is_none(), "a bidirectional model keeps no prefix cache");
    let err = c.limits().validate(&Request { prompt: vec![5, 6], params: greedy(4) }).unwrap_err();
    assert!(matches!(err, EngineError::CannotGenerate), "{err}");
    let (generator, _) = load_fixture("qwen3");
    let err = core(&generator, EngineConfig::default())
        .limits()
        .validate(&Request { prompt: vec![5, 6], params: embed_params() })
        .unwrap_err();
    assert!(matches!(err, EngineError::CannotEmbed), "{err}");
    let limits = core(&embedder, EngineConfig::default()).limits().clone();
    let spec = limits.embedding.expect("the embedder's spec");
    assert_eq!((spec.dimensions, spec.normalized, spec.matryoshka), (64, true, Some(vec![64, 32, 16])));
}

/// The real EmbeddingGemma-300M: ferrite's tokenizer gives sentence-transformers' ids, and the
/// embeddings match per text.
#[test]
fn embeddinggemma_matches_sentence_transformers() {
    let dir = ferrite_models::paths::models_dir().join("embeddinggemma-300m");
    if !dir.join(".done").is_file() {
        eprintln!("SKIP embeddinggemma_matches_sentence_transformers: run scripts/fetch_embedding_models.sh");
        return;
    }
    let loaded = ferrite_models::load(&dir).expect("load EmbeddingGemma");
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/embeddinggemma_reference.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(fixture).expect("fixture")).expect("json");
    let tok = loaded.tokenizer.as_ref().expect("tokenizer");
    let texts = reference["texts"].as_array().expect("texts");
    let mut inputs = Vec::new();
    for (text, want) in texts.iter().zip(reference["token_ids"].as_array().expect("ids")) {
        let got = tok.encode(text.as_str().expect("text"), true).expect("encode");
        assert_eq!(got, ids(want), "token ids of {text}");
        inputs.push(got);
    }
    let model: Arc<dyn CausalLm> = loaded.model.clone();
    let got = embed_all(&mut core(&model, EngineConfig::default()), &inputs);
    for (i, (g, w)) in got.iter().zip(&vectors(&reference["embeddings"])).enumerate() {
        let cos = cosine(g, w);
        assert!(cos >= 0.999, "text {i} ({} tokens): cosine {cos}", inputs[i].len());
    }
}

/// The real all-MiniLM-L6-v2: ferrite's tokenizer gives sentence-transformers' ids (the
/// tokenizer's own test, `ferrite-models/tests/tokenizer.rs`, has more texts), and the
/// embeddings match per text, one past max_seq_length (256).
#[test]
fn minilm_matches_sentence_transformers() {
    let dir = ferrite_models::paths::models_dir().join("all-minilm-l6-v2");
    if !dir.join(".done").is_file() {
        eprintln!("SKIP minilm_matches_sentence_transformers: run scripts/fetch_embedding_models.sh minilm");
        return;
    }
    let loaded = ferrite_models::load(&dir).expect("load all-MiniLM-L6-v2");
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/minilm_reference.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(fixture).expect("fixture")).expect("json");
    let spec = loaded.model.embedding().expect("an embedder").clone();
    assert_eq!((spec.dimensions, spec.max_tokens), (384, Some(256)));
    let tok = loaded.tokenizer.as_ref().expect("tokenizer");
    let texts = reference["texts"].as_array().expect("texts");
    let mut inputs = Vec::new();
    for (text, want) in texts.iter().zip(reference["token_ids"].as_array().expect("ids")) {
        let got = tok.encode_truncated(text.as_str().expect("text"), 256).expect("encode");
        assert_eq!(got, ids(want), "token ids of {text}");
        inputs.push(got);
    }
    let model: Arc<dyn CausalLm> = loaded.model.clone();
    let got = embed_all(&mut core(&model, EngineConfig::default()), &inputs);
    for (i, (g, w)) in got.iter().zip(&vectors(&reference["embeddings"])).enumerate() {
        let cos = cosine(g, w);
        assert!(cos >= 0.999, "text {i} ({} tokens): cosine {cos}", inputs[i].len());
        let off = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(off < 1e-4, "text {i}: a value is {off} from sentence-transformers'");
    }
}
