//! GGUF metadata values and the bounds-checked little-endian reader that parses them.

use std::path::Path;

use crate::error::{LoadError, Result};

/// How deep metadata arrays may nest. Real files use flat arrays (token lists); a limit keeps
/// a hostile file's nesting from overflowing the reader's stack (and the drop of the value).
const MAX_ARRAY_DEPTH: usize = 16;

#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    pub fn as_u64(&self) -> Option<u64> {
        Some(match *self {
            GgufValue::U8(v) => v as u64,
            GgufValue::U16(v) => v as u64,
            GgufValue::U32(v) => v as u64,
            GgufValue::U64(v) => v,
            GgufValue::I8(v) if v >= 0 => v as u64,
            GgufValue::I16(v) if v >= 0 => v as u64,
            GgufValue::I32(v) if v >= 0 => v as u64,
            GgufValue::I64(v) if v >= 0 => v as u64,
            _ => return None,
        })
    }
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v as i64),
            GgufValue::I16(v) => Some(v as i64),
            GgufValue::I32(v) => Some(v as i64),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

pub(super) struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8], path: &'a Path) -> Self {
        Reader { data, pos: 0, path }
    }

    pub fn pos(&self) -> usize {
        self.pos
    }

    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len()).ok_or_else(|| {
            LoadError::format(self.path, format!("header ends early at byte {} (truncated file?)", self.pos))
        })?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let b = self.bytes(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    pub fn string(&mut self) -> Result<String> {
        let len = self.u64()?;
        let len = usize::try_from(len).map_err(|_| LoadError::format(self.path, "string length overflows"))?;
        let b = self.bytes(len)?;
        // Some converters write invalid UTF-8 in token strings; keep the bytes readable.
        Ok(String::from_utf8_lossy(b).into_owned())
    }

    /// One metadata value of type `ty` (a top-level value: its arrays may nest
    /// `MAX_ARRAY_DEPTH` deep).
    pub fn value(&mut self, ty: u32) -> Result<GgufValue> {
        self.value_at(ty, 0)
    }

    fn value_at(&mut self, ty: u32, depth: usize) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>()?[0]),
            1 => GgufValue::I8(self.array::<1>()?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array()?)),
            7 => GgufValue::Bool(self.array::<1>()?[0] != 0),
            8 => GgufValue::String(self.string()?),
            9 => {
                if depth == MAX_ARRAY_DEPTH {
                    return Err(LoadError::format(
                        self.path,
                        format!("metadata arrays nest deeper than {MAX_ARRAY_DEPTH} levels at byte {}", self.pos),
                    ));
                }
                let elem = self.u32()?;
                let n = self.u64()?;
                // Each element takes at least one byte: a count beyond the file is corrupt.
                if n > (self.data.len() - self.pos) as u64 {
                    return Err(LoadError::format(self.path, format!("array of {n} values overruns the file")));
                }
                GgufValue::Array((0..n).map(|_| self.value_at(elem, depth + 1)).collect::<Result<_>>()?)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
            _ => return Err(LoadError::format(self.path, format!("unknown metadata value type {ty}"))),
        })
    }
}
