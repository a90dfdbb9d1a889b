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
        self.dims.iter().rev().map(|&d| usize::try_from(d).unwrap_or(usize::MAX)).collect()
    }
}

pub struct GgufFile {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
    /// Bytes of the file (of `map`, which may be longer when built by `from_bytes`).
    len: usize,
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
        let len = map.len();
        Self::parse(path, Arc::new(map), len)
    }

    /// A GGUF image held in memory (copied into an anonymous map), read as `open` reads a
    /// file; `path` only names it in errors. For fuzzing and for tests that build files.
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<GgufFile> {
        let mut map = memmap2::MmapMut::map_anon(bytes.len().max(1)).map_err(|e| LoadError::io(path, e))?;
        map[..bytes.len()].copy_from_slice(bytes);
        let map = map.make_read_only().map_err(|e| LoadError::io(path, e))?;
        Self::parse(path, Arc::new(map), bytes.len())
    }

    /// Parse the first `len` bytes of `map` (an anonymous map may be longer than its image).
    fn parse(path: &Path, map: Arc<memmap2::Mmap>, len: usize) -> Result<GgufFile> {
        let mut r = value::Reader::new(&map[..len], path);
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
        let data_start = (r.pos() as u64)
            .div_ceil(alignment)
            .checked_mul(alignment)
            .and_then(|s| usize::try_from(s).ok())
            .ok_or_else(|| LoadError::format(path, format!("general.alignment {alignment} overflows")))?;
        let file = GgufFile { path: path.to_path_buf(), map, len, version, metadata, tensors, data_start };
        for t in &file.tensors {
            if t.offset % alignment != 0 {
                return Err(LoadError::tensor(
                    path,
                    &t.name,
                    format!("offset {} is not a multiple of the alignment {alignment}", t.offset),
                ));
            }
            file.check_extent(t)?;
        }
        Ok(file)
    }

    /// The byte range of `t` in the file, checked (without overflow) to lie inside it.
    fn check_extent(&self, t: &GgufTensorInfo) -> Result<(usize, usize)> {
        let bad = |m: String| LoadError::tensor(&self.path, &t.name, m);
        let shape = t.shape();
        let len = Tensor::byte_len(t.dtype, &shape).map_err(|e| bad(e.to_string()))?;
        let start = (self.data_start as u64).checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(len as u64));
        match (start, end) {
            (Some(start), Some(end)) if end <= self.len as u64 => Ok((start as usize, end as usize)),
            _ => Err(bad(format!(
                "data at offset {} + {len} bytes lies past the end of the file ({} bytes; truncated?)",
                t.offset, self.len
            ))),
        }
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
        self.len.saturating_sub(self.data_start)
    }
}
