//! MLX affine-quantized checkpoints (the mlx-community safetensors): which modules are
//! quantized and how, from `config.json`, and each quantized matrix as one MLX block tensor
//! (`ferrite_runtime::quant::mlx`) assembled from its three stored tensors.
//!
//! `config.json` holds `quantization` (mlx-lm also writes the same object as
//! `quantization_config`): `{"group_size": G, "bits": B}` (optionally `"mode": "affine"`),
//! plus an entry per module path that differs — its own `{"group_size", "bits"}`, or `false`
//! for a module left in floats. A module `m` is quantized in the file when `m.scales` is there
//! (mlx-lm skips modules whose width no group divides): then `m.weight` holds uint32 words,
//! `[out, in * bits / 32]`, and `m.scales` and `m.biases` one float per group,
//! `[out, in / group]`. Embeddings and the LM head are quantized the same way. The three stay
//! mapped (`MlxParts`) until a reader needs the matrix as blocks.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use ferrite_runtime::quant::mlx::MlxParts;
use ferrite_runtime::{Buffer, DType, MlxFormat, MlxScale, Tensor};
use serde_json::Value;

use crate::error::{LoadError, Result};
use crate::inspect::TensorMeta;
use crate::safetensors::{SafetensorsDir, Stored};

/// (bits, group size) of a quantized module.
type Params = (u32, usize);

/// A checkpoint's MLX quantization: the default and the per-module entries.
#[derive(Debug, Clone)]
pub struct MlxQuantization {
    default: Params,
    /// Module path → its own parameters, or `None` when it stays in floats.
    modules: HashMap<String, Option<Params>>,
}

/// `(bits, group_size)` of a quantization object, or why it is not one ferrite reads.
fn params(path: &Path, what: &str, v: &Value) -> Result<Params> {
    let bad = |m: String| LoadError::format(path, format!("{what}: {m}"));
    if let Some(mode) = v.get("mode").and_then(Value::as_str) {
        if mode != "affine" {
            return Err(bad(format!("MLX quantization mode '{mode}' is not supported (affine is)")));
        }
    }
    let int = |k: &str| v.get(k).and_then(Value::as_u64).ok_or_else(|| bad(format!("no integer '{k}'")));
    Ok((int("bits")? as u32, int("group_size")? as usize))
}

impl MlxQuantization {
    /// The MLX quantization `config.json` (`json`, read from `path`) declares: `quantization`,
    /// or `quantization_config` when it is MLX's (no `quant_method`); `None` when neither.
    pub fn from_config(path: &Path, json: &Value) -> Result<Option<MlxQuantization>> {
        let q = match (json.get("quantization"), json.get("quantization_config")) {
            (Some(q), _) => q,
            (None, Some(q)) if q.get("quant_method").is_none() && q.get("bits").is_some() => q,
            _ => return Ok(None),
        };
        let obj = q.as_object().ok_or_else(|| LoadError::format(path, "quantization is not an object"))?;
        let default = params(path, "quantization", q)?;
        let mut modules = HashMap::new();
        for (key, v) in obj {
            match v {
                Value::Object(_) => {
                    modules.insert(key.clone(), Some(params(path, &format!("quantization.{key}"), v)?));
                }
                Value::Bool(false) => {
                    modules.insert(key.clone(), None);
                }
                // The defaults themselves and `true` (the default applies).
                _ => {}
            }
        }
        Ok(Some(MlxQuantization { default, modules }))
    }

    /// `module`'s parameters, `None` when the config leaves it in floats.
    fn params_of(&self, module: &str) -> Option<Params> {
        match self.modules.get(module) {
            Some(p) => *p,
            None => Some(self.default),
        }
    }

    /// The format of the quantized module `module` of `st` (its `scales` present), checking
    /// the config and the scales' and biases' dtypes.
    fn format(&self, st: &SafetensorsDir, module: &str) -> Result<MlxFormat> {
        let path = st.path_of(&format!("{module}.scales"));
        let (bits, group) = self.params_of(module).ok_or_else(|| {
            LoadError::tensor(
                path,
                &format!("{module}.scales"),
                "config.json's quantization says this module is not quantized",
            )
        })?;
        let scale_dtype = |name: &str| -> Result<MlxScale> {
            match st.raw(name)?.0 {
                Stored::Float(d) => MlxScale::of(d)
                    .ok_or_else(|| LoadError::tensor(path, name, format!("{d} is not a scale type (bf16, f16, f32)"))),
                Stored::U32 => Err(LoadError::tensor(path, name, "uint32, expected the weights' float type")),
            }
        };
        let biases = format!("{module}.biases");
        if !st.contains(&biases) {
            return Err(LoadError::tensor(path, &biases, "missing (MLX affine quantization stores a bias per group)"));
        }
        let scale = scale_dtype(&format!("{module}.scales"))?;
        if scale_dtype(&biases)? != scale {
            return Err(LoadError::tensor(path, &biases, "not in the scales' dtype"));
        }
        MlxFormat::new(bits, group, scale)
            .map_err(|e| LoadError::tensor(path, &format!("{module}.weight"), e.to_string()))
    }

    /// Whether `module` is stored quantized in `st`.
    pub fn quantized(st: &SafetensorsDir, module: &str) -> bool {
        st.contains(&format!("{module}.scales"))
    }

    /// The block dtype of the quantized module `module` (for reports), if it is one.
    pub fn dtype_of(&self, st: &SafetensorsDir, module: &str) -> Option<DType> {
        Self::quantized(st, module).then(|| self.format(st, module).ok().map(DType::Mlx)).flatten()
    }

    /// `{module}.weight` of logical `shape` (`[.., out, in]`) as one tensor of MLX blocks over
    /// the mapped words, scales and biases, each stored tensor's dtype and shape checked (an error names the tensor and says what
    /// was expected). `module` must be quantized in `st`.
    pub fn matrix(&self, st: &SafetensorsDir, module: &str, shape: &[usize]) -> Result<Tensor> {
        let f = self.format(st, module)?;
        let wname = format!("{module}.weight");
        let path = st.path_of(&wname);
        let (Some(&k), true) = (shape.last(), shape.len() >= 2) else {
            return Err(LoadError::tensor(path, &wname, format!("a quantized tensor of shape {shape:?}")));
        };
        let lead = &shape[..shape.len() - 1];
        let with_last = |last: usize| lead.iter().copied().chain([last]).collect::<Vec<usize>>();
        if !k.is_multiple_of(f.group()) {
            return Err(LoadError::tensor(
                path,
                &wname,
                format!("{k} input features are not whole groups of {} ({})", f.group(), f.name()),
            ));
        }
        let expect = |name: &str, stored: Stored, want: Vec<usize>| -> Result<Buffer> {
            let (got, got_shape, bytes) = st.raw(name)?;
            if got != stored || got_shape != want.as_slice() {
                return Err(LoadError::tensor(
                    st.path_of(name),
                    name,
                    format!(
                        "{got} {got_shape:?}, expected {stored} {want:?} for {}-bit groups of {} over a {shape:?} matrix",
                        f.bits(),
                        f.group()
                    ),
                ));
            }
            Ok(bytes)
        };
        let words = expect(&wname, Stored::U32, with_last(k * f.bits() as usize / 32))?;
        let sd = Stored::Float(f.scale().dtype());
        let scales = expect(&format!("{module}.scales"), sd, with_last(k / f.group()))?;
        let biases = expect(&format!("{module}.biases"), sd, with_last(k / f.group()))?;
        let rows = lead.iter().product();
        let bad = |e: ferrite_runtime::RuntimeError| LoadError::tensor(path, &wname, e.to_string());
        let parts = MlxParts::new(f, rows, k, words, scales, biases).map_err(bad)?;
        Tensor::new(DType::Mlx(f), shape.to_vec(), Buffer::Mlx(Arc::new(parts))).map_err(bad)
    }

    /// The tensors of `st` as the model holds them: each quantized module's three tensors as
    /// one MLX tensor of its logical shape (for `inspect`). A packed tensor without scales is
    /// an error.
    pub fn metas(q: Option<&MlxQuantization>, st: &SafetensorsDir) -> Result<Vec<TensorMeta>> {
        let mut out = Vec::new();
        for (name, stored, shape) in st.tensors() {
            let quantized_part =
                |suffix: &str| name.strip_suffix(suffix).is_some_and(|m| q.is_some() && Self::quantized(st, m));
            if quantized_part(".scales") || quantized_part(".biases") {
                continue;
            }
            match (stored, q, name.strip_suffix(".weight")) {
                (Stored::Float(dtype), _, _) => out.push(TensorMeta { dtype, shape: shape.to_vec() }),
                (Stored::U32, Some(q), Some(module)) if Self::quantized(st, module) => {
                    let f = q.format(st, module)?;
                    let mut logical = shape.to_vec();
                    if let Some(last) = logical.last_mut() {
                        *last = *last * 32 / f.bits() as usize;
                    }
                    out.push(TensorMeta { dtype: DType::Mlx(f), shape: logical });
                }
                (Stored::U32, _, _) => {
                    return Err(LoadError::tensor(
                        st.path_of(name),
                        name,
                        "packed uint32 words without MLX scales and `quantization` in config.json",
                    ))
                }
            }
        }
        Ok(out)
    }
}
