//! The LoRA fixtures (`scripts/goldens/make_lora_adapters.py`, over the tiny llama fixture)
//! shared by the CPU and CUDA LoRA tests: the adapters, PEFT's reference, a core with
//! adapters loaded, and the mixed requests of the co-batching checks.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrite_engine::{EngineConfig, EngineCore, RequestParams};
use ferrite_models::lora::{LoraAdapter, MAX_LORA_RANK};
use ferrite_models::model::CausalLm;
use serde_json::Value;

/// The adapters that fit the tiny llama, with PEFT references.
pub const ADAPTERS: [&str; 3] = ["qv", "all", "mlp-late"];

pub fn lora_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/lora").join(name)
}

pub fn adapter(name: &str) -> LoraAdapter {
    LoraAdapter::load(&lora_dir(name), MAX_LORA_RANK).unwrap_or_else(|e| panic!("adapter {name}: {e}"))
}

/// PEFT's last-position logits and greedy tokens per adapter and prompt.
pub fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(lora_dir("reference.json")).expect("reference.json")).expect("json")
}

/// A core over `model` with every adapter of `names` loaded under its name.
pub fn core_with_adapters(model: &Arc<dyn CausalLm>, cfg: EngineConfig, names: &[&str]) -> EngineCore {
    let mut c = super::core(model, cfg);
    for name in names {
        c.load_adapter(name, &adapter(name)).unwrap_or_else(|e| panic!("load {name}: {e}"));
    }
    c
}

pub fn with_adapter(params: RequestParams, name: Option<&str>) -> RequestParams {
    RequestParams { adapter: name.map(String::from), ..params }
}

/// Eight requests over three adapters and the base, with mixed prompt lengths: (prompt,
/// adapter, max tokens).
pub fn mixed_requests(vocab: u32) -> Vec<(Vec<u32>, Option<&'static str>, usize)> {
    let choices = [Some("qv"), None, Some("all"), Some("mlp-late"), Some("qv"), Some("all"), None, Some("mlp-late")];
    (0..8)
        .map(|i| {
            let len = 3 + 11 * i % 37;
            let prompt = (0..len).map(|j| (1 + (j * 31 + i * 17) as u32) % vocab).collect();
            (prompt, choices[i], 6 + i % 5)
        })
        .collect()
}
