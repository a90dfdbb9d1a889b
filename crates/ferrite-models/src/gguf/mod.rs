//! GGUF files: header, metadata key/values and tensor infos, read from a memory map.
//!
//! `GgufFile::open` validates the whole header (every length and offset against the file
//! size) so a truncated or corrupt file is an error naming the file, never a panic later.

mod value;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrite_runtime::{Buffer, DType, Tensor};

pub use value::GgufValue;

use crate::error::{LoadError, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the innermost (row length).
    pub dims: Vec<u64>,
    pub dtype: DType,
    /// Byte offset from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Shape in row-major (PyTorch) order: outermost first.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

pub struct GgufFile {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    data_start: usize,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
        // SAFETY: the map is read-only; a file changed under us while mapped is outside what
        // we can defend against (as for every mmap-based loader).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
        Self::parse(path, Arc::new(map))
    }

    fn parse(path: &Path, map: Arc<memmap2::Mmap>) -> Result<GgufFile> {
        let mut r = value::Reader::new(&map, path);
        let magic = r.bytes(4)?;
        if magic != MAGIC {
            return Err(LoadError::format(path, "not a GGUF file (bad magic)"));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(LoadError::format(path, format!("GGUF version {version} is not supported (2 or 3)")));
        }
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let value = r.value(ty)?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::new();
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims == 0 || n_dims > 4 {
                return Err(LoadError::tensor(path, &name, format!("{n_dims} dimensions (expected 1 to 4)")));
            }
            let dims = (0..n_dims).map(|_| r.u64()).collect::<Result<Vec<_>>>()?;
            let ty = r.u32()?;
            let dtype = DType::from_ggml(ty)
                .ok_or_else(|| LoadError::tensor(path, &name, format!("unsupported ggml type id {ty}")))?;
            let offset = r.u64()?;
            tensors.push(GgufTensorInfo { name, dims, dtype, offset });
        }
        let alignment = match metadata.get("general.alignment") {
            Some(v) => v
                .as_u64()
                .filter(|a| *a > 0 && a.is_power_of_two())
                .ok_or_else(|| LoadError::format(path, "general.alignment is not a power of two"))?,
            None => DEFAULT_ALIGNMENT,
        };
        let data_start = (r.pos() as u64).div_ceil(alignment) * alignment;
        let file =
            GgufFile { path: path.to_path_buf(), map, version, metadata, tensors, data_start: data_start as usize };
        for t in &file.tensors {
            file.check_extent(t)?;
        }
        Ok(file)
    }

    fn check_extent(&self, t: &GgufTensorInfo) -> Result<(usize, usize)> {
        let shape = t.shape();
        let len =
            Tensor::byte_len(t.dtype, &shape).map_err(|e| LoadError::tensor(&self.path, &t.name, e.to_string()))?;
        let start = self.data_start as u64 + t.offset;
        let end = start + len as u64;
        if end > self.map.len() as u64 {
            return Err(LoadError::tensor(
                &self.path,
                &t.name,
                format!("data ends at byte {end} but the file has {} bytes (truncated?)", self.map.len()),
            ));
        }
        Ok((start as usize, end as usize))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor `name`, mapped (no copy).
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let info = self.tensor_info(name).ok_or_else(|| LoadError::tensor(&self.path, name, "missing".to_string()))?;
        let (start, end) = self.check_extent(info)?;
        Tensor::new(info.dtype, info.shape(), Buffer::Mapped { map: self.map.clone(), range: start..end })
            .map_err(|e| LoadError::tensor(&self.path, name, e.to_string()))
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(|v| v.as_str())
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(|v| v.as_u64())
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(|v| v.as_f64())
    }

    /// A required metadata key as an integer.
    pub fn require_u64(&self, key: &str) -> Result<u64> {
        self.get_u64(key)
            .ok_or_else(|| LoadError::format(&self.path, format!("metadata key {key} is missing or not an integer")))
    }

    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
            .ok_or_else(|| LoadError::format(&self.path, "metadata key general.architecture is missing"))
    }

    /// Total bytes of tensor data (what stays in memory once loaded).
    pub fn data_bytes(&self) -> usize {
        self.map.len().saturating_sub(self.data_start)
    }
}
