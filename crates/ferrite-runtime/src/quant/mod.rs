//! GGUF block formats: dequantization of every supported block type to f32.
//!
//! `dequantize_row` is the exact reference path: the CPU matmul and embedding ops call it a
//! block-row at a time, so quantized weights stay quantized in memory.

use crate::dtype::DType;
use crate::error::{Result, RuntimeError};

/// Dequantize `dst.len()` values stored as `dtype` in `src` (a whole number of blocks).
pub fn dequantize_row(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let need = dtype.row_bytes(dst.len())?;
    if src.len() < need {
        return Err(RuntimeError::ShortBuffer { what: format!("{dtype} row of {}", dst.len()), need, got: src.len() });
    }
    let src = &src[..need];
    match dtype {
        DType::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        DType::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::bf16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
        _ => return Err(RuntimeError::UnsupportedDType { dtype, op: "dequantize" }),
    }
    Ok(())
}
