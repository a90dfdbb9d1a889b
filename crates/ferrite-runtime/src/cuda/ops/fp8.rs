//! FP8 weight matrices on the device (Hopper and Ada) and the ops over them.
//!
//! A matrix is its e4m3 codes, `[rows, cols]` row-major, and one f32 scale per row and run of
//! `col_block` columns (`col_block == cols`: a scale per output channel, the form cuBLASLt's
//! FP8 GEMM scales; 128: the block-scaled checkpoints). `w[r, c] = e4m3(q[r, c]) ·
//! scale[r, c / col_block]`.
//! - decode-sized batches (m ≤ `GEMV_MAX_ROWS`): the FP8 skinny GEMM (`gemv.cu`), which widens
//!   the codes in registers into bf16 pairs for the tensor cores and reads each weight byte
//!   once per step (scales per row, or per row and run of a multiple of 64 columns; runs of
//!   16 or 32 take the path below);
//! - larger batches of a per-channel matrix: x quantized per token (`fp8_quantize_rows`, one
//!   scale a token) into the caller's scratch, then cuBLASLt's FP8 GEMM with both scale
//!   vectors (f32 accumulation, bf16 out) and the bias added after (`fp8_add_bias`);
//! - larger batches otherwise (scales along a row, or f32 output): the matrix dequantized to
//!   bf16 into the scratch and the bf16 product (`linear`: the bf16 skinny GEMM for m ≤ 8,
//!   cuBLASLt past that); without a scratch large enough, the FP8 skinny GEMM 8 rows at a
//!   time (an error for runs of 16 or 32 columns).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::cuda::blas::{Blas, Fp8Scales, GemmOutput};
use crate::cuda::context::{cfg, Gpu};
use crate::cuda::error::{CudaError, CudaResult};
use crate::cuda::ops::elementwise::{gated_activation, linear, GatedActivation, GEMV_MAX_ROWS};

/// Threads of `fp8.cu`'s kernels and of the skinny GEMM (`GEMV_THREADS`).
const THREADS: u32 = 256;

/// Matrices of fewer code bytes than this take the skinny GEMM's staged loads (x through
/// shared memory by `cp.async`), larger ones its streamed loads (`gemv.cu`): the 8B's o and
/// q/k/v (17 and 25 MB) against its down and gate-up (59 and 117 MB), as the isolated sweep
/// measured each faster.
const STAGED_BELOW_BYTES: usize = 32 << 20;

pub struct Fp8Matrix {
    rows: usize,
    cols: usize,
    codes: CudaSlice<u8>,
    scales: CudaSlice<f32>,
    col_block: usize,
}

fn shape_err(what: String) -> CudaError {
    CudaError::Shape(what)
}

/// Bytes of `scratch` (a bf16 buffer) from which a per-token quantization of `m` rows of `k`
/// values keeps its codes: after the m f32 scales, rounded up to 256 bytes.
fn codes_offset(m: usize) -> usize {
    (4 * m).next_multiple_of(256)
}

impl Fp8Matrix {
    /// Whether the device multiplies FP8 (compute capability 8.9 and up).
    pub fn supported_on(gpu: &Gpu) -> bool {
        gpu.info().compute_capability >= (8, 9)
    }

    fn check(gpu: &Gpu, rows: usize, cols: usize, col_block: usize) -> CudaResult<()> {
        if !Self::supported_on(gpu) {
            let (major, minor) = gpu.info().compute_capability;
            return Err(CudaError::Unsupported(format!(
                "FP8 weights need compute capability 8.9 or newer (Ada, Hopper); this GPU is {major}.{minor}"
            )));
        }
        if rows == 0 || cols == 0 || !cols.is_multiple_of(16) || !col_block.is_multiple_of(16) || col_block > cols {
            return Err(shape_err(format!(
                "an FP8 matrix [{rows}, {cols}] with scales every {col_block} columns (columns and scale runs \
                 must be multiples of 16)"
            )));
        }
        Ok(())
    }

    /// Scales per row.
    fn col_blocks(&self) -> usize {
        self.cols.div_ceil(self.col_block)
    }

    /// Upload codes (`rows · cols` bytes) and scales (`rows · ceil(cols / col_block)`).
    pub fn upload(
        gpu: &Gpu,
        (rows, cols): (usize, usize),
        codes: &[u8],
        scales: &[f32],
        col_block: usize,
    ) -> CudaResult<Fp8Matrix> {
        Self::check(gpu, rows, cols, col_block)?;
        if codes.len() != rows * cols || scales.len() != rows * cols.div_ceil(col_block) {
            return Err(shape_err(format!(
                "FP8 [{rows}, {cols}] (scales every {col_block}): {} codes, {} scales",
                codes.len(),
                scales.len()
            )));
        }
        Ok(Fp8Matrix { rows, cols, codes: gpu.upload(codes)?, scales: gpu.upload(scales)?, col_block })
    }

    /// `w` (`[rows, cols]` bf16) quantized per output channel: scale max|w[r]| / 448.
    pub fn quantize(gpu: &Gpu, w: &impl DevicePtr<bf16>, rows: usize, cols: usize) -> CudaResult<Fp8Matrix> {
        Self::check(gpu, rows, cols, cols)?;
        if w.len() < rows * cols {
            return Err(shape_err(format!("quantize [{rows}, {cols}] from {} values", w.len())));
        }
        let mut m = Fp8Matrix { rows, cols, codes: gpu.alloc(rows * cols)?, scales: gpu.alloc(rows)?, col_block: cols };
        let at = RowsAt::dense(gpu.ptr_mut(&mut m.codes), gpu.ptr_mut(&mut m.scales), cols);
        quantize_rows(gpu, gpu.ptr(w), at, rows, cols)?;
        Ok(m)
    }

    /// Random per-channel codes and scales from `seed`: values in [-amp, amp] (synthetic
    /// models).
    pub fn random(gpu: &Gpu, rows: usize, cols: usize, seed: u64, amp: f32) -> CudaResult<Fp8Matrix> {
        Self::check(gpu, rows, cols, cols)?;
        let mut m = Fp8Matrix { rows, cols, codes: gpu.alloc(rows * cols)?, scales: gpu.alloc(rows)?, col_block: cols };
        let at = RowsAt::dense(gpu.ptr_mut(&mut m.codes), gpu.ptr_mut(&mut m.scales), cols);
        random_rows(gpu, at, rows, cols, seed, amp)?;
        Ok(m)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Device bytes of the codes and scales.
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.scales.len()
    }

    /// Whether many-row products take cuBLASLt's FP8 GEMM: one scale per output channel (it
    /// applies those) and a shape it runs.
    fn fp8_gemm(&self) -> bool {
        self.col_block == self.cols && Blas::fp8_shape(self.rows, self.cols)
    }

    /// bf16 values of scratch a product over `tokens` rows uses: the tokens' codes and scales
    /// (`fp8_gemm`), or the dequantized matrix.
    pub fn scratch_len(&self, tokens: usize) -> usize {
        let quantized_x = (codes_offset(tokens) + tokens * self.cols).div_ceil(2);
        if self.fp8_gemm() {
            quantized_x
        } else {
            self.rows * self.cols
        }
    }

    /// Which set of skinny GEMM kernels reads the matrix (`Functions::fp8_gemv`): a scale a
    /// row, or a scale a row and run of a multiple of 64 columns (a warp's chunk); None for
    /// shorter runs, which are dequantized.
    fn skinny(&self) -> Option<usize> {
        match self.col_blocks() {
            1 => Some(0),
            _ if self.col_block.is_multiple_of(64) => Some(1),
            _ => None,
        }
    }

    /// Launch the skinny GEMM (`out`: bf16, f32, silu or gelu, `Functions::fp8_gemv` order) of
    /// `m` ≤ 8 rows of x at `xp` into y at `yp`, `n` outputs a row: plain with the bias at `bp`
    /// (0: none), or gated (`None`: 8 outputs a block, 16 rows otherwise).
    #[allow(clippy::too_many_arguments)]
    fn gemv(
        &self,
        gpu: &Gpu,
        (set, out): (usize, usize),
        xp: u64,
        bp: Option<u64>,
        yp: u64,
        m: usize,
        n: usize,
    ) -> CudaResult<()> {
        let staged = usize::from(self.rows * self.cols < STAGED_BELOW_BYTES);
        let f = &gpu.fns.fp8_gemv[staged][set][out];
        let (wp, sp) = (gpu.ptr(&self.codes), gpu.ptr(&self.scales));
        let (ncb, cb16) = (self.col_blocks() as i32, (self.col_block / 16) as i32);
        let (m_i, n_i, k_i) = (m as i32, n as i32, self.cols as i32);
        match bp {
            Some(bp) => gpu.launch(
                f,
                cfg((n.div_ceil(16) as u32, 1, 1), THREADS, 0),
                &[&xp, &wp, &sp, &ncb, &cb16, &bp, &yp, &m_i, &n_i, &k_i],
            ),
            None => gpu.launch(
                f,
                cfg((n.div_ceil(8) as u32, 1, 1), THREADS, 0),
                &[&xp, &wp, &sp, &ncb, &cb16, &yp, &m_i, &n_i, &k_i],
            ),
        }
    }

    /// All of the matrix as bf16 into `out` (at least rows·cols values).
    pub fn dequantize(&self, gpu: &Gpu, out: &mut impl DevicePtrMut<bf16>) -> CudaResult<()> {
        if out.len() < self.rows * self.cols {
            return Err(shape_err(format!("dequantize [{}, {}] into {}", self.rows, self.cols, out.len())));
        }
        self.dequant_rows(gpu, 0, self.rows, gpu.ptr_mut(out), 1.0)
    }

    /// `count` output rows at `op` (bf16): the rows of the ids at `ids` (0: rows 0..count)
    /// times `mul`.
    fn dequant_rows(&self, gpu: &Gpu, ids: u64, count: usize, op: u64, mul: f32) -> CudaResult<()> {
        let (wp, sp) = (gpu.ptr(&self.codes), gpu.ptr(&self.scales));
        let (ncb, cb, k, rows) = (self.col_blocks() as i32, self.col_block as i32, self.cols as i32, self.rows as i32);
        gpu.launch(
            &gpu.fns.fp8_dequant_rows,
            cfg((count as u32, 1, 1), THREADS, 0),
            &[&wp, &sp, &ncb, &cb, &ids, &op, &k, &rows, &mul],
        )
    }
}

/// `y[m, n] += bias[n]` (bf16, rounded once more): the bias of an FP8 GEMM's output.
fn add_bias(gpu: &Gpu, yp: u64, bp: u64, m: usize, n: usize) -> CudaResult<()> {
    let (total, n_i) = ((m * n) as u64, n as i32);
    let grid = gpu.grid_for(m * n, THREADS);
    gpu.launch(&gpu.fns.fp8_add_bias, cfg((grid, 1, 1), THREADS, 0), &[&yp, &bp, &n_i, &total])
}

/// Where rows of codes with one scale a row go: row r's codes at `codes + r · code_ld` (bytes),
/// its scale at `scales + r · scale_ld` (f32s) — a dense matrix's (`dense`), or the stacked
/// experts' rows (`moe_fp8.cuh`), each row's scale ahead of its codes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowsAt {
    pub codes: u64,
    pub code_ld: u64,
    pub scales: u64,
    pub scale_ld: u64,
}

impl RowsAt {
    /// Codes `[rows, k]` row-major at `codes`, one scale a row at `scales`.
    pub fn dense(codes: u64, scales: u64, k: usize) -> RowsAt {
        RowsAt { codes, code_ld: k as u64, scales, scale_ld: 1 }
    }
}

/// `rows` rows of `k` bf16 values at `xp` quantized to codes and a scale a row at `at`.
pub(crate) fn quantize_rows(gpu: &Gpu, xp: u64, at: RowsAt, rows: usize, k: usize) -> CudaResult<()> {
    let k_i = k as i32;
    let RowsAt { codes, code_ld, scales, scale_ld } = at;
    gpu.launch(
        &gpu.fns.fp8_quantize_rows,
        cfg((rows as u32, 1, 1), THREADS, 0),
        &[&xp, &codes, &scales, &k_i, &code_ld, &scale_ld],
    )
}

/// Random codes of `rows` rows of `k` (even) values and a scale a row, `amp / 448`, at `at`:
/// values in [-amp, amp] (synthetic models).
pub(crate) fn random_rows(gpu: &Gpu, at: RowsAt, rows: usize, k: usize, seed: u64, amp: f32) -> CudaResult<()> {
    let (r, k_i) = (rows as i32, k as i32);
    let RowsAt { codes, code_ld, scales, scale_ld } = at;
    let grid = gpu.grid_for(rows * k / 2, THREADS);
    gpu.launch(
        &gpu.fns.fp8_random,
        cfg((grid, 1, 1), THREADS, 0),
        &[&codes, &scales, &r, &k_i, &code_ld, &scale_ld, &seed, &amp],
    )
}

/// `y[m, n] = x[m, k] · Wᵀ (+ bias[n])` for `w` of `[n, k]`, f32 accumulation, bf16 or f32
/// out (the bias in the output's type); the paths of the module doc.
pub fn fp8_linear<O: GemmOutput>(
    gpu: &Gpu,
    x: &impl DevicePtr<bf16>,
    w: &Fp8Matrix,
    bias: Option<&dyn DevicePtr<O>>,
    y: &mut impl DevicePtrMut<O>,
    m: usize,
    scratch: Option<&mut CudaSlice<bf16>>,
) -> CudaResult<()> {
    let (n, k) = (w.rows, w.cols);
    let xp = gpu.ptr(x);
    if m == 0 || x.len() < m * k || y.len() < m * n || bias.is_some_and(|b| b.len() < n) || !xp.is_multiple_of(16) {
        return Err(shape_err(format!(
            "FP8 linear m={m} n={n} k={k}: x {} (at {xp:#x}), y {}, bias {:?}",
            x.len(),
            y.len(),
            bias.map(|b| b.len())
        )));
    }
    let bf16_out = O::TYPE == cudarc::cublaslt::sys::cudaDataType::CUDA_R_16BF;
    match scratch {
        Some(s) if m > GEMV_MAX_ROWS && s.len() >= w.scratch_len(m) && w.fp8_gemm() && bf16_out => {
            let sp = gpu.ptr_mut(s);
            let cp = sp + codes_offset(m) as u64;
            quantize_rows(gpu, xp, RowsAt::dense(cp, sp, k), m, k)?;
            let scales = Fp8Scales { x: sp, w: gpu.ptr(&w.scales) };
            gpu.blas.linear_fp8((cp, gpu.ptr(&w.codes)), scales, y, (m, n, k))?;
            match bias {
                Some(b) => add_bias(gpu, gpu.ptr_mut(y), gpu.ptr(b), m, n),
                None => Ok(()),
            }
        }
        Some(s) if (m > GEMV_MAX_ROWS || w.skinny().is_none()) && s.len() >= n * k => {
            w.dequantize(gpu, s)?;
            linear(gpu, x, &s.slice(..n * k), bias, y, (m, n, k))
        }
        _ => {
            let Some(set) = w.skinny() else {
                return Err(shape_err(format!(
                    "FP8 linear n={n} k={k} with scales every {} columns needs a scratch of {} values to \
                     dequantize into",
                    w.col_block,
                    n * k
                )));
            };
            let (out, size) = if bf16_out { (0, 2) } else { (1, 4) };
            let (bp, yp) = (bias.map_or(0, |b| gpu.ptr(b)), gpu.ptr_mut(y));
            for start in (0..m).step_by(GEMV_MAX_ROWS) {
                let rows = GEMV_MAX_ROWS.min(m - start);
                let (xo, yo) = (xp + (start * k * 2) as u64, yp + (start * n * size) as u64);
                w.gemv(gpu, (set, out), xo, Some(bp), yo, rows, n)?;
            }
            Ok(())
        }
    }
}

/// `y[m, n] = act(x·W_gateᵀ) * (x·W_upᵀ)` for `w` of `[2n, k]` (gate rows, then up rows): for
/// decode-sized m the skinny GEMM with the activation as its epilogue; otherwise
/// `fp8_linear` into `gate_up` (m·2n values) and the activation.
#[allow(clippy::too_many_arguments)]
pub fn fp8_linear_gated(
    gpu: &Gpu,
    activation: GatedActivation,
    x: &impl DevicePtr<bf16>,
    w: &Fp8Matrix,
    gate_up: &mut CudaSlice<bf16>,
    y: &mut impl DevicePtrMut<bf16>,
    m: usize,
    scratch: Option<&mut CudaSlice<bf16>>,
) -> CudaResult<()> {
    let (n, k) = (w.rows / 2, w.cols);
    let xp = gpu.ptr(x);
    let skinny = w.skinny().filter(|_| (1..=GEMV_MAX_ROWS).contains(&m));
    let Some(set) = skinny.filter(|_| w.rows.is_multiple_of(2) && xp.is_multiple_of(16)) else {
        fp8_linear::<bf16>(gpu, x, w, None, gate_up, m, scratch)?;
        return gated_activation(gpu, activation, &*gate_up, &gate_up.slice(n..), (m, n, 2 * n), y);
    };
    if x.len() < m * k || y.len() < m * n {
        return Err(shape_err(format!("FP8 gated linear m={m} n={n} k={k}: x {}, y {}", x.len(), y.len())));
    }
    let out = match activation {
        GatedActivation::Silu => 2,
        GatedActivation::GeluTanh => 3,
    };
    w.gemv(gpu, (set, out), xp, None, gpu.ptr_mut(y), m, n)
}

/// `out[t] = bf16(W[ids[t]] · scale)` for t < `tokens` (an id ≥ rows gives a zero row).
pub fn fp8_embedding(
    gpu: &Gpu,
    w: &Fp8Matrix,
    ids: &impl DevicePtr<u32>,
    tokens: usize,
    scale: f32,
    out: &mut impl DevicePtrMut<bf16>,
) -> CudaResult<()> {
    if ids.len() < tokens || out.len() < tokens * w.cols {
        return Err(shape_err(format!(
            "FP8 embedding [{}, {}] of {tokens} ids: ids {}, out {}",
            w.rows,
            w.cols,
            ids.len(),
            out.len()
        )));
    }
    if tokens == 0 {
        return Ok(());
    }
    w.dequant_rows(gpu, gpu.ptr(ids), tokens, gpu.ptr_mut(out), scale)
}
