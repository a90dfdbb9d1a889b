//! FP8 checkpoints that do not add up give a one-line load error naming the tensor or the
//! config entry: codes without a scale, a scale of no layout the config allows,
//! e4m3 codes without an FP8 config, an FP8 scheme ferrite does not read, a routed expert's
//! codes without a scale or with a scale grid of another shape; and
//! `--quantization fp8` on the CPU. The good fixtures load (their outputs: `hf_parity`).

mod fixture_edits;

use ferrite_models::gpu::UploadQuantization;
use ferrite_models::LoadOptions;
use ferrite_runtime::cuda::DeviceChoice;
use fixture_edits::{copy_fixture_named, edit_config, edit_header, fixture_named, load_err};

const FIXTURES: [&str; 5] =
    ["fp8-llama-channel", "fp8-llama-tensor", "fp8-llama-block", "fp8-qwen2-channel", "fp8-qwen3-moe-block"];

#[test]
fn every_fixture_loads_and_reports_fp8() {
    for name in FIXTURES {
        let loaded = ferrite_models::load(&fixture_named(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(loaded.model.config().hidden_size, 128, "{name}");
    }
}

/// The load error of fixture `name` with tensor `scale` renamed to its module's `unused`.
fn error_without(name: &str, scale: &str) -> String {
    let tmp = copy_fixture_named(name);
    edit_header(tmp.path(), |h| {
        let v = h.remove(scale).expect("scale");
        let module = scale.rsplit_once('.').expect("a module's tensor").0;
        h.insert(format!("{module}.unused"), v);
    });
    load_err(tmp.path())
}

#[test]
fn codes_without_a_scale() {
    let msg = error_without("fp8-llama-channel", "model.layers.1.mlp.up_proj.weight_scale");
    assert!(msg.contains("model.layers.1.mlp.up_proj.weight") && msg.contains("without a weight_scale"), "{msg}");
}

/// A routed expert's codes without their scale, and an expert's scale grid of another shape:
/// the error names the expert's tensor.
#[test]
fn expert_scales_missing_or_misshapen() {
    let msg = error_without("fp8-qwen3-moe-block", "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv");
    assert!(
        msg.contains("model.layers.1.mlp.experts.3.up_proj.weight") && msg.contains("without a weight_scale"),
        "{msg}"
    );
    let tmp = copy_fixture_named("fp8-qwen3-moe-block");
    edit_header(tmp.path(), |h| {
        h["model.layers.0.mlp.experts.2.down_proj.weight_scale_inv"]["shape"] = serde_json::json!([1, 2]);
    });
    let msg = load_err(tmp.path());
    assert!(
        msg.contains("model.layers.0.mlp.experts.2.down_proj.weight_scale_inv") && msg.contains("not a scale layout"),
        "{msg}"
    );
}

/// A block checkpoint's scale grid of the wrong shape, and a channel scale of another row count.
#[test]
fn scales_of_no_layout() {
    let tmp = copy_fixture_named("fp8-llama-block");
    edit_header(tmp.path(), |h| {
        h["model.layers.0.mlp.down_proj.weight_scale_inv"]["shape"] = serde_json::json!([2, 1]);
    });
    let msg = load_err(tmp.path());
    assert!(msg.contains("model.layers.0.mlp.down_proj.weight_scale_inv") && msg.contains("[2, 1]"), "{msg}");
    let tmp = copy_fixture_named("fp8-llama-channel");
    edit_header(tmp.path(), |h| {
        h["model.layers.0.self_attn.o_proj.weight_scale"]["shape"] = serde_json::json!([64, 2]);
    });
    let msg = load_err(tmp.path());
    assert!(
        msg.contains("model.layers.0.self_attn.o_proj.weight_scale") && msg.contains("not a scale layout"),
        "{msg}"
    );
}

/// e4m3 codes in a checkpoint whose config declares no FP8 quantization.
#[test]
fn codes_without_a_config() {
    let tmp = copy_fixture_named("fp8-llama-tensor");
    edit_config(tmp.path(), |cfg| {
        cfg.as_object_mut().expect("object").remove("quantization_config");
    });
    let msg = load_err(tmp.path());
    assert!(msg.contains("e4m3 codes") && msg.contains("quantization_config"), "{msg}");
}

/// compressed-tensors' integer and 4-bit float schemes are other formats.
#[test]
fn schemes_ferrite_does_not_read() {
    for (ty, bits, want) in [("int", 8, "int weights are not supported"), ("float", 4, "4-bit float weights")] {
        let tmp = copy_fixture_named("fp8-llama-channel");
        edit_config(tmp.path(), |cfg| {
            let w = &mut cfg["quantization_config"]["config_groups"]["group_0"]["weights"];
            w["type"] = ty.into();
            w["num_bits"] = bits.into();
        });
        let msg = load_err(tmp.path());
        assert!(msg.contains(want), "{ty} {bits}: {msg}");
    }
}

#[test]
fn quantizing_at_load_needs_a_gpu() {
    let opts = LoadOptions { quantization: UploadQuantization::Fp8, ..Default::default() };
    let e = ferrite_models::load_with(&fixture_named("llama"), DeviceChoice::Cpu, &opts).err().expect("refused");
    assert!(e.to_string().contains("--quantization fp8") && e.to_string().contains("CUDA"), "{e}");
}
