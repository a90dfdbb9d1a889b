//! Random weights for a synthetic model on the CPU (`load::synthetic`): every tensor the
//! loader asks for, made on demand from (seed, name) in the dtype asked — matrices uniform with
//! the variance of a 1/fan-in init (the embedding table unit-ish rows unless the model scales
//! embeddings up), vectors (norms, biases) all ones — as the CUDA executor's `RandomSource`
//! makes them on the device.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ferrite_runtime::quant::random::random_rows;
use ferrite_runtime::{Buffer, DType, Tensor};

use crate::error::{LoadError, Result};

pub struct RandomWeights {
    dtype: DType,
    seed: u64,
    /// The fan-in the embedding table is drawn for.
    embed_fan_in: usize,
    /// Bytes made so far.
    bytes: AtomicUsize,
}

/// FNV-1a of `name`: each tensor's own stream, whatever order the loader asks in.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

impl RandomWeights {
    pub fn new(dtype: DType, seed: u64, embed_fan_in: usize) -> RandomWeights {
        RandomWeights { dtype, seed, embed_fan_in, bytes: AtomicUsize::new(0) }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes of the tensors made so far.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The tensor `name` of `shape`: a matrix in the synthetic dtype, a vector of ones.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let bad = |e: ferrite_runtime::RuntimeError| {
            LoadError::Other(format!("synthetic {name} {shape:?} in {}: {e}", self.dtype))
        };
        if shape.len() < 2 {
            let n = shape.iter().product();
            self.bytes.fetch_add(4 * n, Ordering::Relaxed);
            return Tensor::from_f32(shape.to_vec(), vec![1.0; n]).map_err(bad);
        }
        let k = shape[shape.len() - 1];
        let rows = shape.iter().rev().skip(1).product();
        let fan_in = if name == "model.embed_tokens.weight" { self.embed_fan_in } else { k };
        let amp = (3.0 / fan_in as f32).sqrt();
        let bytes = random_rows(self.dtype, rows, k, self.seed ^ name_hash(name), amp).map_err(bad)?;
        self.bytes.fetch_add(bytes.len(), Ordering::Relaxed);
        Tensor::new(self.dtype, shape.to_vec(), Buffer::Bytes(Arc::new(bytes))).map_err(bad)
    }
}
