//! `POST /v1/embeddings`: the tiny embedding fixtures against their transformers references
//! (token-id inputs: the fixtures have no tokenizer), every input alone equal to the same input
//! in one request with the others, `dimensions` and `encoding_format`, the OpenAI error bodies,
//! and authentication; text inputs on the tiny BERT (its trimmed WordPiece tokenizer, truncation
//! at max_seq_length), and on the real EmbeddingGemma and all-MiniLM-L6-v2 when fetched.

use std::sync::OnceLock;

use base64::Engine as _;
use serde_json::{json, Value};

use crate::common::*;
use ferrite_server::ServerConfig;

fn gemma_embed() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| start(tiny_app("gemma3-embed", ServerConfig::default())))
}

fn bert_embed() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| start(tiny_app("bert-embed", ServerConfig::default())))
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().expect("floats").iter().map(|x| x.as_f64().expect("float") as f32).collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

async fn embed(server: &TestServer, body: Value) -> Value {
    let (status, got) = post(&server.at("/v1/embeddings"), &body).await;
    assert_eq!(status.as_u16(), 200, "{got}");
    got
}

#[tokio::test]
async fn embeddings_match_the_reference_batched_and_alone() {
    let server = gemma_embed();
    let reference = fixture_reference("gemma3-embed");
    let inputs = reference["inputs"].clone();
    let want: Vec<Vec<f32>> = reference["embeddings"].as_array().expect("embeddings").iter().map(floats).collect();
    let all = embed(server, json!({"model": "gemma3-embed", "input": inputs})).await;
    assert_eq!((all["object"].as_str(), all["model"].as_str()), (Some("list"), Some("gemma3-embed")));
    let data = all["data"].as_array().expect("data");
    assert_eq!(data.len(), want.len());
    let tokens: usize = inputs.as_array().expect("inputs").iter().map(|i| i.as_array().map_or(0, Vec::len)).sum();
    assert_eq!(all["usage"], json!({"prompt_tokens": tokens, "total_tokens": tokens}));
    for (i, (item, want)) in data.iter().zip(&want).enumerate() {
        assert_eq!((item["object"].as_str(), item["index"].as_u64()), (Some("embedding"), Some(i as u64)));
        let got = floats(&item["embedding"]);
        assert!(cosine(&got, want) >= 0.999, "input {i}: cosine {}", cosine(&got, want));
        let alone = embed(server, json!({"input": inputs[i]})).await;
        let one = floats(&alone["data"][0]["embedding"]);
        let gap = one.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(gap < 1e-4, "input {i}: alone differs from batched by {gap}");
    }
}

#[tokio::test]
async fn dimensions_truncate_and_renormalise_and_base64_carries_the_floats() {
    let server = gemma_embed();
    let input = fixture_reference("gemma3-embed")["inputs"][4].clone();
    let full = floats(&embed(server, json!({"input": input})).await["data"][0]["embedding"]);
    assert_eq!(full.len(), 64);
    let short = floats(&embed(server, json!({"input": input, "dimensions": 32})).await["data"][0]["embedding"]);
    let norm = full[..32].iter().map(|x| x * x).sum::<f32>().sqrt();
    for (s, f) in short.iter().zip(&full[..32]) {
        assert!((s - f / norm).abs() < 1e-6, "{s} vs {}", f / norm);
    }
    assert_eq!(short.len(), 32);
    let b64 = embed(server, json!({"input": input, "encoding_format": "base64"})).await;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64["data"][0]["embedding"].as_str().expect("a base64 string"))
        .expect("base64");
    let decoded: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    // Another test's requests on this shared server may share the step, and f32 matmuls round
    // differently at another batch size: equal within the batched-vs-alone bound.
    assert_eq!(decoded.len(), full.len());
    assert!(max_gap(&decoded, &full) < 1e-5, "base64 differs from float by {}", max_gap(&decoded, &full));
    let url = server.at("/v1/embeddings");
    let got = post(&url, &json!({"input": input, "dimensions": 20})).await;
    assert_error(got, 400, Some("dimensions"), "[64, 32, 16]");
    let got = post(&url, &json!({"input": input, "encoding_format": "int8"})).await;
    assert_error(got, 400, Some("encoding_format"), "'float' or 'base64'");
}

#[tokio::test]
async fn bad_inputs_get_openai_errors() {
    let server = gemma_embed();
    let url = server.at("/v1/embeddings");
    for (input, needle) in [
        (json!([]), "must not be empty"),
        (json!([[]]), "empty list of token ids"),
        (json!(""), "empty string"),
        (json!(7), "must be a string"),
        (json!([[1, 2], "text"]), "must be a string"),
    ] {
        assert_error(post(&url, &json!({"input": input})).await, 400, Some("input"), needle);
    }
    let long: Vec<u32> = (0..300).map(|i| 3 + i % 300).collect();
    let body = assert_error(post(&url, &json!({"input": long})).await, 400, Some("input"), "embeds at most 256");
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    let got = post(&url, &json!({"input": [5, 400]})).await;
    assert_error(got, 400, Some("input"), "outside the vocabulary");
    let many: Vec<Value> = (0..2049).map(|_| json!([5])).collect();
    assert_error(post(&url, &json!({"input": many})).await, 400, Some("input"), "at most 2048");
    // An embedding-only model does not generate.
    let body = json!({"prompt": [5, 6, 7], "max_tokens": 2});
    assert_error(post(&server.at("/v1/completions"), &body).await, 400, Some("model"), "only makes embeddings");
}

#[tokio::test]
async fn models_that_cannot_embed_or_truncate_say_so() {
    let got = post(&tiny().at("/v1/embeddings"), &json!({"input": [5, 6, 7]})).await;
    let body = assert_error(got, 400, Some("model"), "does not make embeddings");
    assert_eq!(body["error"]["code"], "model_not_supported");
    let qwen = start(tiny_app("qwen3-embed", ServerConfig::default()));
    let got = post(&qwen.at("/v1/embeddings"), &json!({"input": [5, 6, 7], "dimensions": 32})).await;
    assert_error(got, 400, Some("dimensions"), "cannot be truncated");
    let want = floats(&fixture_reference("qwen3-embed")["embeddings"][2]);
    let input = fixture_reference("qwen3-embed")["inputs"][2].clone();
    let got = floats(&embed(&qwen, json!({"input": input, "dimensions": 64})).await["data"][0]["embedding"]);
    assert!(cosine(&got, &want) >= 0.999);
}

#[tokio::test]
async fn embeddings_need_the_api_key() {
    let config = ServerConfig { api_key: Some("sekret".into()), ..ServerConfig::default() };
    let server = start(tiny_app("gemma3-embed", config));
    let (status, _) = post(&server.at("/v1/embeddings"), &json!({"input": [5, 6]})).await;
    assert_eq!(status.as_u16(), 401);
    let resp = client()
        .post(server.at("/v1/embeddings"))
        .bearer_auth("sekret")
        .json(&json!({"input": [5, 6]}))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 200);
}

fn max_gap(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

/// The BERT fixture from text: ferrite's WordPiece ids, truncated at max_seq_length (24) as
/// sentence-transformers does, give sentence-transformers' embeddings; token-id inputs are
/// taken as they are (past max_seq_length, up to the 64 positions); base64 carries the same
/// floats; `dimensions` is refused (not a Matryoshka model).
#[tokio::test]
async fn bert_embeds_text_and_token_ids() {
    let server = bert_embed();
    let reference = fixture_reference("bert-embed");
    let want: Vec<Vec<f32>> = reference["embeddings"].as_array().expect("embeddings").iter().map(floats).collect();
    let texts = reference["texts"].as_array().expect("texts").clone();
    let got = embed(server, json!({"model": "bert-embed", "input": texts})).await;
    let tokens: usize =
        reference["text_ids"].as_array().expect("ids").iter().map(|i| i.as_array().map_or(0, Vec::len)).sum();
    assert_eq!(got["usage"]["prompt_tokens"], json!(tokens), "the long text counts its first 24 tokens");
    for (i, item) in got["data"].as_array().expect("data").iter().enumerate() {
        let v = floats(&item["embedding"]);
        assert_eq!(v.len(), 32);
        assert!(max_gap(&v, &want[i]) < 1e-4, "text {i}: {} from the reference", max_gap(&v, &want[i]));
    }
    let long_ids = reference["inputs"][texts.len() + 2].clone();
    assert_eq!(long_ids.as_array().map(Vec::len), Some(64));
    let got = embed(server, json!({"input": long_ids, "encoding_format": "base64"})).await;
    assert_eq!(got["usage"]["prompt_tokens"], json!(64));
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(got["data"][0]["embedding"].as_str().expect("a base64 string"))
        .expect("base64");
    let decoded: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert!(max_gap(&decoded, &want[texts.len() + 2]) < 1e-4);
    let url = server.at("/v1/embeddings");
    let got = post(&url, &json!({"input": texts[0], "dimensions": 16})).await;
    assert_error(got, 400, Some("dimensions"), "cannot be truncated");
    let same = embed(server, json!({"input": texts[0], "dimensions": 32})).await;
    assert!(max_gap(&floats(&same["data"][0]["embedding"]), &want[0]) < 1e-4);
    let too_long: Vec<u32> = (0..65).map(|i| 5 + i % 100).collect();
    let body = assert_error(post(&url, &json!({"input": too_long})).await, 400, Some("input"), "embeds at most 64");
    assert_eq!(body["error"]["code"], "context_length_exceeded");
}

/// Text inputs on the real all-MiniLM-L6-v2 (skipped unless `scripts/fetch_embedding_models.sh`
/// has fetched it), the longest past max_seq_length.
#[tokio::test]
async fn minilm_embeds_text() {
    let dir = ferrite_models::paths::models_dir().join("all-minilm-l6-v2");
    if !dir.join(".done").is_file() {
        eprintln!("SKIP minilm_embeds_text: run scripts/fetch_embedding_models.sh minilm");
        return;
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/minilm_reference.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json");
    let loaded = ferrite_models::load(&dir).expect("load");
    let info = ferrite_server::ModelInfo::new(&loaded, "minilm".into(), vec![]);
    let server = start(ferrite_server::App::new(engine(&loaded, None, true), info, ServerConfig::default()));
    let got = embed(&server, json!({"model": "minilm", "input": reference["texts"]})).await;
    for (i, item) in got["data"].as_array().expect("data").iter().enumerate() {
        let cos = cosine(&floats(&item["embedding"]), &floats(&reference["embeddings"][i]));
        assert!(cos >= 0.999, "text {i}: cosine {cos}");
    }
    let got = post(&server.at("/v1/embeddings"), &json!({"input": "hello", "dimensions": 128})).await;
    assert_error(got, 400, Some("dimensions"), "cannot be truncated");
}

/// Text inputs on the real EmbeddingGemma (skipped unless `scripts/fetch_embedding_models.sh`
/// has fetched it).
#[tokio::test]
async fn embeddinggemma_embeds_text() {
    let dir = ferrite_models::paths::models_dir().join("embeddinggemma-300m");
    if !dir.join(".done").is_file() {
        eprintln!("SKIP embeddinggemma_embeds_text: run scripts/fetch_embedding_models.sh");
        return;
    }
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/embeddinggemma_reference.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json");
    let loaded = ferrite_models::load(&dir).expect("load");
    let info = ferrite_server::ModelInfo::new(&loaded, "embeddinggemma".into(), vec![]);
    let server = start(ferrite_server::App::new(engine(&loaded, None, true), info, ServerConfig::default()));
    let texts = reference["texts"].as_array().expect("texts")[..4].to_vec();
    let got = embed(&server, json!({"model": "embeddinggemma", "input": texts})).await;
    for (i, item) in got["data"].as_array().expect("data").iter().enumerate() {
        let cos = cosine(&floats(&item["embedding"]), &floats(&reference["embeddings"][i]));
        assert!(cos >= 0.999, "text {i}: cosine {cos}");
    }
    let short = embed(&server, json!({"input": texts[0], "dimensions": 256})).await;
    assert_eq!(short["data"][0]["embedding"].as_array().map(Vec::len), Some(256));
}
