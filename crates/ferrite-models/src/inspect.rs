//! `inspect`: what a model says of itself without loading its weights — its config and
//! decoder plan (from `config.json` or the GGUF metadata) and the dtype and shape of every
//! tensor (from the safetensors headers or the GGUF tensor table). `fit` sizes memory from it
//! and `ferrite models` checks with it whether ferrite can run a model.

use std::path::Path;

use ferrite_runtime::DType;

use crate::config::{ConfigSource, ModelConfig};
use crate::error::{LoadError, Result};
use crate::gguf::GgufFile;
use crate::mlx::MlxQuantization;
use crate::plan::DecoderPlan;
use crate::safetensors::SafetensorsDir;

/// How a model's weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// An HF directory of safetensors files.
    Safetensors,
    Gguf,
}

/// One tensor of the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorMeta {
    pub dtype: DType,
    /// Row-major, outermost first.
    pub shape: Vec<usize>,
}

impl TensorMeta {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of the tensor as stored.
    pub fn stored_bytes(&self) -> usize {
        let row = self.shape.last().copied().unwrap_or(1);
        let rows = self.numel() / row.max(1);
        self.dtype.row_bytes(row).map_or(0, |b| b * rows)
    }
}

/// A model's shape, read without its weights.
pub struct Inspected {
    pub format: Format,
    pub cfg: ModelConfig,
    pub plan: DecoderPlan,
    pub tensors: Vec<TensorMeta>,
}

impl Inspected {
    /// Bytes of all tensors as stored (what the CPU maps).
    pub fn stored_bytes(&self) -> usize {
        self.tensors.iter().map(TensorMeta::stored_bytes).sum()
    }
}

/// Read the config, plan and tensor table of the HF directory or `.gguf` file at `path`.
pub fn inspect(path: &Path) -> Result<Inspected> {
    if path.is_dir() {
        let cfg_path = path.join("config.json");
        if !cfg_path.is_file() {
            return Err(LoadError::format(path, "not a model directory: config.json is missing"));
        }
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| LoadError::io(&cfg_path, e))?;
        let json =
            serde_json::from_str(&text).map_err(|e| LoadError::format(&cfg_path, format!("invalid JSON: {e}")))?;
        let json = crate::config::text_config(json);
        let mut cfg = ModelConfig::from_hf_json(&cfg_path, &json)?;
        let plan = (cfg.arch.plan)(&mut cfg, &ConfigSource::Hf { path: &cfg_path, json: &json })?;
        let st = SafetensorsDir::open(path)?;
        let mlx = MlxQuantization::from_config(&cfg_path, &json)?;
        let tensors = MlxQuantization::metas(mlx.as_ref(), &st)?;
        Ok(Inspected { format: Format::Safetensors, cfg, plan, tensors })
    } else if path.is_file() {
        let g = GgufFile::open(path)?;
        let mut cfg = ModelConfig::from_gguf(&g)?;
        let plan = (cfg.arch.plan)(&mut cfg, &ConfigSource::Gguf(&g))?;
        let tensors = g.tensors.iter().map(|t| TensorMeta { dtype: t.dtype, shape: t.shape() }).collect();
        Ok(Inspected { format: Format::Gguf, cfg, plan, tensors })
    } else {
        Err(LoadError::format(path, "no such model directory or .gguf file"))
    }
}

/// The architecture a model names (`model_type`, `general.architecture`), even one ferrite
/// does not run; None when the files do not say.
pub fn architecture_name(path: &Path) -> Option<String> {
    if path.is_dir() {
        let text = std::fs::read_to_string(path.join("config.json")).ok()?;
        let json: serde_json::Value = serde_json::from_str(&text).ok()?;
        json.get("model_type")?.as_str().map(String::from)
    } else {
        GgufFile::open(path).ok()?.architecture().ok().map(String::from)
    }
}
