//! The hostile model files of issue 26, each built here: deeply nested GGUF metadata, a tensor
//! offset that wraps, metadata out of range (GGUF and HF `config.json`), non-finite norm
//! weights, and corrupt data that only `--verify-weights` (the file's sha256) can see. Each is
//! a one-line error naming the file, never a crash and never a model that loads and serves
//! garbage.

mod fixture_edits;

use std::path::{Path, PathBuf};

use ferrite_models::gguf::{GgufFile, GgufValue};
use ferrite_models::verify::{self, DigestSource};
use fixture_edits::load_err;
use serde_json::{json, Value};

/// A GGUF file under construction: metadata as (key, type id, value bytes) and tensor infos
/// as (name, ggml dims, ggml type, offset); `bytes` lays them out as the format does.
#[derive(Default, Clone)]
struct Gguf {
    kv: Vec<(String, u32, Vec<u8>)>,
    tensors: Vec<(String, Vec<u64>, u32, u64)>,
    data: Vec<u8>,
}

fn gguf_string(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend(s.as_bytes());
    b
}

impl Gguf {
    /// The metadata of a small llama (no tensors: only the config is read from it).
    fn llama() -> Gguf {
        let mut g = Gguf::default();
        g.set_str("general.architecture", "llama");
        for (k, v) in [
            ("llama.embedding_length", 64),
            ("llama.attention.head_count", 4),
            ("llama.attention.head_count_kv", 2),
            ("llama.context_length", 256),
            ("llama.feed_forward_length", 128),
            ("llama.block_count", 2),
            ("llama.vocab_size", 256),
        ] {
            g.set(k, 4, (v as u32).to_le_bytes().to_vec());
        }
        g
    }

    fn set(&mut self, key: &str, ty: u32, value: Vec<u8>) {
        self.kv.retain(|(k, _, _)| k != key);
        self.kv.push((key.to_string(), ty, value));
    }

    fn set_str(&mut self, key: &str, value: &str) {
        self.set(key, 8, gguf_string(value));
    }

    fn set_f32(&mut self, key: &str, value: f32) {
        self.set(key, 6, value.to_le_bytes().to_vec());
    }

    fn set_u64(&mut self, key: &str, value: u64) {
        self.set(key, 10, value.to_le_bytes().to_vec());
    }

    /// Bytes before the data section (its length does not depend on the offsets' values).
    fn header(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend((self.kv.len() as u64).to_le_bytes());
        for (k, ty, v) in &self.kv {
            b.extend(gguf_string(k));
            b.extend(ty.to_le_bytes());
            b.extend(v);
        }
        for (name, dims, ty, offset) in &self.tensors {
            b.extend(gguf_string(name));
            b.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
        }
        b
    }

    /// Where the data section starts (the header padded to the default alignment of 32).
    fn data_start(&self) -> u64 {
        (self.header().len() as u64).div_ceil(32) * 32
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = self.header();
        b.resize(self.data_start() as usize, 0);
        b.extend(&self.data);
        b
    }
}

fn write_tmp(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).expect("write");
    p
}

/// Metadata value bytes of `depth` arrays, each holding the next, the innermost empty.
fn nested_arrays(depth: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(depth * 12);
    for _ in 1..depth {
        b.extend(9u32.to_le_bytes()); // element type: array
        b.extend(1u64.to_le_bytes());
    }
    b.extend(4u32.to_le_bytes()); // innermost: an empty array of u32
    b.extend(0u64.to_le_bytes());
    b
}

#[test]
fn deeply_nested_metadata_arrays_are_an_error_not_a_stack_overflow() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut g = Gguf::llama();
    // The probe's file: 200,000 levels (2.4 MB) overflowed the recursive reader's stack.
    g.set("evil", 9, nested_arrays(200_000));
    let p = write_tmp(tmp.path(), "nested.gguf", &g.bytes());
    let msg = load_err(&p);
    assert!(msg.contains("nested.gguf") && msg.contains("nest deeper than 16"), "{msg}");

    // The limit itself: 16 levels read, 17 do not.
    let mut g = Gguf::default();
    g.set("ok", 9, nested_arrays(16));
    let file = GgufFile::from_bytes(Path::new("ok.gguf"), &g.bytes()).expect("16 levels parse");
    let mut v = file.get("ok").expect("key");
    let mut depth = 0;
    while let GgufValue::Array(items) = v {
        depth += 1;
        match items.first() {
            Some(inner) => v = inner,
            None => break,
        }
    }
    assert_eq!(depth, 16);
    g.set("ok", 9, nested_arrays(17));
    assert!(GgufFile::from_bytes(Path::new("deep.gguf"), &g.bytes()).is_err());
}

#[test]
fn tensor_extents_that_overflow_are_errors_not_panics() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let base = {
        let mut g = Gguf::llama();
        g.tensors.push(("token_embd.weight".into(), vec![64, 256], 0, 0));
        g.data = vec![0; 64 * 256 * 4];
        g
    };
    // The probe: an offset of 2^64 − data_start − 64 made start + len wrap past zero.
    let mut g = base.clone();
    g.tensors[0].3 = 0u64.wrapping_sub(g.data_start()).wrapping_sub(64);
    let msg = load_err(&write_tmp(tmp.path(), "wrap.gguf", &g.bytes()));
    assert!(msg.contains("wrap.gguf") && msg.contains("token_embd.weight") && msg.contains("past the end"), "{msg}");

    // Dimensions whose product overflows 64 bits.
    let mut g = base.clone();
    g.tensors[0].1 = vec![1 << 32, 1 << 32, 1 << 32];
    let msg = load_err(&write_tmp(tmp.path(), "dims.gguf", &g.bytes()));
    assert!(msg.contains("token_embd.weight") && msg.contains("overflows"), "{msg}");

    // An offset off the alignment (which llama.cpp refuses too).
    let mut g = base;
    g.tensors[0].3 = 4;
    let msg = load_err(&write_tmp(tmp.path(), "align.gguf", &g.bytes()));
    assert!(msg.contains("not a multiple of the alignment 32"), "{msg}");
}

#[test]
fn safetensors_offsets_that_overflow_are_errors() {
    let header = json!({"w": {"dtype": "F32", "shape": [4], "data_offsets": [u64::MAX - 3, u64::MAX]}});
    let mut h = serde_json::to_vec(&header).expect("json");
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(&h);
    bytes.extend([0u8; 16]);
    let path = Path::new("wrap.safetensors");
    let msg = ferrite_models::safetensors::SafetensorsDir::from_bytes(path, &bytes).err().expect("error").to_string();
    assert!(msg.contains("tensor w") && msg.contains("truncated"), "{msg}");
    // A shape whose element count overflows.
    let header = json!({"w": {"dtype": "F32", "shape": [1u64 << 32, 1u64 << 32, 16], "data_offsets": [0, 16]}});
    let h = serde_json::to_vec(&header).expect("json");
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(&h);
    bytes.extend([0u8; 16]);
    let msg = ferrite_models::safetensors::SafetensorsDir::from_bytes(path, &bytes).err().expect("error").to_string();
    assert!(msg.contains("overflows"), "{msg}");
}

#[test]
fn gguf_metadata_out_of_range_is_an_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    type Edit = fn(&mut Gguf);
    let cases: [(Edit, &str); 12] = [
        (|g| g.set_f32("llama.rope.freq_base", f32::NAN), "rope theta (freq_base) is NaN"),
        (|g| g.set_f32("llama.rope.freq_base", -10000.0), "rope theta (freq_base) is -10000"),
        (|g| g.set_f32("llama.rope.freq_base", 0.0), "rope theta (freq_base) is 0"),
        (|g| g.set_f32("llama.attention.layer_norm_rms_epsilon", -1e-5), "rms_norm_eps is -0.00001"),
        (|g| g.set_f32("llama.attention.layer_norm_rms_epsilon", f32::NAN), "rms_norm_eps is NaN"),
        (|g| g.set("llama.rope.dimension_count", 4, 0u32.to_le_bytes().to_vec()), "rotary dim"),
        (|g| g.set_u64("llama.context_length", 0), "context length (max_position_embeddings) is 0"),
        (|g| g.set_u64("llama.context_length", 1), "context length (max_position_embeddings) is 1"),
        (|g| g.set_u64("llama.context_length", 1 << 40), "is 1099511627776 (expected 16 to 16777216)"),
        (|g| g.set_u64("llama.attention.head_count", 0), "num_attention_heads is 0"),
        (|g| g.set_u64("llama.attention.head_count_kv", 3), "not a multiple of num_key_value_heads 3"),
        (|g| g.set_u64("llama.embedding_length", 1 << 40), "hidden_size is 1099511627776"),
    ];
    for (i, (edit, want)) in cases.into_iter().enumerate() {
        let mut g = Gguf::llama();
        edit(&mut g);
        let msg = load_err(&write_tmp(tmp.path(), &format!("case{i}.gguf"), &g.bytes()));
        assert!(msg.contains(&format!("case{i}.gguf")) && msg.contains(want), "case {i}: {msg}");
    }
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama")
}

/// A copy of the llama fixture dir.
fn copy_fixture() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture().join(file), tmp.path().join(file)).expect("copy");
    }
    tmp
}

#[test]
fn hf_config_out_of_range_is_an_error() {
    let cases = [
        ("rope_parameters", json!({"rope_type": "default", "rope_theta": -1.0}), "rope theta (freq_base) is -1"),
        ("rope_parameters", json!({"rope_type": "linear", "rope_theta": 1e4, "factor": 0.0}), "rope factor is 0"),
        (
            "rope_parameters",
            json!({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 4.0,
                   "high_freq_factor": 4.0}),
            "high_freq_factor 4 is not above low_freq_factor 4",
        ),
        ("rms_norm_eps", json!(-1e-5), "rms_norm_eps is -0.00001"),
        ("rms_norm_eps", json!(1e300), "rms_norm_eps is inf"),
        ("max_position_embeddings", json!(1), "context length (max_position_embeddings) is 1"),
        ("num_attention_heads", json!(0), "num_attention_heads is 0"),
        ("vocab_size", json!(1u64 << 40), "vocab_size is 1099511627776"),
    ];
    for (key, value, want) in cases {
        let tmp = copy_fixture();
        let path = tmp.path().join("config.json");
        let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        cfg[key] = value;
        std::fs::write(&path, cfg.to_string()).expect("write");
        let msg = load_err(tmp.path());
        assert!(msg.contains("config.json") && msg.contains(want), "{key}: {msg}");
    }
}

/// The byte range of tensor `name` in a safetensors file.
fn tensor_range(bytes: &[u8], name: &str) -> std::ops::Range<usize> {
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    let offs = &header[name]["data_offsets"];
    let (s, e) = (offs[0].as_u64().expect("start") as usize, offs[1].as_u64().expect("end") as usize);
    8 + n + s..8 + n + e
}

#[test]
fn non_finite_norm_weights_are_an_error() {
    for (name, value, want) in [
        ("model.norm.weight", f32::NAN, "value 5 is NaN"),
        ("model.layers.1.input_layernorm.weight", f32::INFINITY, "value 5 is inf"),
    ] {
        let tmp = copy_fixture();
        let p = tmp.path().join("model.safetensors");
        let mut bytes = std::fs::read(&p).expect("read");
        let r = tensor_range(&bytes, name);
        bytes[r.start + 20..r.start + 24].copy_from_slice(&value.to_le_bytes());
        std::fs::write(&p, bytes).expect("write");
        let msg = load_err(tmp.path());
        assert!(msg.contains("model.safetensors") && msg.contains(name) && msg.contains(want), "{msg}");
    }
}

fn write_sidecar(file: &Path) {
    let digest = verify::sha256_file(file).expect("hash");
    let name = file.file_name().and_then(|n| n.to_str()).expect("name");
    std::fs::write(format!("{}.sha256", file.display()), format!("{digest}  {name}\n")).expect("sidecar");
}

#[test]
fn verify_weights_catches_what_loading_cannot() {
    let tmp = copy_fixture();
    let st = tmp.path().join("model.safetensors");
    // Without a digest there is nothing to verify against.
    let msg = verify::verify_weights(tmp.path()).expect_err("no digest").to_string();
    assert!(msg.contains("model.safetensors") && msg.contains("no digest"), "{msg}");
    write_sidecar(&st);
    let ok = verify::verify_weights(tmp.path()).expect("verifies");
    assert_eq!(ok.len(), 1);
    assert!(matches!(&ok[0].source, DigestSource::Sidecar(p) if p.ends_with("model.safetensors.sha256")));

    // One flipped bit in a matrix, and (separately) a tensor's data shifted by one value:
    // both load and would serve, only the digest sees them.
    let original = std::fs::read(&st).expect("read");
    let r = tensor_range(&original, "model.layers.0.mlp.up_proj.weight");
    let mut flipped = original.clone();
    flipped[r.start + 100] ^= 0x40;
    let mut shifted = original.clone();
    shifted.copy_within(r.start + 4..r.end, r.start);
    for corrupt in [flipped, shifted] {
        std::fs::write(&st, &corrupt).expect("write");
        ferrite_models::load(tmp.path()).expect("a corrupt matrix still loads");
        let msg = verify::verify_weights(tmp.path()).expect_err("mismatch").to_string();
        assert!(msg.contains("does not match") && msg.contains("model.safetensors.sha256"), "{msg}");
    }

    // A sidecar that holds no digest.
    std::fs::write(tmp.path().join("model.safetensors.sha256"), "not a digest\n").expect("write");
    let msg = verify::verify_weights(tmp.path()).expect_err("bad sidecar").to_string();
    assert!(msg.contains("64 hex digits"), "{msg}");
}

#[test]
fn verify_weights_knows_the_named_models_digests() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let p = write_tmp(tmp.path(), "SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF and not the model");
    let msg = verify::verify_weights(&p).expect_err("mismatch").to_string();
    assert!(msg.contains("does not match b179c952") && msg.contains("the named model 'smollm2'"), "{msg}");
}
