//! Routed mixtures of experts on the device, with no host round trip inside a step (kernels
//! in `moe.cu` and `moe_gemm.cuh`), so a MoE decode step is captured in a CUDA graph like a
//! dense one:
//!
//! 1. `moe_route`: each token's softmax over its router logits, its top-k experts and their
//!    weights (renormalized, times per-expert scales, as the model says), then the step's
//!    (token, expert) pairs grouped by expert — per-expert offsets, tiles and the active
//!    experts, computed on the device into a `MoeRoute` (one launch for a decode step's few
//!    tokens, two above);
//! 2. `moe_linear`: one launch per projection for all experts over the grouped rows — for a
//!    step of up to 8 tokens a skinny GEMM over the chosen experts only (each chosen expert's
//!    weights read once), otherwise a grouped tensor-core GEMM over tiles of one expert's rows;
//!    the gate-up projection reads the tokens' rows through the grouping and applies the gated
//!    activation in its epilogue;
//! 3. `moe_down`: the down projection as `moe_linear` runs it, and each token's weighted sum
//!    of its experts' outputs in ascending expert order — inside the skinny GEMM's launch at
//!    decode, a launch of its own above.
//!
//! A layer's experts of one projection are one `ExpertMatrix` allocation, bf16, one block
//! type the quantized kernels read, GGUF or MLX, or FP8 rows (`fp8`: e4m3 codes behind their
//! scale runs), dequantized in registers or on the way to shared memory, never into a scratch.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::cuda::context::{cfg, Gpu};
use crate::cuda::error::{CudaError, CudaResult};
use crate::cuda::functions::{MoeFunctions, MOE_GEMV_TOKENS};
use crate::cuda::ops::elementwise::GatedActivation;
use crate::cuda::ops::quant::{kernels, QuantMatrix};
use crate::dtype::DType;

mod fp8;

/// Most experts a token may choose (a warp's lanes hold them).
pub const MOE_MAX_TOP_K: usize = 32;
/// Most experts of a layer (the router kernel keeps 4 tokens' probabilities in shared memory).
pub const MOE_MAX_EXPERTS: usize = 2048;
/// `moe.cu`: tokens a routing block takes; threads of an alignment block; tokens
/// `moe_route_small` takes (a warp each), and the most shared memory it may use for their
/// probabilities (the default per-block budget).
const ROUTE_WARPS: usize = 4;
const ALIGN_THREADS: u32 = 256;
const SMALL_TOKENS: usize = 8;
const SMALL_SHARED: usize = 48 * 1024 - 4 * 32 * (2 * SMALL_TOKENS + 1);
/// `moe_gemm.cuh`: rows and output columns of a GEMM tile, threads of its block; the skinny
/// GEMM's threads and rows (quant.cuh's `QG_THREADS`, `QG_ROWS`).
const GEMM_BM: usize = 64;
const GEMM_BN: usize = 64;
const GEMM_THREADS: u32 = 128;
const GEMV_THREADS: u32 = 128;
const GEMV_ROWS: usize = 4;
/// Output modes (quant.cuh's `QG_*`).
const MODE_PLAIN: i32 = 0;
const MODE_SILU: i32 = 2;
const MODE_GELU: i32 = 3;

fn check(ok: bool, what: impl FnOnce() -> String) -> CudaResult<()> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape(what()))
    }
}

/// One projection of a layer's experts: `[experts, rows, cols]` stacked in one allocation,
/// bf16 values, quantized blocks (each expert's rows as `QuantMatrix` holds them: GGUF blocks
/// as the file stores them, MLX groups as `quant::mlx` assembles them) or FP8 rows (`F8E4M3`:
/// `moe_fp8.cuh`'s layout, made by `upload_fp8`, `quantize_fp8` or `random`).
pub struct ExpertMatrix {
    dtype: DType,
    experts: usize,
    rows: usize,
    cols: usize,
    data: CudaSlice<u8>,
    /// The `fmt` argument of the experts' kernels (quant.cuh: the runtime part of an MLX
    /// layout; moe_fp8.cuh: the scale runs; 0 otherwise).
    fmt: i32,
}

impl ExpertMatrix {
    /// Whether the experts' kernels read `dtype` as bytes `upload` takes (bf16 and the
    /// quantized kernels' types; FP8 rows come from `upload_fp8`).
    pub fn supports(dtype: DType) -> bool {
        dtype == DType::BF16 || QuantMatrix::supports(dtype)
    }

    /// Bytes of a row of `cols` values: bf16 rows of a multiple of 8 values (16-byte loads),
    /// block rows as `QuantMatrix` takes them.
    fn row_bytes(dtype: DType, cols: usize) -> CudaResult<usize> {
        if dtype != DType::BF16 {
            return QuantMatrix::row_bytes(dtype, cols);
        }
        check(cols > 0 && cols.is_multiple_of(8), || format!("bf16 expert rows of {cols} values (a multiple of 8)"))?;
        Ok(2 * cols)
    }

    /// `experts` × `rows` × `cols` values of `dtype` from their bytes (bf16: little-endian
    /// values; blocks: as `QuantMatrix::upload` takes them), expert after expert.
    pub fn upload(
        gpu: &Gpu,
        dtype: DType,
        (experts, rows, cols): (usize, usize, usize),
        bytes: &[u8],
    ) -> CudaResult<ExpertMatrix> {
        if !Self::supports(dtype) {
            return Err(CudaError::Unsupported(format!("{dtype} expert weights")));
        }
        let need = experts * rows * Self::row_bytes(dtype, cols)?;
        check(experts > 0 && rows > 0 && bytes.len() == need, || {
            format!("{experts} experts of [{rows}, {cols}] {dtype} in {} bytes ({need} expected)", bytes.len())
        })?;
        Ok(ExpertMatrix { dtype, experts, rows, cols, data: gpu.upload(bytes)?, fmt: Self::fmt_of(gpu, dtype)? })
    }

    /// The `fmt` argument of a type `upload` takes.
    fn fmt_of(gpu: &Gpu, dtype: DType) -> CudaResult<i32> {
        if dtype == DType::BF16 {
            Ok(0)
        } else {
            Ok(kernels(gpu, dtype)?.1)
        }
    }

    /// Random experts made on the device from `seed` (synthetic models): bf16 values uniform
    /// in [-amp, amp), random blocks whose values lie about there, or FP8 rows of random codes
    /// with a scale a row.
    pub fn random(
        gpu: &Gpu,
        dtype: DType,
        (experts, rows, cols): (usize, usize, usize),
        seed: u64,
        amp: f32,
    ) -> CudaResult<ExpertMatrix> {
        if dtype == DType::F8E4M3 {
            return Self::random_fp8(gpu, (experts, rows, cols), seed, amp);
        }
        if !Self::supports(dtype) {
            return Err(CudaError::Unsupported(format!("{dtype} expert weights")));
        }
        let bytes = experts * rows * Self::row_bytes(dtype, cols)?;
        let mut data = gpu.alloc::<u8>(bytes)?;
        let wp = gpu.ptr_mut(&mut data);
        if dtype == DType::BF16 {
            let n = (bytes / 2) as u64;
            let grid = gpu.grid_for(n as usize, 256);
            gpu.launch(&gpu.fns.random_bf16, cfg((grid, 1, 1), 256, 0), &[&wp, &n, &seed, &amp])?;
        } else {
            let n = (bytes / dtype.block_bytes()) as u64;
            let grid = gpu.grid_for(n as usize, 256);
            let (f, fmt) = kernels(gpu, dtype)?;
            gpu.launch(&f.random_blocks, cfg((grid, 1, 1), 256, 0), &[&wp, &n, &seed, &amp, &fmt])?;
        }
        Ok(ExpertMatrix { dtype, experts, rows, cols, data, fmt: Self::fmt_of(gpu, dtype)? })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Rows of each expert.
    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Device bytes of all experts.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The experts' kernels for this matrix's type and the `fmt` argument they take.
    fn functions<'g>(&self, gpu: &'g Gpu) -> CudaResult<(&'g MoeFunctions, i32)> {
        let f = match self.dtype {
            DType::BF16 => &gpu.fns.moe_bf16,
            DType::F8E4M3 => &gpu.fns.moe_fp8,
            d => &kernels(gpu, d)?.0.moe,
        };
        Ok((f, self.fmt))
    }
}

/// A step's routing on the device, for steps of up to `tokens` tokens: each token's chosen
/// experts and weights, and the (token, expert) pairs grouped by expert.
pub struct MoeRoute {
    tokens: usize,
    experts: usize,
    top_k: usize,
    /// The tokens `moe_route` last routed: the products and the sum take exactly these (a
    /// grouping of more tokens names rows past a smaller step's buffers).
    routed: usize,
    /// `[tokens, top_k]`: each token's experts in ascending order, and their weights.
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    /// `[experts + 1]`: expert e's grouped rows are `offsets[e] .. offsets[e + 1]`, its GEMM
    /// tiles `tiles[e] .. tiles[e + 1]`.
    offsets: CudaSlice<i32>,
    tiles: CudaSlice<i32>,
    /// `[experts]`: the experts with pairs, ascending, then -1.
    active: CudaSlice<i32>,
    /// `[tokens × top_k]`: the token of each grouped row; the grouped row of each pair.
    rows: CudaSlice<i32>,
    pos: CudaSlice<i32>,
}

impl MoeRoute {
    /// Buffers for steps of up to `tokens` tokens choosing `top_k` of `experts` experts.
    pub fn new(gpu: &Gpu, tokens: usize, experts: usize, top_k: usize) -> CudaResult<MoeRoute> {
        if !(1..=MOE_MAX_EXPERTS).contains(&experts) || !(1..=MOE_MAX_TOP_K.min(experts)).contains(&top_k) {
            return Err(CudaError::Unsupported(format!(
                "{top_k} of {experts} experts a token (the CUDA routing takes up to {MOE_MAX_TOP_K} of up to \
                 {MOE_MAX_EXPERTS})"
            )));
        }
        let pairs = tokens.max(1) * top_k;
        Ok(MoeRoute {
            tokens: tokens.max(1),
            experts,
            top_k,
            routed: 0,
            ids: gpu.alloc(pairs)?,
            weights: gpu.alloc(pairs)?,
            offsets: gpu.alloc(experts + 1)?,
            tiles: gpu.alloc(experts + 1)?,
            active: gpu.alloc(experts)?,
            rows: gpu.alloc(pairs)?,
            pos: gpu.alloc(pairs)?,
        })
    }

    pub fn experts(&self) -> usize {
        self.experts
    }

    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Each token's experts in ascending order (`[tokens, top_k]`) and their weights.
    pub fn choices(&self) -> (&CudaSlice<i32>, &CudaSlice<f32>) {
        (&self.ids, &self.weights)
    }

    /// The grouping: per-expert offsets (`[experts + 1]`), the active experts (`[experts]`,
    /// -1 past the last), the token of each grouped row, the grouped row of each pair, and the
    /// per-expert GEMM tiles of 64 rows (`[experts + 1]`).
    pub fn grouping(&self) -> [&CudaSlice<i32>; 5] {
        [&self.offsets, &self.active, &self.rows, &self.pos, &self.tiles]
    }

    fn check_tokens(&self, tokens: usize) -> CudaResult<()> {
        check(tokens <= self.tokens, || format!("a MoE step of {tokens} tokens in routing for {}", self.tokens))
    }

    fn check_routed(&self, tokens: usize) -> CudaResult<()> {
        check(tokens == self.routed, || format!("a MoE step of {tokens} tokens over a routing of {}", self.routed))
    }
}

/// Route `tokens` tokens by their router logits (`[tokens, experts]` f32) into `r`: each
/// token's `top_k` experts by softmax probability (the lower expert first among equals), the
/// weights divided by the chosen ones' sum when `renormalize`, times `scale[e]` when given
/// (Gemma 4's per-expert scale); then the pairs grouped by expert, in token order within an
/// expert. One launch for a step of up to 8 tokens (over up to 1,468 experts: their
/// probabilities in the default shared memory), two above; nothing comes back to the host.
pub fn moe_route(
    gpu: &Gpu,
    logits: &impl DevicePtr<f32>,
    tokens: usize,
    renormalize: bool,
    scale: Option<&dyn DevicePtr<f32>>,
    r: &mut MoeRoute,
) -> CudaResult<()> {
    let (e, k) = (r.experts, r.top_k);
    r.check_tokens(tokens)?;
    check(logits.len() >= tokens * e && scale.is_none_or(|s| s.len() >= e), || {
        format!(
            "moe_route of {tokens} tokens over {e} experts: logits {}, scale {:?}",
            logits.len(),
            scale.map(|s| s.len())
        )
    })?;
    r.routed = tokens;
    if tokens == 0 {
        return Ok(());
    }
    let lp = gpu.ptr(logits);
    let sp = scale.map_or(0, |s| gpu.ptr(s));
    let [t_i, e_i, k_i, renorm] = [tokens, e, k, usize::from(renormalize)].map(|v| v as i32);
    let bm = GEMM_BM as i32;
    let (ip, wp) = (gpu.ptr_mut(&mut r.ids), gpu.ptr_mut(&mut r.weights));
    let (op, tp, ap) = (gpu.ptr_mut(&mut r.offsets), gpu.ptr_mut(&mut r.tiles), gpu.ptr_mut(&mut r.active));
    let (rp, pp) = (gpu.ptr_mut(&mut r.rows), gpu.ptr_mut(&mut r.pos));
    // A decode step's few tokens: routed and grouped by one block.
    if tokens <= SMALL_TOKENS && SMALL_TOKENS * e * 4 <= SMALL_SHARED {
        return gpu.launch(
            &gpu.fns.moe_route_small,
            cfg((1, 1, 1), ALIGN_THREADS, SMALL_TOKENS * e * 4),
            &[&lp, &t_i, &e_i, &k_i, &renorm, &sp, &bm, &ip, &wp, &op, &tp, &ap, &rp, &pp],
        );
    }
    let grid = tokens.div_ceil(ROUTE_WARPS) as u32;
    let shared = ROUTE_WARPS * e * 4;
    gpu.launch(
        &gpu.fns.moe_route,
        cfg((grid, 1, 1), 32 * ROUTE_WARPS as u32, shared),
        &[&lp, &t_i, &e_i, &k_i, &renorm, &sp, &ip, &wp],
    )?;
    let pairs = (tokens * k) as i32;
    let ids = gpu.ptr(&r.ids);
    gpu.launch(
        &gpu.fns.moe_align,
        cfg((e as u32, 1, 1), ALIGN_THREADS, e * 4),
        &[&ids, &pairs, &k_i, &e_i, &bm, &op, &tp, &ap, &rp, &pp],
    )
}

/// What an expert projection computes from its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertProduct {
    /// `x · Wᵀ` (the down projection).
    Plain,
    /// `act(x · W_gateᵀ) * (x · W_upᵀ)` for each expert's `[2n, k]` rows, gate rows first.
    Gated(GatedActivation),
}

/// One projection of every expert over the step's pairs as `r` grouped them (its last
/// `moe_route`, of `tokens` tokens): `y[g]` (one row per pair, in grouped order) is `x`'s row
/// for pair g through that pair's expert. With `from_tokens`, `x` holds the tokens' rows
/// (`[tokens, cols]`, read through the grouping: the gate-up projection); otherwise one row
/// per pair in grouped order (`[tokens × top_k, cols]`). One launch for all experts: the
/// skinny GEMM over the chosen experts for up to 8 tokens, the grouped tensor-core GEMM above.
#[allow(clippy::too_many_arguments)]
pub fn moe_linear(
    gpu: &Gpu,
    product: ExpertProduct,
    x: &impl DevicePtr<bf16>,
    from_tokens: bool,
    w: &ExpertMatrix,
    r: &MoeRoute,
    tokens: usize,
    y: &mut impl DevicePtrMut<bf16>,
) -> CudaResult<()> {
    expert_product(gpu, product, x, from_tokens, w, r, tokens, y, None).map(|_| ())
}

/// The down projection and the experts' sum: `y` as `moe_linear` writes it for the plain
/// product of `x`'s rows (one per pair, grouped), then `out[t] = Σ_j weight[t, j] · y[row of
/// pair (t, j)]` (`[tokens, rows]`: each token's experts' rows times its routing weights,
/// summed in ascending expert order in f32). A step of up to 8 tokens sums inside the
/// projection's launch (the last slot of each column block, found by `sum`'s counters);
/// larger ones launch the sum after it.
#[allow(clippy::too_many_arguments)]
pub fn moe_down(
    gpu: &Gpu,
    x: &impl DevicePtr<bf16>,
    w: &ExpertMatrix,
    r: &MoeRoute,
    tokens: usize,
    y: &mut CudaSlice<bf16>,
    sum: &mut ExpertSum,
    out: &mut impl DevicePtrMut<bf16>,
) -> CudaResult<()> {
    let d = w.rows;
    check(sum.d == d && out.len() >= tokens * d, || {
        format!("moe_down into [{tokens}, {d}]: out {}, sum counters for rows of {}", out.len(), sum.d)
    })?;
    let summed = expert_product(gpu, ExpertProduct::Plain, x, false, w, r, tokens, y, Some((sum, gpu.ptr_mut(out))))?;
    if summed || tokens == 0 {
        return Ok(());
    }
    moe_combine(gpu, &*y, r, (tokens, d), out)
}

/// The counters by which `moe_down`'s last slot of each column block finds itself (zero
/// between launches: that slot resets its own), for expert outputs of `d` rows.
pub struct ExpertSum {
    d: usize,
    counters: CudaSlice<i32>,
}

impl ExpertSum {
    pub fn new(gpu: &Gpu, d: usize) -> CudaResult<ExpertSum> {
        Ok(ExpertSum { d, counters: gpu.alloc(d.div_ceil(GEMV_ROWS).max(1))? })
    }
}

/// `moe_gemm.cuh`'s `MoeSum`, passed by value: where the skinny GEMM sums each token's
/// experts (a null `out`: no sum).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SumArgs {
    out: u64,
    pos: u64,
    weights: u64,
    top_k: i32,
    tokens: i32,
    counters: u64,
}

// SAFETY: u64 and i32 fields in the order and alignment of moe_gemm.cuh's `MoeSum` (three
// pointers, two ints, a pointer: 40 bytes).
unsafe impl cudarc::driver::DeviceRepr for SumArgs {}

/// `moe_linear`, and with `sum` (the plain product, into `(counters, out address)`) each
/// token's sum when the skinny GEMM runs: whether it summed.
#[allow(clippy::too_many_arguments)]
fn expert_product(
    gpu: &Gpu,
    product: ExpertProduct,
    x: &impl DevicePtr<bf16>,
    from_tokens: bool,
    w: &ExpertMatrix,
    r: &MoeRoute,
    tokens: usize,
    y: &mut impl DevicePtrMut<bf16>,
    sum: Option<(&mut ExpertSum, u64)>,
) -> CudaResult<bool> {
    r.check_routed(tokens)?;
    let (mode, n) = match product {
        ExpertProduct::Plain => (MODE_PLAIN, w.rows),
        ExpertProduct::Gated(GatedActivation::Silu) => (MODE_SILU, w.rows / 2),
        ExpertProduct::Gated(GatedActivation::GeluTanh) => (MODE_GELU, w.rows / 2),
    };
    let (pairs, k) = (tokens * r.top_k, w.cols);
    let x_rows = if from_tokens { tokens } else { pairs };
    let xp = gpu.ptr(x);
    check(
        w.experts == r.experts
            && n > 0
            && (mode == MODE_PLAIN || w.rows.is_multiple_of(2))
            && x.len() >= x_rows * k
            && y.len() >= pairs * n
            && xp.is_multiple_of(16),
        || {
            format!(
                "moe_linear {product:?} of {} experts [{}, {k}] for {tokens} tokens routed over {} experts: x {} (at \
                 {xp:#x}), y {}",
                w.experts,
                w.rows,
                r.experts,
                x.len(),
                y.len()
            )
        },
    )?;
    if tokens == 0 {
        return Ok(false);
    }
    let (fns, fmt) = w.functions(gpu)?;
    let src = if from_tokens { gpu.ptr(&r.rows) } else { 0 };
    let (wp, yp, op) = (gpu.ptr(&w.data), gpu.ptr_mut(y), gpu.ptr(&r.offsets));
    let expert_bytes = (w.data.len() / w.experts) as u64;
    let [n_i, k_i, e_i] = [n, k, r.experts].map(|v| v as i32);
    // Blocks past the active experts (or the real tiles) exit at once.
    let slots = r.experts.min(pairs);
    let gated = mode != MODE_PLAIN;
    match MOE_GEMV_TOKENS.iter().position(|&m| m >= tokens) {
        Some(i) => {
            let cols = if gated { n.div_ceil(2) } else { n.div_ceil(GEMV_ROWS) };
            let ap = gpu.ptr(&r.active);
            let summed = sum.is_some();
            let args = match sum {
                Some((s, out)) => SumArgs {
                    out,
                    pos: gpu.ptr(&r.pos),
                    weights: gpu.ptr(&r.weights),
                    top_k: r.top_k as i32,
                    tokens: tokens as i32,
                    counters: gpu.ptr_mut(&mut s.counters),
                },
                None => SumArgs { out: 0, pos: 0, weights: 0, top_k: 0, tokens: 0, counters: 0 },
            };
            gpu.launch(
                &fns.gemv[i],
                cfg((cols as u32, slots as u32, 1), GEMV_THREADS, 0),
                &[&xp, &src, &wp, &expert_bytes, &yp, &op, &ap, &n_i, &k_i, &mode, &fmt, &args],
            )?;
            Ok(summed)
        }
        None => {
            let cols = n.div_ceil(if gated { GEMM_BN / 2 } else { GEMM_BN });
            let tiles = pairs / GEMM_BM + slots;
            let tp = gpu.ptr(&r.tiles);
            gpu.launch(
                &fns.gemm,
                cfg((cols as u32, tiles as u32, 1), GEMM_THREADS, 0),
                &[&xp, &src, &wp, &expert_bytes, &yp, &op, &tp, &e_i, &n_i, &k_i, &mode, &fmt],
            )?;
            Ok(false)
        }
    }
}

/// `out[t] = Σ_j weight[t, j] · y[row of pair (t, j)]` for `tokens` tokens: each token's
/// experts' outputs (`y`, `[tokens × top_k, d]` in grouped order, as `moe_linear` writes them)
/// times its routing weights, summed in ascending expert order in f32.
fn moe_combine(
    gpu: &Gpu,
    y: &impl DevicePtr<bf16>,
    r: &MoeRoute,
    (tokens, d): (usize, usize),
    out: &mut impl DevicePtrMut<bf16>,
) -> CudaResult<()> {
    r.check_routed(tokens)?;
    let pairs = tokens * r.top_k;
    check(y.len() >= pairs * d && out.len() >= tokens * d, || {
        format!("moe_combine [{tokens} x {}, {d}]: y {}, out {}", r.top_k, y.len(), out.len())
    })?;
    if tokens * d == 0 {
        return Ok(());
    }
    let (yp, pp, wp, op) = (gpu.ptr(y), gpu.ptr(&r.pos), gpu.ptr(&r.weights), gpu.ptr_mut(out));
    let [k, d_i] = [r.top_k, d].map(|v| v as i32);
    let threads = (d / 4).next_multiple_of(32).clamp(32, 256) as u32;
    gpu.launch(&gpu.fns.moe_combine, cfg((tokens as u32, 1, 1), threads, 0), &[&op, &yp, &pp, &wp, &k, &d_i])
}
