//! Safetensors checkpoints: one `model.safetensors` or shards listed in
//! `model.safetensors.index.json`, memory-mapped; every header entry is checked against the
//! file size before use. Tensors are f32, f16 or bf16, or uint32 words (the packed codes of an
//! MLX-quantized matrix, which `mlx` reads together with its scales and biases). Integer
//! tensors of other types (a BERT checkpoint's `position_ids` buffer) are indexed but refused
//! when fetched: no model reads one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrite_runtime::{Buffer, DType, Tensor};
use serde_json::Value;

use crate::error::{LoadError, Result};

/// How a tensor's elements are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    Float(DType),
    /// Little-endian uint32 words: packed quantized codes.
    U32,
}

impl std::fmt::Display for Stored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stored::Float(d) => write!(f, "{d}"),
            Stored::U32 => f.write_str("U32"),
        }
    }
}

impl Stored {
    fn bytes(self) -> usize {
        match self {
            Stored::Float(d) => d.block_bytes(),
            Stored::U32 => 4,
        }
    }
}

struct Entry {
    file: usize,
    /// Err: the file's name of a dtype ferrite does not read (an integer type).
    dtype: std::result::Result<Stored, String>,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// The weight files of the checkpoint in `dir`: `model.safetensors`, or the shards its
/// `model.safetensors.index.json` names (sorted, each once).
pub fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    if single.is_file() {
        return Ok(vec![single]);
    }
    if !index.is_file() {
        return Err(LoadError::format(dir, "no model.safetensors or model.safetensors.index.json"));
    }
    let text = std::fs::read_to_string(&index).map_err(|e| LoadError::io(&index, e))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| LoadError::format(&index, e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| LoadError::format(&index, "no weight_map object"))?;
    let mut names: Vec<&str> = map.values().filter_map(Value::as_str).collect();
    names.sort_unstable();
    names.dedup();
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

pub struct SafetensorsDir {
    files: Vec<(PathBuf, Arc<memmap2::Mmap>)>,
    entries: HashMap<String, Entry>,
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<SafetensorsDir> {
        let mut out = SafetensorsDir { files: Vec::new(), entries: HashMap::new() };
        for path in shard_files(dir)? {
            out.add_file(&path)?;
        }
        Ok(out)
    }

    /// A one-file checkpoint held in memory (copied into an anonymous map), read as `open`
    /// reads `model.safetensors`; `path` only names it in errors. For fuzzing and for tests
    /// that build files.
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<SafetensorsDir> {
        let mut map = memmap2::MmapMut::map_anon(bytes.len().max(1)).map_err(|e| LoadError::io(path, e))?;
        map[..bytes.len()].copy_from_slice(bytes);
        let map = map.make_read_only().map_err(|e| LoadError::io(path, e))?;
        let mut out = SafetensorsDir { files: Vec::new(), entries: HashMap::new() };
        out.add_map(path, map, bytes.len())?;
        Ok(out)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
        // SAFETY: read-only map of a checkpoint file.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
        let len = map.len();
        self.add_map(path, map, len)
    }

    /// Index the tensors of the checkpoint in the first `len` bytes of `map`.
    fn add_map(&mut self, path: &Path, map: memmap2::Mmap, len: usize) -> Result<()> {
        if len < 8 {
            return Err(LoadError::format(path, "file is shorter than the safetensors header (truncated?)"));
        }
        let header_len = u64::from_le_bytes(map[..8].try_into().unwrap_or_default()) as usize;
        let data_start = 8usize.checked_add(header_len).filter(|&e| e <= len).ok_or_else(|| {
            LoadError::format(path, format!("header of {header_len} bytes overruns the file (truncated?)"))
        })?;
        let header: Value = serde_json::from_slice(&map[8..data_start])
            .map_err(|e| LoadError::format(path, format!("bad safetensors header: {e}")))?;
        let obj = header.as_object().ok_or_else(|| LoadError::format(path, "header is not a JSON object"))?;
        let file_idx = self.files.len();
        let data_len = len - data_start;
        for (name, info) in obj {
            if name == "__metadata__" {
                continue;
            }
            let bad = |m: &str| LoadError::tensor(path, name, m.to_string());
            let dtype = match info.get("dtype").and_then(Value::as_str) {
                Some("F32") => Ok(Stored::Float(DType::F32)),
                Some("F16") => Ok(Stored::Float(DType::F16)),
                Some("BF16") => Ok(Stored::Float(DType::BF16)),
                Some("F8_E4M3") => Ok(Stored::Float(DType::F8E4M3)),
                Some("U32") => Ok(Stored::U32),
                Some(other @ ("I64" | "I32" | "I16" | "I8" | "U8" | "BOOL")) => Err(other.to_string()),
                Some(other) => {
                    return Err(bad(&format!("dtype {other} is not supported (F32, F16, BF16, F8_E4M3, U32)")))
                }
                None => return Err(bad("no dtype")),
            };
            let shape: Vec<usize> = info
                .get("shape")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("no shape"))?
                .iter()
                .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("shape is not a list of integers"))?;
            let offs = info.get("data_offsets").and_then(Value::as_array).ok_or_else(|| bad("no data_offsets"))?;
            let (start, end) = match (offs.first().and_then(Value::as_u64), offs.get(1).and_then(Value::as_u64)) {
                (Some(s), Some(e)) if s <= e => (s as usize, e as usize),
                _ => return Err(bad("invalid data_offsets")),
            };
            if end > data_len {
                return Err(bad(&format!("data ends at {end} but the file holds {data_len} data bytes (truncated?)")));
            }
            // An integer tensor is never read: its range lying in the file is enough.
            if let Ok(dtype) = dtype {
                let need = shape
                    .iter()
                    .try_fold(dtype.bytes(), |n, &d| n.checked_mul(d))
                    .ok_or_else(|| bad(&format!("{dtype} tensor of shape {shape:?} overflows")))?;
                if end - start != need {
                    return Err(bad(&format!("{} bytes for {dtype} {shape:?}, expected {need}", end - start)));
                }
            }
            self.entries.insert(
                name.clone(),
                Entry { file: file_idx, dtype, shape, start: data_start + start, end: data_start + end },
            );
        }
        self.files.push((path.to_path_buf(), Arc::new(map)));
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Path of the file holding `name` (or the first shard), for error messages.
    pub fn path_of(&self, name: &str) -> &Path {
        let idx = self.entries.get(name).map_or(0, |e| e.file);
        self.files.get(idx).map_or(Path::new("model.safetensors"), |f| f.0.as_path())
    }

    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let e = self.entries.get(name).ok_or_else(|| LoadError::tensor(self.path_of(name), name, "missing"))?;
        let (path, map) = &self.files[e.file];
        let dtype = match e.dtype.clone() {
            Ok(Stored::Float(DType::F8E4M3)) => {
                return Err(LoadError::tensor(
                    path,
                    name,
                    "e4m3 codes (an FP8 weight) without an FP8 `quantization_config` in config.json",
                ))
            }
            Ok(Stored::Float(dtype)) => dtype,
            Ok(Stored::U32) => {
                return Err(LoadError::tensor(
                    path,
                    name,
                    "packed uint32 words (an MLX-quantized weight) without MLX `quantization` in config.json",
                ))
            }
            Err(int) => {
                return Err(LoadError::tensor(path, name, format!("dtype {int} is not supported (F32, F16, BF16)")))
            }
        };
        Tensor::new(dtype, e.shape.clone(), Buffer::Mapped { map: map.clone(), range: e.start..e.end })
            .map_err(|err| LoadError::tensor(path, name, err.to_string()))
    }

    /// The stored type, shape and raw little-endian bytes (a view of the mapped file) of `name`
    /// (not an integer tensor of a type no model reads).
    pub fn raw(&self, name: &str) -> Result<(Stored, &[usize], Buffer)> {
        let e = self.entries.get(name).ok_or_else(|| LoadError::tensor(self.path_of(name), name, "missing"))?;
        let (path, map) = &self.files[e.file];
        let stored = e.dtype.clone().map_err(|int| {
            LoadError::tensor(path, name, format!("dtype {int} is not supported (F32, F16, BF16, U32)"))
        })?;
        Ok((stored, &e.shape, Buffer::Mapped { map: map.clone(), range: e.start..e.end }))
    }

    /// Every float or packed-word tensor's name, stored type and shape (no data is read).
    pub fn tensors(&self) -> impl Iterator<Item = (&str, Stored, &[usize])> {
        self.entries.iter().filter_map(|(name, e)| Some((name.as_str(), *e.dtype.as_ref().ok()?, e.shape.as_slice())))
    }

    pub fn total_bytes(&self) -> usize {
        self.files.iter().map(|f| f.1.len()).sum()
    }
}
