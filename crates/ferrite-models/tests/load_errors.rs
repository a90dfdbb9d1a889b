//! Every bad model input is a one-line error naming the file (and tensor) and what was
//! expected — never a panic. Each case corrupts a copy of a tiny fixture model.

mod fixture_edits;

use std::path::{Path, PathBuf};

use fixture_edits::{copy_fixture_named, edit_config, edit_header, fixture_named, load_err};
use serde_json::Value;

fn fixture() -> PathBuf {
    fixture_named("llama")
}

/// A copy of the llama fixture dir in a temp dir.
fn copy_fixture() -> tempfile::TempDir {
    copy_fixture_named("llama")
}

/// Set `key` to `value` in the config.json of `dir`.
fn set_config(dir: &Path, key: &str, value: Value) {
    edit_config(dir, |cfg| cfg[key] = value);
}

#[test]
fn the_fixture_itself_loads() {
    ferrite_models::load(&fixture()).expect("fixture loads");
}

#[test]
fn unknown_path() {
    let msg = load_err(Path::new("/nonexistent/model"));
    assert!(msg.contains("/nonexistent/model") && msg.contains("no such model"), "{msg}");
}

#[test]
fn directory_without_config() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let msg = load_err(tmp.path());
    assert!(msg.contains("config.json is missing"), "{msg}");
}

#[test]
fn unsupported_architecture() {
    let tmp = copy_fixture();
    let p = tmp.path().join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&p).expect("cfg")).expect("json");
    cfg["model_type"] = "gpt_neox".into();
    std::fs::write(&p, cfg.to_string()).expect("write");
    let msg = load_err(tmp.path());
    assert!(msg.contains("config.json") && msg.contains("unsupported architecture 'gpt_neox'"), "{msg}");
}

#[test]
fn invalid_config_json() {
    let tmp = copy_fixture();
    std::fs::write(tmp.path().join("config.json"), "{ not json").expect("write");
    let msg = load_err(tmp.path());
    assert!(msg.contains("config.json") && msg.contains("invalid JSON"), "{msg}");
}

#[test]
fn missing_tensor() {
    let tmp = copy_fixture();
    edit_header(tmp.path(), |h| {
        h.remove("model.layers.1.mlp.up_proj.weight");
    });
    let msg = load_err(tmp.path());
    assert!(msg.contains("model.safetensors") && msg.contains("model.layers.1.mlp.up_proj.weight: missing"), "{msg}");
}

#[test]
fn wrong_shape() {
    let tmp = copy_fixture();
    edit_header(tmp.path(), |h| {
        // Same byte count, transposed shape: only the shape check can catch it.
        let t = h.get_mut("model.layers.0.mlp.down_proj.weight").expect("tensor");
        let shape = t["shape"].as_array().expect("shape").clone();
        t["shape"] = Value::Array(vec![shape[1].clone(), shape[0].clone()]);
    });
    let msg = load_err(tmp.path());
    assert!(msg.contains("model.layers.0.mlp.down_proj.weight") && msg.contains("expected [64, 136]"), "{msg}");
}

#[test]
fn unsupported_dtype() {
    let tmp = copy_fixture();
    edit_header(tmp.path(), |h| {
        h.get_mut("model.norm.weight").expect("tensor")["dtype"] = "I8".into();
    });
    let msg = load_err(tmp.path());
    assert!(msg.contains("model.norm.weight") && msg.contains("dtype I8 is not supported"), "{msg}");
}

#[test]
fn truncated_safetensors() {
    let tmp = copy_fixture();
    let p = tmp.path().join("model.safetensors");
    let bytes = std::fs::read(&p).expect("read");
    std::fs::write(&p, &bytes[..bytes.len() / 2]).expect("write");
    let msg = load_err(tmp.path());
    assert!(msg.contains("model.safetensors") && msg.contains("truncated"), "{msg}");
}

/// A minimal GGUF with the given metadata strings and no tensors.
fn tiny_gguf(kv: &[(&str, &str)]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend((kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        b.extend((k.len() as u64).to_le_bytes());
        b.extend(k.as_bytes());
        b.extend(8u32.to_le_bytes());
        b.extend((v.len() as u64).to_le_bytes());
        b.extend(v.as_bytes());
    }
    b
}

#[test]
fn gguf_unsupported_architecture() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let p = tmp.path().join("m.gguf");
    std::fs::write(&p, tiny_gguf(&[("general.architecture", "gpt2")])).expect("write");
    let msg = load_err(&p);
    assert!(msg.contains("m.gguf") && msg.contains("unsupported architecture 'gpt2'"), "{msg}");
}

#[test]
fn gguf_bad_magic_and_truncation() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let p = tmp.path().join("bad.gguf");
    std::fs::write(&p, b"NOPE and more bytes").expect("write");
    assert!(load_err(&p).contains("not a GGUF file"));
    let full = tiny_gguf(&[("general.architecture", "llama")]);
    std::fs::write(&p, &full[..full.len() - 3]).expect("write");
    let msg = load_err(&p);
    assert!(msg.contains("bad.gguf") && msg.contains("truncated"), "{msg}");
}

/// A BERT checkpoint's integer `position_ids` buffer (all-MiniLM-L6-v2 carries one) is indexed
/// and never read; BERT settings ferrite does not run are refused by name.
#[test]
fn bert_buffers_load_and_unsupported_settings_are_refused() {
    let tmp = copy_fixture_named("bert-embed");
    edit_header(tmp.path(), |h| {
        let buffer = serde_json::json!({"dtype": "I64", "shape": [1, 64], "data_offsets": [0, 512]});
        h.insert("embeddings.position_ids".into(), buffer);
    });
    ferrite_models::load(tmp.path()).expect("an integer buffer is not read");
    let cases = [
        ("is_decoder", serde_json::json!(true), "is_decoder = true is not supported"),
        ("add_cross_attention", serde_json::json!(true), "add_cross_attention = true"),
        ("position_embedding_type", serde_json::json!("relative_key"), "'relative_key' is not supported"),
        ("hidden_act", serde_json::json!("relu"), "activation 'relu' is not supported"),
        ("type_vocab_size", serde_json::json!(0), "type_vocab_size is 0"),
    ];
    for (key, value, want) in cases {
        let tmp = copy_fixture_named("bert-embed");
        set_config(tmp.path(), key, value);
        let msg = load_err(tmp.path());
        assert!(msg.contains("config.json") && msg.contains(want), "{key}: {msg}");
    }
    let tmp = copy_fixture_named("bert-embed");
    set_config(tmp.path(), "type_vocab_size", serde_json::json!(3));
    let msg = load_err(tmp.path());
    assert!(msg.contains("embeddings.token_type_embeddings.weight") && msg.contains("expected [3, 32]"), "{msg}");
}

#[test]
fn gemma4_unknown_or_unsupported_settings() {
    let cases = [
        ("altup_num_inputs", serde_json::json!(4), "config key 'altup_num_inputs' is not supported"),
        ("use_bidirectional_attention", serde_json::json!("all"), "use_bidirectional_attention"),
        (
            "per_layer_config",
            serde_json::json!({"1": {"intermediate_size": 64}}),
            "per-layer override 'intermediate_size'",
        ),
        ("num_kv_shared_layers", serde_json::json!(4), "KV-shared layer 1 has no earlier full_attention layer"),
    ];
    for (key, value, want) in cases {
        let tmp = copy_fixture_named("gemma4-shared-ple");
        set_config(tmp.path(), key, value);
        let msg = load_err(tmp.path());
        assert!(msg.contains("config.json") && msg.contains(want), "{key}: {msg}");
    }
}

#[test]
fn gemma4_layers_without_kv_weights_must_be_shared() {
    // A shared layer owns no k_proj: dropping sharing makes layer 4 look for one that is absent.
    let tmp = copy_fixture_named("gemma4-shared-ple");
    set_config(tmp.path(), "num_kv_shared_layers", serde_json::json!(0));
    let msg = load_err(tmp.path());
    assert!(msg.contains("model.layers.3.self_attn.k_proj.weight"), "{msg}");
}

#[test]
fn missing_experts() {
    // Expert 0 gone: no layout of the experts is complete, and the error lists the three.
    let tmp = copy_fixture_named("qwen3-moe");
    edit_header(tmp.path(), |h| {
        h.remove("model.layers.2.mlp.experts.0.gate_proj.weight");
    });
    let msg = load_err(tmp.path());
    assert!(msg.contains("model.layers.2.mlp.experts are missing") && msg.contains("gate_up_proj"), "{msg}");
    // A later expert gone: that tensor is named.
    let tmp = copy_fixture_named("qwen3-moe");
    edit_header(tmp.path(), |h| {
        h.remove("model.layers.0.mlp.experts.5.down_proj.weight");
    });
    let msg = load_err(tmp.path());
    assert!(msg.contains("model.layers.0.mlp.experts.5.down_proj.weight: missing"), "{msg}");
}
