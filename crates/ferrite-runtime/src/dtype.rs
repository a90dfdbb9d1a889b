//! Element types: plain floats, FP8 (e4m3, the codes of FP8 checkpoints, whose scales live
//! beside them), the GGUF (ggml) block-quantized formats and MLX's affine quantization
//! (`MlxFormat`).
//!
//! A quantized dtype stores `block_elems()` values in `block_bytes()` bytes; a row of `n`
//! values must hold a whole number of blocks.

use crate::error::{Result, RuntimeError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// OCP FP8 e4m3 (`float8_e4m3fn`): 1 sign, 4 exponent, 3 mantissa bits, no infinities.
    /// Only the codes: an FP8 checkpoint's scales are separate tensors (`ferrite-models`'s
    /// `fp8`), so a bare e4m3 tensor is not a weight any op reads.
    F8E4M3,
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
    /// MLX affine groups: `bits`-wide codes with a scale and a bias per group
    /// (`quant::mlx` describes the block).
    Mlx(MlxFormat),
}

/// The type of an MLX group's scale and bias (the dtype of the checkpoint's `scales` and
/// `biases`, which MLX keeps in the weights' float type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MlxScale {
    Bf16,
    F16,
    F32,
}

impl MlxScale {
    pub const ALL: [MlxScale; 3] = [MlxScale::Bf16, MlxScale::F16, MlxScale::F32];

    /// Bytes of one scale (or bias).
    pub fn bytes(self) -> usize {
        match self {
            MlxScale::F32 => 4,
            _ => 2,
        }
    }

    /// The float dtype of the checkpoint's scales.
    pub fn dtype(self) -> DType {
        match self {
            MlxScale::Bf16 => DType::BF16,
            MlxScale::F16 => DType::F16,
            MlxScale::F32 => DType::F32,
        }
    }

    /// The scale type a checkpoint's `dtype` scales are, if MLX writes such.
    pub fn of(dtype: DType) -> Option<MlxScale> {
        Some(match dtype {
            DType::BF16 => MlxScale::Bf16,
            DType::F16 => MlxScale::F16,
            DType::F32 => MlxScale::F32,
            _ => return None,
        })
    }
}

/// One MLX affine quantization: `bits` (4 or 8) per value, `group` (32, 64 or 128) values per
/// scale and bias, the scales in `scale`. Only supported combinations can be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MlxFormat {
    bits: u8,
    group: u16,
    scale: MlxScale,
}

impl MlxFormat {
    /// Bit widths and group sizes ferrite reads (MLX also writes 2, 3, 5 and 6 bits).
    pub const BITS: [u32; 2] = [4, 8];
    pub const GROUPS: [usize; 3] = [32, 64, 128];

    /// The format, or why it is not one ferrite reads.
    pub fn new(bits: u32, group: usize, scale: MlxScale) -> Result<MlxFormat> {
        if !Self::BITS.contains(&bits) {
            return Err(RuntimeError::Unsupported(format!(
                "MLX {bits}-bit weights are not supported (4 and 8 bits are)"
            )));
        }
        if !Self::GROUPS.contains(&group) {
            return Err(RuntimeError::Unsupported(format!(
                "MLX group size {group} is not supported (32, 64 and 128 are)"
            )));
        }
        Ok(MlxFormat { bits: bits as u8, group: group as u16, scale })
    }

    pub fn bits(self) -> u32 {
        u32::from(self.bits)
    }
    pub fn group(self) -> usize {
        usize::from(self.group)
    }
    pub fn scale(self) -> MlxScale {
        self.scale
    }
    /// Bytes of a group's packed codes.
    pub fn code_bytes(self) -> usize {
        self.group() * self.bits() as usize / 8
    }
    /// Bytes of a group's scale and bias.
    pub fn header_bytes(self) -> usize {
        2 * self.scale.bytes()
    }

    /// Every supported format.
    pub fn all() -> impl Iterator<Item = MlxFormat> {
        Self::BITS.into_iter().flat_map(|bits| {
            Self::GROUPS.into_iter().flat_map(move |group| {
                MlxScale::ALL.into_iter().map(move |scale| MlxFormat { bits: bits as u8, group: group as u16, scale })
            })
        })
    }

    /// `MLX4_G64_BF16` and the like.
    pub fn name(self) -> &'static str {
        const NAMES: [[[&str; 3]; 3]; 2] = [
            [
                ["MLX4_G32_BF16", "MLX4_G32_F16", "MLX4_G32_F32"],
                ["MLX4_G64_BF16", "MLX4_G64_F16", "MLX4_G64_F32"],
                ["MLX4_G128_BF16", "MLX4_G128_F16", "MLX4_G128_F32"],
            ],
            [
                ["MLX8_G32_BF16", "MLX8_G32_F16", "MLX8_G32_F32"],
                ["MLX8_G64_BF16", "MLX8_G64_F16", "MLX8_G64_F32"],
                ["MLX8_G128_BF16", "MLX8_G128_F16", "MLX8_G128_F32"],
            ],
        ];
        let b = usize::from(self.bits == 8);
        let g = match self.group {
            32 => 0,
            64 => 1,
            _ => 2,
        };
        let s = match self.scale {
            MlxScale::Bf16 => 0,
            MlxScale::F16 => 1,
            MlxScale::F32 => 2,
        };
        NAMES[b][g][s]
    }
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

    /// The dtype named `name` (as `name()` writes it, any case), among `ALL`, `F8E4M3` (also
    /// `fp8`) and the MLX formats; `mlx4` and `mlx8` stand for MLX's default group of 64 with
    /// bf16 scales.
    pub fn parse(name: &str) -> Option<DType> {
        let name = name.trim();
        let short = match name.to_ascii_lowercase().as_str() {
            "mlx4" => Some(4),
            "mlx8" => Some(8),
            "fp8" | "f8_e4m3" => return Some(DType::F8E4M3),
            _ => None,
        };
        if let Some(bits) = short {
            return MlxFormat::new(bits, 64, MlxScale::Bf16).ok().map(DType::Mlx);
        }
        DType::ALL.into_iter().chain(MlxFormat::all().map(DType::Mlx)).find(|t| t.name().eq_ignore_ascii_case(name))
    }

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

    /// The ggml type id (`None` for e4m3 and the MLX formats, which GGUF does not have).
    pub fn ggml_id(self) -> Option<u32> {
        Some(match self {
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
            DType::F8E4M3 | DType::Mlx(_) => return None,
        })
    }

    /// Number of values in one block (1 for plain floats).
    pub fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::Q8_1 => 32,
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K | DType::Q8K => 256,
            DType::Mlx(f) => f.group(),
        }
    }

    /// Number of bytes in one block: `sizeof(block_*)` in ggml's `ggml-common.h`.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8E4M3 => 1,
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
            DType::Mlx(f) => f.header_bytes() + f.code_bytes(),
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
            DType::F8E4M3 => "F8_E4M3",
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
            DType::Mlx(f) => f.name(),
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
            assert_eq!(t.ggml_id().and_then(DType::from_ggml), Some(t), "{t}");
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
                DType::F8E4M3 | DType::Mlx(_) => unreachable!("ALL holds neither e4m3 nor an MLX format"),
            }
        };
        for t in DType::ALL {
            assert_eq!((t.block_elems(), t.block_bytes()), expect(t), "{t}");
        }
    }

    #[test]
    fn mlx_formats_are_checked_and_named() {
        let f = MlxFormat::new(4, 64, MlxScale::Bf16).unwrap();
        assert_eq!((DType::Mlx(f).block_elems(), DType::Mlx(f).block_bytes()), (64, 4 + 32));
        let f = MlxFormat::new(8, 32, MlxScale::F32).unwrap();
        assert_eq!((DType::Mlx(f).block_elems(), DType::Mlx(f).block_bytes()), (32, 8 + 32));
        assert!(MlxFormat::new(3, 64, MlxScale::Bf16).unwrap_err().to_string().contains("3-bit"));
        assert!(MlxFormat::new(4, 16, MlxScale::Bf16).unwrap_err().to_string().contains("group size 16"));
        let all: Vec<MlxFormat> = MlxFormat::all().collect();
        assert_eq!(all.len(), 18);
        for f in all {
            let name = f.name();
            assert!(name.starts_with(&format!("MLX{}_G{}_", f.bits(), f.group())), "{name}");
            assert_eq!(DType::parse(&name.to_lowercase()), Some(DType::Mlx(f)));
            assert_eq!(DType::Mlx(f).ggml_id(), None);
        }
        assert_eq!(DType::parse("mlx4"), Some(DType::Mlx(MlxFormat::new(4, 64, MlxScale::Bf16).unwrap())));
        assert_eq!(DType::parse("q4_k"), Some(DType::Q4K));
        assert_eq!(DType::parse("mlx5"), None);
    }
}
