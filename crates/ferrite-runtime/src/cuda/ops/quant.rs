//! GGUF block-quantized weight matrices on the device and the ops over them. The blocks keep
//! their file layout (an upload is a copy); `kernels/quant.cuh` reads them:
//! - decode-sized batches (m ≤ `GEMV_MAX_ROWS`): the quantized skinny GEMM, which dequantizes
//!   in registers and reads each weight byte once per step;
//! - larger batches: the matrix dequantized into the caller's bf16 scratch (sized once for
//!   the largest matrix, so nothing is allocated per step), then cuBLASLt; without a scratch
//!   large enough, the skinny GEMM over 8 rows at a time;
//! - embeddings: the rows of the ids dequantized, as the bf16 gather would copy them.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::cuda::blas::GemmOutput;
use crate::cuda::context::{cfg, Gpu};
use crate::cuda::error::{CudaError, CudaResult};
use crate::cuda::functions::{QuantFunctions, QUANT_TYPES};
use crate::cuda::ops::elementwise::{gated_activation, GatedActivation, GEMV_MAX_ROWS};
use crate::dtype::DType;

/// Threads of a quantized kernel's block (quant.cuh's `QG_THREADS`), and the rows a skinny
/// GEMM block computes (`QG_ROWS`; gated: 2 outputs).
const THREADS: u32 = 128;
const GEMV_ROWS: usize = 4;
/// The skinny GEMM's output modes (quant.cuh's `QG_*`).
const MODE_BF16: i32 = 0;
const MODE_F32: i32 = 1;
const MODE_SILU: i32 = 2;
const MODE_GELU: i32 = 3;

/// Consecutive rows of a `QuantMatrix` in one block type.
pub struct QuantPart {
    dtype: DType,
    rows: usize,
    blocks: CudaSlice<u8>,
}

/// A `[rows, cols]` weight matrix of GGUF blocks, as one or more row ranges (parts) each in
/// one block type: a fused projection whose pieces a file quantized differently (a Q4_K_M
/// file's Q6_K `attn_v` under Q4_K `attn_q` and `attn_k`) keeps each piece as it was.
pub struct QuantMatrix {
    cols: usize,
    parts: Vec<QuantPart>,
}

fn shape_err(what: String) -> CudaError {
    CudaError::Shape(what)
}

impl QuantMatrix {
    /// Whether the quantized kernels read `dtype`.
    pub fn supports(dtype: DType) -> bool {
        QUANT_TYPES.iter().any(|(t, _)| *t == dtype)
    }

    /// Bytes of a row of `cols` values in `dtype`, checking that the kernels read the type and
    /// the row is whole 32-value units.
    pub(crate) fn row_bytes(dtype: DType, cols: usize) -> CudaResult<usize> {
        if !Self::supports(dtype) {
            return Err(CudaError::Unsupported(format!("{dtype} weights (quantized kernels read {QUANT_TYPES:?})")));
        }
        let bytes = dtype.row_bytes(cols).map_err(|e| shape_err(e.to_string()))?;
        if cols == 0 || !cols.is_multiple_of(32) {
            return Err(shape_err(format!("{dtype} rows of {cols} values (a multiple of 32 needed)")));
        }
        Ok(bytes)
    }

    /// A matrix of `cols` columns from parts given as (block type, rows, their GGUF bytes),
    /// stacked in order.
    pub fn upload(gpu: &Gpu, cols: usize, parts: &[(DType, usize, &[u8])]) -> CudaResult<QuantMatrix> {
        let mut out = Vec::with_capacity(parts.len());
        for &(dtype, rows, bytes) in parts {
            let need = rows * Self::row_bytes(dtype, cols)?;
            if bytes.len() != need || rows == 0 {
                return Err(shape_err(format!("{rows} {dtype} rows of {cols} values in {} bytes", bytes.len())));
            }
            out.push(QuantPart { dtype, rows, blocks: gpu.upload(bytes)? });
        }
        if out.is_empty() {
            return Err(shape_err("a quantized matrix of no parts".into()));
        }
        Ok(QuantMatrix { cols, parts: out })
    }

    /// `rows` × `cols` random `dtype` blocks made on the device from `seed` (a synthetic
    /// model): random quants, scales set so the values lie about in [-amp, amp].
    pub fn random(gpu: &Gpu, dtype: DType, rows: usize, cols: usize, seed: u64, amp: f32) -> CudaResult<QuantMatrix> {
        let bytes = rows * Self::row_bytes(dtype, cols)?;
        let mut blocks = gpu.alloc::<u8>(bytes)?;
        let n = (bytes / dtype.block_bytes()) as u64;
        let wp = gpu.ptr_mut(&mut blocks);
        let grid = gpu.grid_for(n as usize, 256);
        gpu.launch(&kernels(gpu, dtype)?.random_blocks, cfg((grid, 1, 1), 256, 0), &[&wp, &n, &seed, &amp])?;
        Ok(QuantMatrix { cols, parts: vec![QuantPart { dtype, rows, blocks }] })
    }

    pub fn rows(&self) -> usize {
        self.parts.iter().map(|p| p.rows).sum()
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Device bytes of the blocks.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.blocks.len()).sum()
    }

    /// The block type of each part, in order.
    pub fn dtypes(&self) -> Vec<DType> {
        self.parts.iter().map(|p| p.dtype).collect()
    }
}

pub(crate) fn kernels(gpu: &Gpu, dtype: DType) -> CudaResult<&QuantFunctions> {
    QUANT_TYPES
        .iter()
        .position(|(t, _)| *t == dtype)
        .and_then(|i| gpu.fns.quant.get(i))
        .ok_or_else(|| CudaError::Unsupported(format!("{dtype} weights")))
}

/// Launch the skinny GEMM over every part for `m` (1..=8) rows of x at `xp`, into y at `yp`
/// (rows of `ldy` elements of `out_bytes` each), one part's outputs after the other's.
#[allow(clippy::too_many_arguments)]
fn qgemv(
    gpu: &Gpu,
    w: &QuantMatrix,
    m: usize,
    xp: u64,
    bp: u64,
    yp: u64,
    ldy: usize,
    out_bytes: usize,
    mode: i32,
) -> CudaResult<()> {
    let (k, ldy) = (w.cols as i32, ldy as i32);
    let mut row = 0;
    for p in &w.parts {
        let f = &kernels(gpu, p.dtype)?.gemv[m - 1];
        let wp = gpu.ptr(&p.blocks);
        let (yo, bo) = (yp + (row * out_bytes) as u64, if bp == 0 { 0 } else { bp + (row * out_bytes) as u64 });
        let n = p.rows as i32;
        gpu.launch(
            f,
            cfg((p.rows.div_ceil(GEMV_ROWS) as u32, 1, 1), THREADS, 0),
            &[&xp, &wp, &bo, &yo, &n, &k, &ldy, &mode],
        )?;
        row += p.rows;
    }
    Ok(())
}

/// `y[m, n] = x[m, k] · Wᵀ (+ bias[n])` for `w` of `[n, k]` blocks, f32 accumulation, bf16 or
/// f32 out (the bias in the output's type). m ≤ `GEMV_MAX_ROWS` runs the quantized skinny
/// GEMM; larger m dequantizes `w` into `scratch` and runs cuBLASLt, or, when `scratch` is
/// missing or smaller than n·k, runs the skinny GEMM over 8 rows of x at a time.
pub fn quant_linear<O: GemmOutput>(
    gpu: &Gpu,
    x: &impl DevicePtr<bf16>,
    w: &QuantMatrix,
    bias: Option<&dyn DevicePtr<O>>,
    y: &mut impl DevicePtrMut<O>,
    m: usize,
    scratch: Option<&mut CudaSlice<bf16>>,
) -> CudaResult<()> {
    let (n, k) = (w.rows(), w.cols);
    let xp = gpu.ptr(x);
    if m == 0 || x.len() < m * k || y.len() < m * n || bias.is_some_and(|b| b.len() < n) || !xp.is_multiple_of(16) {
        return Err(shape_err(format!(
            "quantized linear m={m} n={n} k={k}: x {} (at {xp:#x}), y {}, bias {:?}",
            x.len(),
            y.len(),
            bias.map(|b| b.len())
        )));
    }
    match scratch {
        Some(s) if m > GEMV_MAX_ROWS && s.len() >= n * k => {
            dequantize(gpu, w, s)?;
            gpu.blas.linear(x, &s.slice(..n * k), bias, y, (m, n, k))
        }
        _ => {
            let bf16_out = O::TYPE == cudarc::cublaslt::sys::cudaDataType::CUDA_R_16BF;
            let (mode, size) = if bf16_out { (MODE_BF16, 2) } else { (MODE_F32, 4) };
            let (bp, yp) = (bias.map_or(0, |b| gpu.ptr(b)), gpu.ptr_mut(y));
            for start in (0..m).step_by(GEMV_MAX_ROWS) {
                let rows = GEMV_MAX_ROWS.min(m - start);
                let (xo, yo) = (xp + (start * k * 2) as u64, yp + (start * n * size) as u64);
                qgemv(gpu, w, rows, xo, bp, yo, n, size, mode)?;
            }
            Ok(())
        }
    }
}

/// `y[m, n] = act(x·W_gateᵀ) * (x·W_upᵀ)` for `w` of `[2n, k]` blocks (gate rows, then up
/// rows): for decode-sized m and one block type, the skinny GEMM with the activation as its
/// epilogue (as `linear_gated`'s bf16 kernel); otherwise `quant_linear` into `gate_up` (m·2n
/// values) and the activation.
#[allow(clippy::too_many_arguments)]
pub fn quant_linear_gated(
    gpu: &Gpu,
    activation: GatedActivation,
    x: &impl DevicePtr<bf16>,
    w: &QuantMatrix,
    gate_up: &mut CudaSlice<bf16>,
    y: &mut impl DevicePtrMut<bf16>,
    m: usize,
    scratch: Option<&mut CudaSlice<bf16>>,
) -> CudaResult<()> {
    let (n, k) = (w.rows() / 2, w.cols);
    let xp = gpu.ptr(x);
    let fused = (1..=GEMV_MAX_ROWS).contains(&m) && w.parts.len() == 1;
    if !fused || !w.rows().is_multiple_of(2) || !xp.is_multiple_of(16) {
        quant_linear::<bf16>(gpu, x, w, None, gate_up, m, scratch)?;
        return gated_activation(gpu, activation, &*gate_up, &gate_up.slice(n..), (m, n, 2 * n), y);
    }
    if x.len() < m * k || y.len() < m * n {
        return Err(shape_err(format!("quantized gated linear m={m} n={n} k={k}: x {}, y {}", x.len(), y.len())));
    }
    let mode = match activation {
        GatedActivation::Silu => MODE_SILU,
        GatedActivation::GeluTanh => MODE_GELU,
    };
    let part = &w.parts[0];
    let f = &kernels(gpu, part.dtype)?.gemv[m - 1];
    let (wp, yp, bp) = (gpu.ptr(&part.blocks), gpu.ptr_mut(y), 0u64);
    let (n_i, k_i) = (n as i32, k as i32);
    // A block per 2 outputs: their gate and up rows are its 4 rows.
    gpu.launch(f, cfg((n.div_ceil(2) as u32, 1, 1), THREADS, 0), &[&xp, &wp, &bp, &yp, &n_i, &k_i, &n_i, &mode])
}

/// `out[t] = bf16(W[ids[t]] * scale)` for t < `tokens`: an embedding gather from a quantized
/// table (one block type); an id ≥ rows gives a zero row, as the bf16 gather does.
pub fn quant_embedding(
    gpu: &Gpu,
    w: &QuantMatrix,
    ids: &impl DevicePtr<u32>,
    tokens: usize,
    scale: f32,
    out: &mut impl DevicePtrMut<bf16>,
) -> CudaResult<()> {
    let [part] = w.parts.as_slice() else {
        return Err(CudaError::Unsupported("an embedding table of several block types".into()));
    };
    if ids.len() < tokens || out.len() < tokens * w.cols {
        return Err(shape_err(format!(
            "quantized embedding [{}, {}] of {tokens} ids: ids {}, out {}",
            part.rows,
            w.cols,
            ids.len(),
            out.len()
        )));
    }
    if tokens == 0 {
        return Ok(());
    }
    let (wp, ip, op) = (gpu.ptr(&part.blocks), gpu.ptr(ids), gpu.ptr_mut(out));
    let (k, vocab) = (w.cols as i32, part.rows as i32);
    let f = &kernels(gpu, part.dtype)?.dequant_rows;
    gpu.launch(f, cfg((tokens as u32, 1, 1), THREADS, 0), &[&wp, &ip, &op, &k, &vocab, &scale])
}

/// All of `w` dequantized to bf16 into `out` (at least rows·cols values, each part at its
/// first row): what the GEMM path multiplies by.
pub fn dequantize(gpu: &Gpu, w: &QuantMatrix, out: &mut CudaSlice<bf16>) -> CudaResult<()> {
    if out.len() < w.rows() * w.cols {
        return Err(shape_err(format!("dequantize [{}, {}] into {}", w.rows(), w.cols, out.len())));
    }
    let (k, scale, none) = (w.cols as i32, 1f32, 0u64);
    let mut row = 0;
    for p in &w.parts {
        let op = gpu.ptr_mut(out) + (row * w.cols * 2) as u64;
        let wp = gpu.ptr(&p.blocks);
        let rows = p.rows as i32;
        let f = &kernels(gpu, p.dtype)?.dequant_rows;
        gpu.launch(f, cfg((p.rows as u32, 1, 1), THREADS, 0), &[&wp, &none, &op, &k, &rows, &scale])?;
        row += p.rows;
    }
    Ok(())
}
