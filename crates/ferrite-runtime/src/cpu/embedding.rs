//! Embedding gather: one (dequantized) table row per token id.

use crate::error::{Result, RuntimeError};
use crate::tensor::Tensor;

pub fn embedding(table: &Tensor, ids: &[u32], out: &mut [f32]) -> Result<()> {
    let d = table.row_len();
    if out.len() != ids.len() * d {
        return Err(RuntimeError::Shape(format!("embedding of {} ids into {} values", ids.len(), out.len())));
    }
    for (&id, dst) in ids.iter().zip(out.chunks_exact_mut(d)) {
        let id = id as usize;
        if id >= table.rows() {
            return Err(RuntimeError::Shape(format!("token id {id} is outside the vocabulary of {}", table.rows())));
        }
        table.dequantize_rows(id..id + 1, dst)?;
    }
    Ok(())
}
