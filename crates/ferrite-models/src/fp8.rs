//! FP8 checkpoints (e4m3 weights with f32 scales) as users download them, and the one form
//! ferrite holds them in.
//!
//! `config.json`'s `quantization_config` says the checkpoint is FP8:
//! - `"quant_method": "compressed-tensors"` (llm-compressor, the `-FP8`/`-FP8-dynamic`
//!   checkpoints): a config group whose `weights` are `{"num_bits": 8, "type": "float"}` with
//!   `strategy` `tensor`, `channel`, `group` (`group_size`) or `block` (`block_structure`);
//!   each quantized module stores `weight` (F8_E4M3) and `weight_scale`;
//! - `"quant_method": "fp8"` (transformers' fine-grained FP8, DeepSeek/Qwen3 `-FP8`):
//!   `weight_block_size` `[128, 128]` (or none: one scale per tensor); `weight` and
//!   `weight_scale_inv` (a multiplier despite its name);
//! - `"quant_method": "fbgemm_fp8"`: `weight` and a per-channel `weight_scale`.
//!
//! In every scheme `w[r, c] = e4m3(q[r, c]) × scale(r, c)`. Whatever the checkpoint's
//! granularity, a matrix is held as `Fp8Weight`: its codes and one scale per row and run of
//! `col_block` columns (a tensor or channel scale: one per row; a 128×128 block scale: one
//! per row and 128 columns, the block row's scale repeated down its rows). That form stacks
//! (a fused QKV concatenates rows) and is what the CUDA kernels read. Activations are always
//! quantized per token at run time (a checkpoint's static `input_scale` is not used).

use std::path::Path;

use ferrite_runtime::quant::e4m3_to_f32;
use ferrite_runtime::{Buffer, DType, Tensor};
use serde_json::Value;

use crate::error::{LoadError, Result};
use crate::safetensors::{SafetensorsDir, Stored};

/// How a checkpoint's scale tensors are laid out, when the config says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Granularity {
    /// Read from each scale tensor's shape: one value (per tensor) or one per row (channel).
    FromShape,
    /// `[ceil(rows / b0), ceil(cols / b1)]` scales of `b0 × b1` blocks.
    Block(usize, usize),
    /// `[rows, cols / group]`: one scale per row and `group` columns.
    Group(usize),
}

/// A checkpoint's FP8 quantization.
#[derive(Debug, Clone)]
pub struct Fp8Quantization {
    granularity: Granularity,
    /// The float type the CPU dequantizes to (the checkpoint's `torch_dtype`).
    float: DType,
}

/// An FP8 matrix as ferrite holds it (see the module doc).
#[derive(Debug, Clone)]
pub struct Fp8Weight {
    pub rows: usize,
    pub cols: usize,
    /// `rows × cols` e4m3 codes, row-major.
    pub codes: Vec<u8>,
    /// Columns one scale covers along a row (`cols` for a tensor or channel scale).
    pub col_block: usize,
    /// `rows × cols.div_ceil(col_block)` scales, row-major.
    pub scales: Vec<f32>,
}

impl Fp8Weight {
    /// Scales per row.
    pub fn col_blocks(&self) -> usize {
        self.cols.div_ceil(self.col_block)
    }

    /// The values as f32, exactly `e4m3(q) × scale` (one f32 rounding).
    pub fn dequantize(&self) -> Vec<f32> {
        let nb = self.col_blocks();
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for (r, row) in self.codes.chunks_exact(self.cols).enumerate() {
            let scales = &self.scales[r * nb..(r + 1) * nb];
            out.extend(row.iter().enumerate().map(|(c, &q)| e4m3_to_f32(q) * scales[c / self.col_block]));
        }
        out
    }

    /// Rows `range` of this matrix.
    pub fn slice_rows(&self, range: std::ops::Range<usize>) -> Fp8Weight {
        let nb = self.col_blocks();
        Fp8Weight {
            rows: range.len(),
            cols: self.cols,
            codes: self.codes[range.start * self.cols..range.end * self.cols].to_vec(),
            col_block: self.col_block,
            scales: self.scales[range.start * nb..range.end * nb].to_vec(),
        }
    }

    /// The rows in `order` (`order[i]` is the source row of row i).
    pub fn permute_rows(&self, order: &[usize]) -> Fp8Weight {
        let nb = self.col_blocks();
        Fp8Weight {
            rows: order.len(),
            cols: self.cols,
            codes: order.iter().flat_map(|&r| &self.codes[r * self.cols..(r + 1) * self.cols]).copied().collect(),
            col_block: self.col_block,
            scales: order.iter().flat_map(|&r| &self.scales[r * nb..(r + 1) * nb]).copied().collect(),
        }
    }

    /// This matrix with its scales over runs of `col_block` columns (a multiple-of-runs
    /// refinement: each coarser scale repeated), so that matrices of different granularity
    /// stack.
    pub fn with_col_block(self, col_block: usize) -> Fp8Weight {
        if col_block == self.col_block {
            return self;
        }
        let (old, new, from) = (self.col_blocks(), self.cols.div_ceil(col_block), &self.scales);
        let scales = (0..self.rows)
            .flat_map(|r| (0..new).map(move |b| from[r * old + (b * col_block) / self.col_block]))
            .collect();
        Fp8Weight { col_block, scales, ..self }
    }
}

fn float_dtype(json: &Value) -> DType {
    match json.get("torch_dtype").or_else(|| json.get("dtype")).and_then(Value::as_str) {
        Some("float32") => DType::F32,
        Some("float16") => DType::F16,
        _ => DType::BF16,
    }
}

/// The `[b0, b1]` of a JSON pair of positive integers.
fn pair(v: &Value) -> Option<(usize, usize)> {
    let a = v.as_array()?;
    let get = |i: usize| a.get(i)?.as_u64().filter(|&x| x > 0).map(|x| x as usize);
    (a.len() == 2).then_some((get(0)?, get(1)?))
}

impl Fp8Quantization {
    /// The FP8 quantization `config.json` (`json`, read from `path`) declares, `None` when it
    /// declares none (or another method), an error for an FP8 variant ferrite does not read.
    pub fn from_config(path: &Path, json: &Value) -> Result<Option<Fp8Quantization>> {
        let Some(q) = json.get("quantization_config") else { return Ok(None) };
        let bad = |m: String| LoadError::format(path, format!("quantization_config: {m}"));
        let float = float_dtype(json);
        let granularity = match q.get("quant_method").and_then(Value::as_str) {
            Some("fbgemm_fp8") => Granularity::FromShape,
            Some("fp8") => match q.get("weight_block_size") {
                None | Some(Value::Null) => Granularity::FromShape,
                Some(b) => {
                    let (b0, b1) = pair(b).ok_or_else(|| bad(format!("weight_block_size {b} is not [rows, cols]")))?;
                    Granularity::Block(b0, b1)
                }
            },
            Some("compressed-tensors") => {
                let groups = q.get("config_groups").and_then(Value::as_object);
                let weights: Vec<&Value> =
                    groups.into_iter().flat_map(|g| g.values()).filter_map(|g| g.get("weights")).collect();
                let Some(w) = weights.first() else { return Ok(None) };
                let ty = w.get("type").and_then(Value::as_str);
                let bits = w.get("num_bits").and_then(Value::as_u64);
                if ty != Some("float") {
                    // Integer schemes (W8A8 int, W4A16) are other formats.
                    return Err(bad(format!(
                        "compressed-tensors {}-bit {} weights are not supported (FP8 float weights are)",
                        bits.unwrap_or(0),
                        ty.unwrap_or("?")
                    )));
                }
                if bits != Some(8) {
                    return Err(bad(format!(
                        "{}-bit float weights are not supported (8-bit e4m3 is)",
                        bits.unwrap_or(0)
                    )));
                }
                let strategies: Vec<&str> =
                    weights.iter().filter_map(|w| w.get("strategy").and_then(Value::as_str)).collect();
                if strategies.windows(2).any(|s| s[0] != s[1]) {
                    return Err(bad(format!("config groups of different weight strategies {strategies:?}")));
                }
                match strategies.first().copied().unwrap_or("tensor") {
                    "tensor" | "channel" => Granularity::FromShape,
                    "group" => {
                        let g = w.get("group_size").and_then(Value::as_u64).filter(|&g| g > 0);
                        Granularity::Group(g.ok_or_else(|| bad("group strategy without a group_size".into()))? as usize)
                    }
                    "block" => {
                        let b = w.get("block_structure").and_then(pair);
                        let (b0, b1) = b.ok_or_else(|| bad("block strategy without a block_structure".into()))?;
                        Granularity::Block(b0, b1)
                    }
                    other => return Err(bad(format!("weight strategy '{other}' is not supported"))),
                }
            }
            _ => return Ok(None),
        };
        Ok(Some(Fp8Quantization { granularity, float }))
    }

    /// The float type the CPU dequantizes to.
    pub fn float(&self) -> DType {
        self.float
    }

    /// The name of `module`'s scale tensor in `st`, when `{module}.weight` is stored as e4m3.
    fn scale_name(st: &SafetensorsDir, module: &str) -> Option<String> {
        let (stored, _, _) = st.raw(&format!("{module}.weight")).ok()?;
        if stored != Stored::Float(DType::F8E4M3) {
            return None;
        }
        ["weight_scale", "weight_scale_inv"].iter().map(|s| format!("{module}.{s}")).find(|n| st.contains(n))
    }

    /// Whether `{module}.weight` is stored as FP8 codes in `st`.
    pub fn quantized(st: &SafetensorsDir, module: &str) -> bool {
        st.raw(&format!("{module}.weight")).is_ok_and(|(s, _, _)| s == Stored::Float(DType::F8E4M3))
    }

    /// `{module}.weight`, `[rows, cols]`, as codes and scales (each stored tensor's dtype and
    /// shape checked; an error names the tensor and says what was expected).
    pub fn weight(&self, st: &SafetensorsDir, module: &str, rows: usize, cols: usize) -> Result<Fp8Weight> {
        let wname = format!("{module}.weight");
        let path = st.path_of(&wname);
        let sname = Self::scale_name(st, module).ok_or_else(|| {
            LoadError::tensor(path, &wname, "e4m3 codes without a weight_scale or weight_scale_inv tensor")
        })?;
        let (_, shape, codes) = st.raw(&wname)?;
        if shape != [rows, cols] {
            return Err(LoadError::tensor(path, &wname, format!("shape {shape:?}, expected [{rows}, {cols}]")));
        }
        let codes = codes.bytes().to_vec();
        let (stored, sshape, sbytes) = st.raw(&sname)?;
        let scale_err = |m: String| LoadError::tensor(st.path_of(&sname), &sname, m);
        let Stored::Float(sd) = stored else { return Err(scale_err(format!("{stored}, expected float scales"))) };
        if sd == DType::F8E4M3 {
            return Err(scale_err("e4m3 scales, expected f32, bf16 or f16".into()));
        }
        let sshape = sshape.to_vec();
        let values = Tensor::new(sd, sshape.clone(), sbytes)
            .and_then(|t| t.to_f32_vec())
            .map_err(|e| scale_err(e.to_string()))?;
        if let Some(v) = values.iter().find(|v| !v.is_finite() || **v < 0.0) {
            return Err(scale_err(format!("scale {v} (scales are finite and non-negative)")));
        }
        let n = values.len();
        let (col_block, scales) = match self.granularity {
            _ if n == 1 => (cols, vec![values[0]; rows]),
            Granularity::FromShape if n == rows && sshape.iter().filter(|&&d| d != 1).count() <= 1 => (cols, values),
            Granularity::Group(g) if cols.is_multiple_of(g) && sshape == [rows, cols / g] => (g, values),
            Granularity::Block(b0, b1) if sshape == [rows.div_ceil(b0), cols.div_ceil(b1)] => {
                let nb = cols.div_ceil(b1);
                (b1, (0..rows).flat_map(|r| values[(r / b0) * nb..(r / b0 + 1) * nb].iter().copied()).collect())
            }
            g => {
                return Err(scale_err(format!(
                    "shape {sshape:?} is not a scale layout of a [{rows}, {cols}] matrix ({g:?})"
                )))
            }
        };
        Ok(Fp8Weight { rows, cols, codes, col_block, scales })
    }

    /// `{module}.weight` dequantized to the checkpoint's float type (the CPU's form).
    pub fn dequantized(&self, st: &SafetensorsDir, module: &str, rows: usize, cols: usize) -> Result<Tensor> {
        let values = self.weight(st, module, rows, cols)?.dequantize();
        let bad = |e: ferrite_runtime::RuntimeError| LoadError::tensor(st.path_of(module), module, e.to_string());
        let shape = vec![rows, cols];
        match self.float {
            DType::F32 => Tensor::from_f32(shape, values),
            DType::F16 => {
                let bytes = values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
                Tensor::new(DType::F16, shape, Buffer::Bytes(std::sync::Arc::new(bytes)))
            }
            _ => {
                let bytes = values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
                Tensor::new(DType::BF16, shape, Buffer::Bytes(std::sync::Arc::new(bytes)))
            }
        }
        .map_err(bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weight(rows: usize, cols: usize, col_block: usize, scales: Vec<f32>) -> Fp8Weight {
        Fp8Weight { rows, cols, codes: (0..rows * cols).map(|i| (i % 0x70) as u8).collect(), col_block, scales }
    }

    #[test]
    fn refining_the_scale_runs_keeps_the_values() {
        let w = weight(3, 256, 128, vec![0.5, 2.0, 1.0, 0.25, 4.0, 8.0]);
        let fine = w.clone().with_col_block(32);
        assert_eq!(fine.col_blocks(), 8);
        assert_eq!(w.dequantize(), fine.dequantize());
        let channel = weight(2, 64, 64, vec![0.5, 3.0]);
        assert_eq!(channel.dequantize(), channel.clone().with_col_block(16).dequantize());
    }

    #[test]
    fn slicing_and_permuting_rows_move_their_scales() {
        let w = weight(4, 32, 32, vec![1.0, 2.0, 3.0, 4.0]);
        let all = w.dequantize();
        assert_eq!(w.slice_rows(1..3).dequantize(), all[32..96].to_vec());
        let p = w.permute_rows(&[3, 0]);
        assert_eq!(p.dequantize(), [&all[96..128], &all[0..32]].concat());
    }

    #[test]
    fn configs_name_their_granularity() {
        let p = Path::new("config.json");
        let ct = serde_json::json!({"torch_dtype": "float32", "quantization_config": {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}}}});
        let q = Fp8Quantization::from_config(p, &ct).unwrap().unwrap();
        assert_eq!(q.granularity, Granularity::Block(128, 128));
        assert_eq!(q.float, DType::F32);
        let hf = serde_json::json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}});
        let q = Fp8Quantization::from_config(p, &hf).unwrap().unwrap();
        assert_eq!((q.granularity, q.float), (Granularity::Block(128, 64), DType::BF16));
        let int = serde_json::json!({"quantization_config": {"quant_method": "compressed-tensors",
            "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}});
        let e = Fp8Quantization::from_config(p, &int).unwrap_err().to_string();
        assert!(e.contains("int weights are not supported"), "{e}");
        let gptq = serde_json::json!({"quantization_config": {"quant_method": "gptq", "bits": 4}});
        assert!(Fp8Quantization::from_config(p, &gptq).unwrap().is_none());
    }
}
