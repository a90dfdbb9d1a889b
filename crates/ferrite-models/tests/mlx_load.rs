//! MLX affine-quantized checkpoints (`scripts/goldens/make_mlx_models.py`): what loads, what
//! `inspect` reports, and every bad input a one-line error naming the file and tensor — never a
//! panic. Each bad case corrupts a copy of a fixture.

mod fixture_edits;

use std::path::Path;

use ferrite_runtime::{DType, MlxFormat, MlxScale};
use fixture_edits::{copy_fixture_named, edit_config, edit_header, fixture_named, load_err};
use serde_json::Value;

/// Set the default `key` of both quantization objects to `value`.
fn set_quant(dir: &Path, key: &str, value: Value) {
    edit_config(dir, |cfg| {
        cfg["quantization"][key] = value.clone();
        cfg["quantization_config"][key] = value;
    });
}

fn mlx(bits: u32, group: usize, scale: MlxScale) -> DType {
    DType::Mlx(MlxFormat::new(bits, group, scale).expect("format"))
}

/// `inspect` folds each quantized module's words, scales and biases into one tensor of its
/// logical shape in its own format (per-module overrides included, a module left in floats
/// as stored), so sizing counts the bytes the blocks take.
#[test]
fn inspect_reports_each_module_in_its_format() {
    let m = ferrite_models::inspect::inspect(&fixture_named("mlx-llama-mixed")).expect("inspect");
    let find =
        |dtype: DType, shape: &[usize]| m.tensors.iter().filter(|t| t.dtype == dtype && t.shape == shape).count();
    let bf = MlxScale::Bf16;
    assert_eq!(find(mlx(4, 32, bf), &[307, 128]), 1, "embed_tokens 4-bit g32");
    assert_eq!(find(mlx(8, 128, bf), &[307, 128]), 1, "lm_head 8-bit g128");
    assert_eq!(find(mlx(8, 32, bf), &[128, 256]), 1, "layer 0 down_proj 8-bit g32");
    assert_eq!(find(DType::BF16, &[64, 128]), 1, "layer 1 v_proj in bf16");
    assert_eq!(find(mlx(4, 64, bf), &[128, 256]), 1, "layer 1 down_proj by default");
    assert!(m.tensors.iter().all(|t| t.shape.last() != Some(&2) && t.shape.last() != Some(&4)), "scales left over");
    let stored: usize =
        std::fs::metadata(fixture_named("mlx-llama-mixed").join("model.safetensors")).expect("file").len() as usize;
    // The blocks hold what the three tensors hold; the file adds its header.
    assert!(m.stored_bytes() < stored && m.stored_bytes() > stored * 9 / 10, "{} of {stored}", m.stored_bytes());
}

#[test]
fn every_fixture_loads() {
    for name in ["mlx-llama-q4-g32", "mlx-llama-q8-g32", "mlx-llama-q4-g128", "mlx-qwen3-q4-g64", "mlx-llama-mixed"] {
        ferrite_models::load(&fixture_named(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// The config's bits disagree with the packed words: the error names the weight, its shape
/// and the shape those bits need.
#[test]
fn bits_that_do_not_match_the_words() {
    let tmp = copy_fixture_named("mlx-llama-q4-g64");
    set_quant(tmp.path(), "bits", 8.into());
    let msg = load_err(tmp.path());
    assert!(msg.contains(".weight") && msg.contains("U32") && msg.contains("8-bit groups of 64"), "{msg}");
}

#[test]
fn unsupported_bits_and_group_sizes() {
    let tmp = copy_fixture_named("mlx-llama-q4-g64");
    set_quant(tmp.path(), "bits", 3.into());
    let msg = load_err(tmp.path());
    assert!(msg.contains("3-bit") && msg.contains(".weight"), "{msg}");
    let tmp = copy_fixture_named("mlx-llama-q4-g64");
    set_quant(tmp.path(), "group_size", 16.into());
    let msg = load_err(tmp.path());
    assert!(msg.contains("group size 16"), "{msg}");
    let tmp = copy_fixture_named("mlx-llama-q4-g64");
    set_quant(tmp.path(), "mode", "mxfp4".into());
    let msg = load_err(tmp.path());
    assert!(msg.contains("config.json") && msg.contains("mxfp4"), "{msg}");
}

#[test]
fn missing_biases() {
    let tmp = copy_fixture_named("mlx-llama-q4-g64");
    edit_header(tmp.path(), |h| {
        let v = h.remove("model.layers.1.mlp.up_proj.biases").expect("biases");
        h.insert("model.layers.1.mlp.up_proj.unused".into(), v);
    });
    let msg = load_err(tmp.path());
    assert!(msg.contains("model.layers.1.mlp.up_proj.biases") && msg.contains("missing"), "{msg}");
}

/// Scales of the right size but the wrong shape, and of the wrong dtype.
#[test]
fn scales_of_the_wrong_shape_or_dtype() {
    let tmp = copy_fixture_named("mlx-llama-q4-g64");
    edit_header(tmp.path(), |h| h["model.layers.0.self_attn.o_proj.scales"]["shape"] = serde_json::json!([64, 4]));
    let msg = load_err(tmp.path());
    assert!(msg.contains("model.layers.0.self_attn.o_proj.scales") && msg.contains("[128, 2]"), "{msg}");
    let tmp = copy_fixture_named("mlx-llama-q4-g64");
    edit_header(tmp.path(), |h| {
        h["model.layers.0.self_attn.o_proj.biases"]["dtype"] = "F16".into();
    });
    let msg = load_err(tmp.path());
    assert!(msg.contains("model.layers.0.self_attn.o_proj.biases") && msg.contains("scales' dtype"), "{msg}");
}

/// Packed words without MLX quantization in config.json, and a module the config leaves in
/// floats that the file quantized.
#[test]
fn config_and_file_disagree() {
    let tmp = copy_fixture_named("mlx-llama-q4-g64");
    edit_config(tmp.path(), |cfg| {
        let obj = cfg.as_object_mut().expect("object");
        obj.remove("quantization");
        obj.remove("quantization_config");
    });
    let msg = load_err(tmp.path());
    assert!(msg.contains("packed uint32") && msg.contains(".weight"), "{msg}");
    let tmp = copy_fixture_named("mlx-llama-q4-g64");
    edit_config(tmp.path(), |cfg| {
        cfg["quantization"]["model.layers.0.mlp.gate_proj"] = false.into();
    });
    let msg = load_err(tmp.path());
    assert!(msg.contains("model.layers.0.mlp.gate_proj.scales") && msg.contains("not quantized"), "{msg}");
}

/// A per-module override that names the wrong format for the stored tensors.
#[test]
fn override_that_does_not_match() {
    let tmp = copy_fixture_named("mlx-llama-mixed");
    edit_config(tmp.path(), |cfg| {
        cfg["quantization"]["lm_head"] = serde_json::json!({"group_size": 64, "bits": 8});
    });
    let msg = load_err(tmp.path());
    assert!(msg.contains("lm_head.") && msg.contains("8-bit groups of 64"), "{msg}");
}
