//! `Matrix`: a weight matrix on the device as a model holds it — bf16 values or GGUF blocks
//! (`QuantMatrix`) — with the linear layer, the gated linear layer and the embedding gather
//! over either, so model code is written once for both.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::cuda::blas::GemmOutput;
use crate::cuda::context::Gpu;
use crate::cuda::error::{CudaError, CudaResult};
use crate::cuda::ops::elementwise::{embedding, linear, linear_gated, GatedActivation};
use crate::cuda::ops::quant::{quant_embedding, quant_linear, quant_linear_gated, QuantMatrix};

pub enum Matrix {
    /// Row-major `[rows, cols]` bf16 values.
    Bf16(CudaSlice<bf16>),
    Quant(QuantMatrix),
}

impl Matrix {
    /// Device bytes of the weights.
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::Bf16(w) => w.len() * 2,
            Matrix::Quant(q) => q.bytes(),
        }
    }

    /// bf16 values of scratch a large-batch product with this matrix uses (rows·cols when
    /// quantized: it is dequantized there for cuBLASLt; none for bf16).
    pub fn scratch_len(&self) -> usize {
        match self {
            Matrix::Bf16(_) => 0,
            Matrix::Quant(q) => q.rows() * q.cols(),
        }
    }

    fn check_quant(q: &QuantMatrix, n: usize, k: usize) -> CudaResult<()> {
        if q.rows() != n || q.cols() != k {
            return Err(CudaError::Shape(format!(
                "a [{}, {}] quantized matrix used as [{n}, {k}]",
                q.rows(),
                q.cols()
            )));
        }
        Ok(())
    }

    /// `y[m, n] = x[m, k] · Wᵀ (+ bias[n])` (`ops::linear` or `quant_linear`, which may use
    /// `scratch`).
    pub fn linear<O: GemmOutput>(
        &self,
        gpu: &Gpu,
        x: &impl DevicePtr<bf16>,
        bias: Option<&dyn DevicePtr<O>>,
        y: &mut impl DevicePtrMut<O>,
        (m, n, k): (usize, usize, usize),
        scratch: Option<&mut CudaSlice<bf16>>,
    ) -> CudaResult<()> {
        match self {
            Matrix::Bf16(w) => linear(gpu, x, w, bias, y, (m, n, k)),
            Matrix::Quant(q) => {
                Self::check_quant(q, n, k)?;
                quant_linear(gpu, x, q, bias, y, m, scratch)
            }
        }
    }

    /// `y[m, n] = act(x·W_gateᵀ) * (x·W_upᵀ)` for this `[2n, k]` matrix (`ops::linear_gated`
    /// or `quant_linear_gated`), with `gate_up` (m·2n values) between the two ops when they
    /// do not fuse.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_gated(
        &self,
        gpu: &Gpu,
        act: GatedActivation,
        x: &impl DevicePtr<bf16>,
        gate_up: &mut CudaSlice<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        (m, n, k): (usize, usize, usize),
        scratch: Option<&mut CudaSlice<bf16>>,
    ) -> CudaResult<()> {
        match self {
            Matrix::Bf16(w) => linear_gated(gpu, act, x, w, gate_up, y, (m, n, k)),
            Matrix::Quant(q) => {
                Self::check_quant(q, 2 * n, k)?;
                quant_linear_gated(gpu, act, x, q, gate_up, y, m, scratch)
            }
        }
    }

    /// `out[t] = table[ids[t]] * scale` for this `[vocab, dim]` table (`ops::embedding` or
    /// `quant_embedding`).
    #[allow(clippy::too_many_arguments)]
    pub fn embedding(
        &self,
        gpu: &Gpu,
        (vocab, dim): (usize, usize),
        ids: &impl DevicePtr<u32>,
        tokens: usize,
        scale: f32,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> CudaResult<()> {
        match self {
            Matrix::Bf16(w) => embedding(gpu, w, (vocab, dim), ids, tokens, scale, out),
            Matrix::Quant(q) => {
                Self::check_quant(q, vocab, dim)?;
                quant_embedding(gpu, q, ids, tokens, scale, out)
            }
        }
    }
}
