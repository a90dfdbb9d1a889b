//! Element types: plain floats and the GGUF (ggml) block-quantized formats.
//!
//! A quantized dtype stores `block_elems()` values in `block_bytes()` bytes; a row of `n`
//! values must hold a whole number of blocks.

use crate::error::{Result, RuntimeError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
}

impl DType {
    /// Every dtype, floats first.
    pub const ALL: [DType; 15] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q8_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        DType::Q8K,
    ];

    /// The ggml type id used in GGUF tensor infos, and its inverse.
    pub fn from_ggml(id: u32) -> Option<DType> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            6 => DType::Q5_0,
            7 => DType::Q5_1,
            8 => DType::Q8_0,
            9 => DType::Q8_1,
            10 => DType::Q2K,
            11 => DType::Q3K,
            12 => DType::Q4K,
            13 => DType::Q5K,
            14 => DType::Q6K,
            15 => DType::Q8K,
            30 => DType::BF16,
            _ => return None,
        })
    }

    pub fn ggml_id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q8_0 => 8,
            DType::Q8_1 => 9,
            DType::Q2K => 10,
            DType::Q3K => 11,
            DType::Q4K => 12,
            DType::Q5K => 13,
            DType::Q6K => 14,
            DType::Q8K => 15,
            DType::BF16 => 30,
        }
    }

    /// Number of values in one block (1 for plain floats).
    pub fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::Q8_1 => 32,
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K | DType::Q8K => 256,
        }
    }

    /// Number of bytes in one block: `sizeof(block_*)` in ggml's `ggml-common.h`.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q8_0 => 34,
            DType::Q8_1 => 36,
            DType::Q2K => 84,
            DType::Q3K => 110,
            DType::Q4K => 144,
            DType::Q5K => 176,
            DType::Q6K => 210,
            DType::Q8K => 292,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes taken by a row of `n` values; an error when `n` is not a whole number of blocks
    /// or its bytes overflow.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        let block = self.block_elems();
        if !n.is_multiple_of(block) {
            return Err(RuntimeError::BlockAlignment { dtype: self, len: n, block });
        }
        (n / block)
            .checked_mul(self.block_bytes())
            .ok_or_else(|| RuntimeError::Shape(format!("a {self} row of {n} values overflows")))
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q8_0 => "Q8_0",
            DType::Q8_1 => "Q8_1",
            DType::Q2K => "Q2_K",
            DType::Q3K => "Q3_K",
            DType::Q4K => "Q4_K",
            DType::Q5K => "Q5_K",
            DType::Q6K => "Q6_K",
            DType::Q8K => "Q8_K",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_id_round_trips() {
        for t in DType::ALL {
            assert_eq!(DType::from_ggml(t.ggml_id()), Some(t), "{t}");
        }
        // Ids ggml retired (Q4_2, Q4_3) or that we do not support (IQ*, TQ*, ...).
        for id in [4, 5, 16, 20, 29, 31, 39, u32::MAX] {
            assert_eq!(DType::from_ggml(id), None, "id {id}");
        }
    }

    /// The block sizes, rebuilt from the fields of ggml's block structs (f16 = 2 bytes).
    #[test]
    fn block_sizes_match_ggml_structs() {
        const QK: usize = 32;
        const QK_K: usize = 256;
        let expect = |t: DType| -> (usize, usize) {
            match t {
                DType::F32 => (1, 4),
                DType::F16 | DType::BF16 => (1, 2),
                DType::Q4_0 => (QK, 2 + QK / 2),
                DType::Q4_1 => (QK, 2 * 2 + QK / 2),
                DType::Q5_0 => (QK, 2 + 4 + QK / 2),
                DType::Q5_1 => (QK, 2 * 2 + 4 + QK / 2),
                DType::Q8_0 => (QK, 2 + QK),
                DType::Q8_1 => (QK, 2 * 2 + QK),
                DType::Q2K => (QK_K, QK_K / 16 + QK_K / 4 + 2 * 2),
                DType::Q3K => (QK_K, QK_K / 8 + QK_K / 4 + 12 + 2),
                DType::Q4K => (QK_K, 2 * 2 + 12 + QK_K / 2),
                DType::Q5K => (QK_K, 2 * 2 + 12 + QK_K / 8 + QK_K / 2),
                DType::Q6K => (QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2),
                DType::Q8K => (QK_K, 4 + QK_K + 2 * QK_K / 16),
            }
        };
        for t in DType::ALL {
            assert_eq!((t.block_elems(), t.block_bytes()), expect(t), "{t}");
        }
    }
}
