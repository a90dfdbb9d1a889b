//! LoRA adapters as PEFT saves them: a directory with `adapter_config.json` and
//! `adapter_model.safetensors`. `LoraAdapter::load` reads and checks one — plain LoRA only
//! (`peft_type` LORA, no DoRA, no trained biases or saved modules, one rank and alpha for
//! every module), rank at most the server's maximum — into f32 matrices per (layer,
//! projection). The projections it may target are the attention's q, k, v, o and the MLP's
//! gate, up and down; the scale is `lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA).
//! Whether its shapes fit a base model is checked when a model attaches it (`cpu`).

pub mod cpu;

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{LoadError, Result};
use crate::safetensors::SafetensorsDir;

/// The largest rank an adapter may have (`--max-lora-rank` may lower it).
pub const MAX_LORA_RANK: usize = 64;

/// A projection of a decoder layer an adapter may adapt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoraTarget {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl LoraTarget {
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// The module's name in HF llama-style models (`q_proj`, ..., `down_proj`).
    pub fn module(self) -> &'static str {
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"][self.index()]
    }

    pub fn index(self) -> usize {
        self as usize
    }

    fn from_module(name: &str) -> Option<LoraTarget> {
        LoraTarget::ALL.into_iter().find(|t| t.module() == name)
    }
}

/// One adapted projection: `A` is `[rank, in_features]`, `B` is `[out_features, rank]`.
#[derive(Debug, Clone)]
pub struct LoraModule {
    pub layer: usize,
    pub target: LoraTarget,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub in_features: usize,
    pub out_features: usize,
}

/// A LoRA adapter read from its PEFT directory.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    pub path: PathBuf,
    pub rank: usize,
    /// What `B · A` is multiplied by.
    pub scale: f32,
    pub modules: Vec<LoraModule>,
    /// FNV-1a of the config and weight files: two loads of the same files compute the same
    /// KV, so the prefix cache may share their blocks.
    pub digest: u64,
}

/// A tensor's f32 values and shape.
type Matrix = (Vec<f32>, Vec<usize>);

/// FNV-1a over `bytes`, continuing from `h`.
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Where the adapter tensor `name` belongs: (layer, projection, whether it is `B`).
fn parse_tensor(path: &Path, name: &str) -> Result<(usize, LoraTarget, bool)> {
    let bad = |m: String| LoadError::tensor(path, name, m);
    if name.contains("lora_magnitude_vector") {
        return Err(bad("a DoRA magnitude vector: DoRA adapters are not supported (plain LoRA only)".into()));
    }
    let (module, is_b) = match (name.strip_suffix(".lora_A.weight"), name.strip_suffix(".lora_B.weight")) {
        (Some(m), _) => (m, false),
        (_, Some(m)) => (m, true),
        _ => return Err(bad("not a LoRA A or B weight (only lora_A/lora_B matrices are supported)".into())),
    };
    let (prefix, proj) = module.rsplit_once('.').ok_or_else(|| bad("no module path".into()))?;
    let target = LoraTarget::from_module(proj).ok_or_else(|| {
        let known: Vec<&str> = LoraTarget::ALL.iter().map(|t| t.module()).collect();
        bad(format!("adapts '{proj}', which is not supported (supported: {})", known.join(", ")))
    })?;
    let layer = prefix
        .split_once("layers.")
        .and_then(|(_, rest)| rest.split('.').next())
        .and_then(|i| i.parse::<usize>().ok())
        .ok_or_else(|| bad("no decoder layer index in its name".into()))?;
    Ok((layer, target, is_b))
}

/// The adapter config's fields that change what the adapter computes, checked: (rank, scale).
fn read_config(path: &Path, json: &Value, max_rank: usize) -> Result<(usize, f32)> {
    let bad = |m: String| LoadError::format(path, m);
    let peft_type = json.get("peft_type").and_then(Value::as_str).unwrap_or("LORA");
    if peft_type != "LORA" {
        return Err(bad(format!("peft_type {peft_type} is not supported (LORA only)")));
    }
    let flag = |k: &str| json.get(k).and_then(Value::as_bool).unwrap_or(false);
    if flag("use_dora") {
        return Err(bad("DoRA adapters (use_dora) are not supported (plain LoRA only)".into()));
    }
    if flag("fan_in_fan_out") {
        return Err(bad("fan_in_fan_out adapters (Conv1D bases) are not supported".into()));
    }
    match json.get("bias").and_then(Value::as_str) {
        None | Some("none") => {}
        Some(b) => return Err(bad(format!("bias \"{b}\": adapters that train biases are not supported"))),
    }
    if json.get("modules_to_save").is_some_and(|m| !m.is_null() && m.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(bad("modules_to_save: adapters that replace whole modules are not supported".into()));
    }
    // Variants that change what the adapter computes beyond `B · A` (PEFT's names).
    for k in ["lora_bias", "use_qalora", "use_bdlora"] {
        if flag(k) {
            return Err(bad(format!("{k}: this LoRA variant is not supported (plain LoRA only)")));
        }
    }
    for k in ["layer_replication", "trainable_token_indices", "target_parameters", "alora_invocation_tokens"] {
        if json.get(k).is_some_and(|v| !v.is_null()) {
            return Err(bad(format!("{k}: this LoRA variant is not supported (plain LoRA only)")));
        }
    }
    for k in ["rank_pattern", "alpha_pattern"] {
        if json.get(k).and_then(Value::as_object).is_some_and(|m| !m.is_empty()) {
            return Err(bad(format!("{k}: per-module ranks or alphas are not supported")));
        }
    }
    if let Some(list) = json.get("target_modules").and_then(Value::as_array) {
        for m in list.iter().filter_map(Value::as_str) {
            if LoraTarget::from_module(m).is_none() {
                let known: Vec<&str> = LoraTarget::ALL.iter().map(|t| t.module()).collect();
                return Err(bad(format!("target module '{m}' is not supported (supported: {})", known.join(", "))));
            }
        }
    }
    let rank = json.get("r").and_then(Value::as_u64).ok_or_else(|| bad("no rank 'r'".into()))? as usize;
    if rank == 0 || rank > max_rank {
        return Err(bad(format!("rank {rank} is outside 1..={max_rank} (--max-lora-rank)")));
    }
    let alpha = json.get("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0) as f32;
    if !alpha.is_finite() {
        return Err(bad(format!("lora_alpha {alpha} is not finite")));
    }
    let scale = if flag("use_rslora") { alpha / (rank as f32).sqrt() } else { alpha / rank as f32 };
    Ok((rank, scale))
}

impl LoraAdapter {
    /// Read the PEFT adapter directory `dir`; its rank must be at most `max_rank`.
    pub fn load(dir: &Path, max_rank: usize) -> Result<LoraAdapter> {
        let cfg_path = dir.join("adapter_config.json");
        let weights_path = dir.join("adapter_model.safetensors");
        if !dir.is_dir() {
            return Err(LoadError::format(dir, "no such adapter directory"));
        }
        let cfg_bytes = std::fs::read(&cfg_path).map_err(|e| LoadError::io(&cfg_path, e))?;
        let json: Value = serde_json::from_slice(&cfg_bytes)
            .map_err(|e| LoadError::format(&cfg_path, format!("invalid JSON: {e}")))?;
        let (rank, scale) = read_config(&cfg_path, &json, max_rank)?;
        if !weights_path.is_file() {
            return Err(LoadError::format(dir, "no adapter_model.safetensors (the only weight file read)"));
        }
        let bytes = std::fs::read(&weights_path).map_err(|e| LoadError::io(&weights_path, e))?;
        let file = SafetensorsDir::from_bytes(&weights_path, &bytes)?;
        let mut pairs: std::collections::BTreeMap<(usize, usize), [Option<Matrix>; 2]> = Default::default();
        for (name, _, shape) in file.tensors() {
            let (layer, target, is_b) = parse_tensor(&weights_path, name)?;
            let values = file.tensor(name)?.to_f32_vec()?;
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                return Err(LoadError::tensor(&weights_path, name, format!("value {i} is not finite (corrupt file?)")));
            }
            pairs.entry((layer, target.index())).or_default()[is_b as usize] = Some((values, shape.to_vec()));
        }
        if pairs.is_empty() {
            return Err(LoadError::format(&weights_path, "holds no LoRA weights"));
        }
        let mut modules = Vec::with_capacity(pairs.len());
        for ((layer, t), [a, b]) in pairs {
            let target = LoraTarget::ALL[t];
            let what = format!("layers.{layer}.{}", target.module());
            let (Some((a, a_shape)), Some((b, b_shape))) = (a, b) else {
                return Err(LoadError::format(&weights_path, format!("{what} lacks its lora_A or lora_B weight")));
            };
            match (a_shape.as_slice(), b_shape.as_slice()) {
                (&[ra, inp], &[out, rb]) if ra == rank && rb == rank => {
                    modules.push(LoraModule { layer, target, a, b, in_features: inp, out_features: out })
                }
                _ => {
                    return Err(LoadError::format(
                        &weights_path,
                        format!("{what}: lora_A {a_shape:?} and lora_B {b_shape:?} do not have rank {rank} (r)"),
                    ))
                }
            }
        }
        let digest = fnv(fnv(0xcbf2_9ce4_8422_2325, &cfg_bytes), &bytes);
        Ok(LoraAdapter { path: dir.to_path_buf(), rank, scale, modules, digest })
    }

    /// A random adapter of `rank` over every projection `shapes` lists (per layer, (in, out)
    /// features in `LoraTarget` order; `CausalLm::lora_shapes`), for benchmarks: A uniform
    /// with a unit-variance shrink, B small, scale 1, a digest from `seed`.
    pub fn random(shapes: &[[Option<(usize, usize)>; 7]], rank: usize, seed: u64) -> LoraAdapter {
        // splitmix64: uniform in [-1, 1) from a counter.
        let mut state = seed;
        let mut uniform = move || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        let mut modules = Vec::new();
        for (layer, targets) in shapes.iter().enumerate() {
            for (target, shape) in LoraTarget::ALL.into_iter().zip(targets) {
                let Some((inp, out)) = *shape else { continue };
                let amp = (3.0 / inp as f32).sqrt();
                let a = (0..rank * inp).map(|_| amp * uniform()).collect();
                let b = (0..out * rank).map(|_| 0.01 * uniform()).collect();
                modules.push(LoraModule { layer, target, a, b, in_features: inp, out_features: out });
            }
        }
        let path = PathBuf::from(format!("synthetic-lora-{seed}"));
        LoraAdapter { path, rank, scale: 1.0, modules, digest: fnv(0xcbf2_9ce4_8422_2325, &seed.to_le_bytes()).max(1) }
    }

    /// Whether every module fits a base of `layers` layers whose projection `target` of layer
    /// `i` maps `shape(i, target) = Some((in, out))` features (None: the layer has no such
    /// projection); a mismatch names the layer, the projection and both shapes.
    pub fn check_fits(&self, layers: usize, shape: impl Fn(usize, LoraTarget) -> Option<(usize, usize)>) -> Result<()> {
        let mismatch = |m: String| LoadError::format(&self.path, format!("does not fit the base model: {m}"));
        for m in &self.modules {
            let what = format!("layers.{}.{}", m.layer, m.target.module());
            if m.layer >= layers {
                return Err(mismatch(format!("{what}: the base has {layers} layers")));
            }
            let (inp, out) = shape(m.layer, m.target)
                .ok_or_else(|| mismatch(format!("{what}: the base layer has no such projection")))?;
            if (m.in_features, m.out_features) != (inp, out) {
                return Err(mismatch(format!(
                    "{what} maps {} → {} features, the base projection {inp} → {out}",
                    m.in_features, m.out_features
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn config_checks_name_what_is_unsupported() {
        let p = Path::new("adapter_config.json");
        let ok = json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]});
        assert_eq!(read_config(p, &ok, 64).unwrap(), (8, 2.0));
        let rs = json!({"r": 16, "lora_alpha": 8, "use_rslora": true});
        assert_eq!(read_config(p, &rs, 64).unwrap(), (16, 2.0));
        let cases = [
            (json!({"r": 8, "use_dora": true}), "DoRA"),
            (json!({"r": 128}), "rank 128"),
            (json!({"r": 8, "target_modules": ["lm_head"]}), "'lm_head'"),
            (json!({"r": 8, "peft_type": "IA3"}), "IA3"),
            (json!({"r": 8, "bias": "all"}), "biases"),
            (json!({"r": 8, "modules_to_save": ["lm_head"]}), "modules_to_save"),
            (json!({"r": 8, "rank_pattern": {"q_proj": 4}}), "rank_pattern"),
        ];
        for (cfg, says) in cases {
            let e = read_config(p, &cfg, 64).unwrap_err().to_string();
            assert!(e.contains(says), "{cfg}: {e}");
        }
    }

    #[test]
    fn tensor_names_map_to_layer_and_projection() {
        let p = Path::new("adapter_model.safetensors");
        let n = "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight";
        assert_eq!(parse_tensor(p, n).unwrap(), (3, LoraTarget::Down, true));
        let n = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
        assert_eq!(parse_tensor(p, n).unwrap(), (0, LoraTarget::Q, false));
        assert!(parse_tensor(p, "base_model.model.lm_head.lora_A.weight").is_err());
        let dora = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector";
        assert!(parse_tensor(p, dora).unwrap_err().to_string().contains("DoRA"));
    }
}
