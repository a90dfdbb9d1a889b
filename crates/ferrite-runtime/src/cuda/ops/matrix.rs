//! `Matrix`: a weight matrix on the device as a model holds it — bf16 values, GGUF or MLX
//! blocks (`QuantMatrix`) or FP8 codes and scales (`Fp8Matrix`) — with the linear layer, the
//! gated linear layer and the embedding gather over each, so model code is written once for
//! all.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::cuda::blas::GemmOutput;
use crate::cuda::context::Gpu;
use crate::cuda::error::{CudaError, CudaResult};
use crate::cuda::ops::elementwise::{embedding, linear, linear_gated, GatedActivation};
use crate::cuda::ops::fp8::{fp8_embedding, fp8_linear, fp8_linear_gated, Fp8Matrix};
use crate::cuda::ops::quant::{quant_embedding, quant_linear, quant_linear_gated, QuantMatrix};

pub enum Matrix {
    /// Row-major `[rows, cols]` bf16 values.
    Bf16(CudaSlice<bf16>),
    Quant(QuantMatrix),
    Fp8(Fp8Matrix),
}

impl Matrix {
    /// Device bytes of the weights.
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::Bf16(w) => w.len() * 2,
            Matrix::Quant(q) => q.bytes(),
            Matrix::Fp8(f) => f.bytes(),
        }
    }

    /// bf16 values of scratch a product with this matrix over up to `tokens` rows uses (rows·cols
    /// when quantized: it is dequantized there for cuBLASLt; `Fp8Matrix::scratch_len`; none for
    /// bf16).
    pub fn scratch_len(&self, tokens: usize) -> usize {
        match self {
            Matrix::Bf16(_) => 0,
            Matrix::Quant(q) => q.rows() * q.cols(),
            Matrix::Fp8(f) => f.scratch_len(tokens),
        }
    }

    /// A `[rows, cols]` matrix used as `[n, k]` is an error.
    fn check_shape((rows, cols): (usize, usize), n: usize, k: usize) -> CudaResult<()> {
        if rows != n || cols != k {
            return Err(CudaError::Shape(format!("a [{rows}, {cols}] matrix used as [{n}, {k}]")));
        }
        Ok(())
    }

    /// `y[m, n] = x[m, k] · Wᵀ (+ bias[n])` (`ops::linear`, `quant_linear` or `fp8_linear`, which
    /// may use `scratch`).
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
                Self::check_shape((q.rows(), q.cols()), n, k)?;
                quant_linear(gpu, x, q, bias, y, m, scratch)
            }
            Matrix::Fp8(f) => {
                Self::check_shape((f.rows(), f.cols()), n, k)?;
                fp8_linear(gpu, x, f, bias, y, m, scratch)
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
                Self::check_shape((q.rows(), q.cols()), 2 * n, k)?;
                quant_linear_gated(gpu, act, x, q, gate_up, y, m, scratch)
            }
            Matrix::Fp8(f) => {
                Self::check_shape((f.rows(), f.cols()), 2 * n, k)?;
                fp8_linear_gated(gpu, act, x, f, gate_up, y, m, scratch)
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
                Self::check_shape((q.rows(), q.cols()), vocab, dim)?;
                quant_embedding(gpu, q, ids, tokens, scale, out)
            }
            Matrix::Fp8(f) => {
                Self::check_shape((f.rows(), f.cols()), vocab, dim)?;
                fp8_embedding(gpu, f, ids, tokens, scale, out)
            }
        }
    }
}
