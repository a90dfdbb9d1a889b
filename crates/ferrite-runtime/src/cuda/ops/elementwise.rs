//! Row-wise and element-wise ops on bf16 activations: embedding gather, RoPE (optionally
//! storing the rotated keys and the values into the KV cache; one frequency table, or one per
//! token), gated and plain activations, the logits' scale and softcap, a device copy, random
//! fill (synthetic weights), and the linear layer (our skinny GEMM for decode, cuBLASLt), alone
//! or with a gated activation after it. (The norms are `norm`'s.)
//!
//! Activations are bf16 `[tokens, features]` rows; every kernel computes in f32. Norm weights
//! and RoPE frequencies are small f32 buffers. Inputs read as "rows of `stride` values" may be
//! views into a wider buffer (the q, k, v parts of a fused QKV projection).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::cuda::blas::GemmOutput;
use crate::cuda::context::{cfg, Gpu};
use crate::cuda::error::{CudaError, CudaResult};
use crate::cuda::ops::attention::AttentionMeta;
use crate::cuda::ops::kv_pool::{store_rows, DeviceKv};

fn check(ok: bool, what: impl FnOnce() -> String) -> CudaResult<()> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape(what()))
    }
}

/// An embedding table's element type: bf16 or f32 rows.
pub trait TableElement: cudarc::driver::DeviceRepr {
    #[doc(hidden)]
    fn kernel(gpu: &Gpu) -> &cudarc::driver::CudaFunction;
}

impl TableElement for bf16 {
    fn kernel(gpu: &Gpu) -> &cudarc::driver::CudaFunction {
        &gpu.fns.embedding_bf16
    }
}

impl TableElement for f32 {
    fn kernel(gpu: &Gpu) -> &cudarc::driver::CudaFunction {
        &gpu.fns.embedding_f32
    }
}

/// `out[t] = table[ids[t]] * scale` for `table` of `[vocab, dim]`. Ids must be < vocab (the
/// caller checks them; an id outside writes a zero row rather than reading out of bounds).
#[allow(clippy::too_many_arguments)]
pub fn embedding<T: TableElement>(
    gpu: &Gpu,
    table: &impl DevicePtr<T>,
    (vocab, dim): (usize, usize),
    ids: &impl DevicePtr<u32>,
    tokens: usize,
    scale: f32,
    out: &mut impl DevicePtrMut<bf16>,
) -> CudaResult<()> {
    check(table.len() >= vocab * dim && ids.len() >= tokens && out.len() >= tokens * dim, || {
        format!(
            "embedding [{vocab}, {dim}] of {tokens} ids: table {}, ids {}, out {}",
            table.len(),
            ids.len(),
            out.len()
        )
    })?;
    if tokens == 0 {
        return Ok(());
    }
    let (tp, ip, op) = (gpu.ptr(table), gpu.ptr(ids), gpu.ptr_mut(out));
    let (dim_i, vocab_i) = (dim as i32, vocab as i32);
    gpu.launch(T::kernel(gpu), cfg((tokens as u32, 1, 1), 256, 0), &[&tp, &ip, &op, &dim_i, &vocab_i, &scale])
}

/// Shapes of a RoPE call: `tokens` rows of `stride` values, each starting with `n_heads` heads
/// of `head_dim` values (q heads, or the q and k heads of a fused QKV row).
#[derive(Debug, Clone, Copy)]
pub struct RopeShape {
    pub tokens: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    pub stride: usize,
}

/// Rotate the heads of `x` in place (rotate-half layout) at `positions`; `inv_freq` has
/// rotary_dim / 2 values (partial rotary when rotary_dim < head_dim); cos and sin are scaled
/// by `scaling`. A fused QKV buffer rotates its q and k heads in one call.
///
/// With `kv`, the last `kv.n_kv_heads` of the shape's heads are key heads followed in each
/// row by as many value heads (a fused QKV row), and the same launch stores the rotated keys
/// and the values into the cache at `meta`'s slots, as `write_kv` would.
pub fn rope(
    gpu: &Gpu,
    x: &mut impl DevicePtrMut<bf16>,
    positions: &impl DevicePtr<u32>,
    inv_freq: &impl DevicePtr<f32>,
    scaling: f32,
    s: RopeShape,
    kv: Option<(&AttentionMeta, &mut DeviceKv)>,
) -> CudaResult<()> {
    launch_rope(gpu, x, positions, (gpu.ptr(inv_freq), inv_freq.len(), 0), scaling, s, kv)
}

/// `rope` with a frequency table per token: `tables` holds tables of `half` frequencies and
/// token t rotates by table `table_of[t]` (which must be < `tables.len() / half`): a schedule
/// that depends on each row's length (dynamic NTK, long RoPE), one table per distinct one.
#[allow(clippy::too_many_arguments)]
pub fn rope_per_token(
    gpu: &Gpu,
    x: &mut impl DevicePtrMut<bf16>,
    positions: &impl DevicePtr<u32>,
    (tables, half, table_of): (&impl DevicePtr<f32>, usize, &impl DevicePtr<i32>),
    scaling: f32,
    s: RopeShape,
    kv: Option<(&AttentionMeta, &mut DeviceKv)>,
) -> CudaResult<()> {
    check(half > 0 && tables.len() >= half && table_of.len() >= s.tokens, || {
        format!("rope of {} tokens by tables of {half}: tables {}, table_of {}", s.tokens, tables.len(), table_of.len())
    })?;
    launch_rope(gpu, x, positions, (gpu.ptr(tables), half, gpu.ptr(table_of)), scaling, s, kv)
}

/// The RoPE launch: frequencies at `fp` (`half` a table; `tp` the per-token table indices,
/// 0 for one table).
fn launch_rope(
    gpu: &Gpu,
    x: &mut impl DevicePtrMut<bf16>,
    positions: &impl DevicePtr<u32>,
    (fp, half, tp): (u64, usize, u64),
    scaling: f32,
    s: RopeShape,
    kv: Option<(&AttentionMeta, &mut DeviceKv)>,
) -> CudaResult<()> {
    let n_kv = kv.as_ref().map_or(0, |(_, c)| c.n_kv_heads);
    let width = (s.n_heads + n_kv) * s.head_dim;
    let need = if s.tokens == 0 { 0 } else { (s.tokens - 1) * s.stride + width };
    check(2 * half <= s.head_dim && s.stride >= width && positions.len() >= s.tokens && x.len() >= need, || {
        format!("rope {s:?} with {half} frequencies and {n_kv} KV heads: x {}, positions {}", x.len(), positions.len())
    })?;
    let (mut sp, mut kc, mut vc, mut bs) = (0u64, 0u64, 0u64, 0i32);
    // A quantized cache is stored after the rotation, by the quantizing KV write.
    let mut quantized = None;
    if let Some((meta, cache)) = kv {
        let (slots, block_size) = meta.slots();
        check(
            meta.tokens == s.tokens
                && block_size == cache.block_size
                && cache.head_dim == s.head_dim
                && n_kv <= s.n_heads
                && cache.sized(),
            || {
                format!(
                    "rope {s:?} storing into a cache of {n_kv} KV heads x {}, block size {} (meta: {} tokens, block \
                     size {block_size})",
                    cache.head_dim, cache.block_size, meta.tokens
                )
            },
        )?;
        if cache.format() == 0 {
            (sp, kc, vc, bs) =
                (gpu.ptr(&slots), gpu.ptr(&cache.k.data), gpu.ptr(&cache.v.data), cache.block_size as i32);
        } else {
            quantized = Some((meta, cache));
        }
    }
    if s.tokens == 0 {
        return Ok(());
    }
    let (xp, pp) = (gpu.ptr_mut(x), gpu.ptr(positions));
    if half > 0 || sp != 0 {
        let [nh, hd, half_i, st, nkv] = [s.n_heads, s.head_dim, half, s.stride, n_kv].map(|v| v as i32);
        gpu.launch(
            &gpu.fns.rope,
            cfg((s.tokens as u32, s.n_heads as u32, 1), half.next_multiple_of(32).clamp(32, 256) as u32, 0),
            &[&xp, &pp, &fp, &nh, &hd, &half_i, &scaling, &st, &sp, &nkv, &kc, &vc, &bs, &tp],
        )?;
    }
    match quantized {
        // The rotated key heads are the last `n_kv` of the row's heads; the values follow.
        Some((meta, cache)) => {
            let bf = std::mem::size_of::<bf16>();
            let k_at = xp + ((s.n_heads - n_kv) * s.head_dim * bf) as u64;
            let v_at = xp + (s.n_heads * s.head_dim * bf) as u64;
            store_rows(gpu, (k_at, v_at), s.stride, meta, cache, 1.0)
        }
        None => Ok(()),
    }
}

/// The activation of a gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatedActivation {
    /// SwiGLU: `silu(gate) * up`.
    Silu,
    /// GeGLU with the tanh GELU (`gelu_pytorch_tanh`).
    GeluTanh,
}

/// `out[t, j] = act(gate[t, j]) * up[t, j]` for `tokens` rows of `inter` values; gate and up
/// are rows of `in_stride` values (e.g. the two halves of a fused gate_up projection).
pub fn gated_activation(
    gpu: &Gpu,
    act: GatedActivation,
    gate: &impl DevicePtr<bf16>,
    up: &impl DevicePtr<bf16>,
    (tokens, inter, in_stride): (usize, usize, usize),
    out: &mut impl DevicePtrMut<bf16>,
) -> CudaResult<()> {
    let need = if tokens == 0 { 0 } else { (tokens - 1) * in_stride + inter };
    check(in_stride >= inter && gate.len() >= need && up.len() >= need && out.len() >= tokens * inter, || {
        format!(
            "gated activation [{tokens}, {inter}] stride {in_stride}: gate {}, up {}, out {}",
            gate.len(),
            up.len(),
            out.len()
        )
    })?;
    if tokens * inter == 0 {
        return Ok(());
    }
    let f = match act {
        GatedActivation::Silu => &gpu.fns.silu_mul,
        GatedActivation::GeluTanh => &gpu.fns.gelu_tanh_mul,
    };
    let (gp, up_, op) = (gpu.ptr(gate), gpu.ptr(up), gpu.ptr_mut(out));
    let [t, i, st] = [tokens, inter, in_stride].map(|v| v as i32);
    gpu.launch(f, cfg((gpu.grid_for(tokens * inter, 256), 1, 1), 256, 0), &[&gp, &up_, &op, &t, &i, &st])
}

/// `x = act(x)` over the first `n` values, in place: a plain (ungated) MLP's activation.
pub fn activation(gpu: &Gpu, act: GatedActivation, x: &mut impl DevicePtrMut<bf16>, n: usize) -> CudaResult<()> {
    check(x.len() >= n, || format!("activation of {n} values: x {}", x.len()))?;
    if n == 0 {
        return Ok(());
    }
    let f = match act {
        GatedActivation::Silu => &gpu.fns.silu_inplace,
        GatedActivation::GeluTanh => &gpu.fns.gelu_tanh_inplace,
    };
    let (xp, n64) = (gpu.ptr_mut(x), n as u64);
    gpu.launch(f, cfg((gpu.grid_for(n, 256), 1, 1), 256, 0), &[&xp, &n64])
}

/// `x[t, i] *= sigmoid(gate[t · gate_stride + i])` over `[tokens, width]` bf16 values (a
/// gated attention output, its gates in the fused QKV rows).
pub fn sigmoid_gate_mul(
    gpu: &Gpu,
    x: &mut impl DevicePtrMut<bf16>,
    gate: &impl DevicePtr<bf16>,
    (tokens, width, gate_stride): (usize, usize, usize),
) -> CudaResult<()> {
    let need = if tokens == 0 { 0 } else { (tokens - 1) * gate_stride + width };
    check(x.len() >= tokens * width && gate.len() >= need && gate_stride >= width, || {
        format!("sigmoid gate [{tokens}, {width}] stride {gate_stride}: x {}, gate {}", x.len(), gate.len())
    })?;
    if tokens * width == 0 {
        return Ok(());
    }
    let (xp, gp) = (gpu.ptr_mut(x), gpu.ptr(gate));
    let [gs, w, t] = [gate_stride, width, tokens].map(|v| v as i32);
    gpu.launch(
        &gpu.fns.sigmoid_gate_mul,
        cfg((gpu.grid_for(tokens * width, 256), 1, 1), 256, 0),
        &[&xp, &gp, &gs, &w, &t],
    )
}

/// `out[t, i] += sigmoid(logit[t]) · y[t, i]` over `[tokens, width]` bf16 values (a shared
/// expert's output joining the routed experts' sum through its gate's logit).
pub fn add_sigmoid_scaled(
    gpu: &Gpu,
    out: &mut impl DevicePtrMut<bf16>,
    y: &impl DevicePtr<bf16>,
    logit: &impl DevicePtr<f32>,
    (tokens, width): (usize, usize),
) -> CudaResult<()> {
    let n = tokens * width;
    check(out.len() >= n && y.len() >= n && logit.len() >= tokens, || {
        format!("sigmoid-scaled add [{tokens}, {width}]: out {}, y {}, logits {}", out.len(), y.len(), logit.len())
    })?;
    if n == 0 {
        return Ok(());
    }
    let (op, yp, lp) = (gpu.ptr_mut(out), gpu.ptr(y), gpu.ptr(logit));
    let [w, t] = [width, tokens].map(|v| v as i32);
    gpu.launch(&gpu.fns.add_sigmoid_scaled, cfg((gpu.grid_for(n, 256), 1, 1), 256, 0), &[&op, &yp, &lp, &w, &t])
}

/// `x = x · scale`, then `cap · tanh(x / cap)` with a `softcap`, over the first `n` f32 values:
/// the logits' multiplier (granite's `1 / logits_scaling`) and final softcap (Gemma 2+).
pub fn scale_softcap(
    gpu: &Gpu,
    x: &mut impl DevicePtrMut<f32>,
    n: usize,
    scale: f32,
    softcap: Option<f32>,
) -> CudaResult<()> {
    check(x.len() >= n && softcap.is_none_or(|c| c > 0.0), || {
        format!("logit scale {scale} and softcap {softcap:?} of {n} values: x {}", x.len())
    })?;
    if n == 0 {
        return Ok(());
    }
    let (xp, n64, cap) = (gpu.ptr_mut(x), n as u64, softcap.unwrap_or(0.0));
    gpu.launch(&gpu.fns.logit_epilogue, cfg((gpu.grid_for(n, 256), 1, 1), 256, 0), &[&xp, &n64, &scale, &cap])
}

/// Copy `src` into `dst` with the 16-byte copy kernel (both the same byte length, a
/// multiple of 16, and 16-byte aligned, as device allocations are).
pub fn copy<T>(gpu: &Gpu, src: &impl DevicePtr<T>, dst: &mut impl DevicePtrMut<T>) -> CudaResult<()> {
    let bytes = src.num_bytes();
    let (sp, dp) = (gpu.ptr(src), gpu.ptr_mut(dst));
    check(dst.num_bytes() == bytes && bytes % 16 == 0 && sp % 16 == 0 && dp % 16 == 0, || {
        format!("copy of {bytes} bytes into {} (16-byte words and alignment needed)", dst.num_bytes())
    })?;
    let words = (bytes / 16) as u64;
    if words == 0 {
        return Ok(());
    }
    let grid = gpu.grid_for(words as usize, 256);
    gpu.launch(&gpu.fns.copy_words, cfg((grid, 1, 1), 256, 0), &[&sp, &dp, &words])
}

/// Fill `out` with values uniform in [-scale, scale), a pure function of (`seed`, index):
/// the weights of a synthetic model, made on the device.
pub fn random_uniform(gpu: &Gpu, out: &mut impl DevicePtrMut<bf16>, seed: u64, scale: f32) -> CudaResult<()> {
    let n = out.len() as u64;
    if n == 0 {
        return Ok(());
    }
    let op = gpu.ptr_mut(out);
    let grid = gpu.grid_for(n as usize, 256);
    gpu.launch(&gpu.fns.random_bf16, cfg((grid, 1, 1), 256, 0), &[&op, &n, &seed, &scale])
}

/// Most rows of x the skinny GEMM kernel takes (decode batches); more go to cuBLASLt.
pub const GEMV_MAX_ROWS: usize = 8;

/// `y[m, n] = x[m, k] · w[n, k]ᵀ (+ bias[n])`, bf16 in, f32 accumulate, bf16 or f32 out:
/// our skinny GEMM kernel for decode-sized m (≤ `GEMV_MAX_ROWS`, k a multiple of 8, a bias
/// only with bf16 output), cuBLASLt otherwise.
pub fn linear<O: GemmOutput>(
    gpu: &Gpu,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    bias: Option<&dyn DevicePtr<O>>,
    y: &mut impl DevicePtrMut<O>,
    (m, n, k): (usize, usize, usize),
) -> CudaResult<()> {
    let bf16_out = O::TYPE == cudarc::cublaslt::sys::cudaDataType::CUDA_R_16BF;
    let (xp, wp) = (gpu.ptr(x), gpu.ptr(w));
    let skinny = (1..=GEMV_MAX_ROWS).contains(&m) && n > 0 && k.is_multiple_of(8) && k > 0;
    if !skinny || (bias.is_some() && !bf16_out) || !xp.is_multiple_of(16) || !wp.is_multiple_of(16) {
        return gpu.blas.linear(x, w, bias, y, (m, n, k));
    }
    check(x.len() >= m * k && w.len() >= n * k && y.len() >= m * n && bias.is_none_or(|b| b.len() >= n), || {
        format!("linear m={m} n={n} k={k}: x {}, w {}, y {}", x.len(), w.len(), y.len())
    })?;
    let bp: u64 = bias.map_or(0, |b| gpu.ptr(b));
    let yp = gpu.ptr_mut(y);
    let f = if bf16_out { &gpu.fns.gemv_bf16[m - 1] } else { &gpu.fns.gemv_f32[m - 1] };
    let (n_i, k_i) = (n as i32, k as i32);
    // Blocks of 256 threads (GEMV_THREADS), each computing 4 output features (GEMV_ROWS).
    gpu.launch(f, cfg((n.div_ceil(4) as u32, 1, 1), 256, 0), &[&xp, &wp, &bp, &yp, &n_i, &k_i])
}

/// `y[m, n] = act(x·W_gateᵀ) * (x·W_upᵀ)`, bf16 out: a gated MLP's fused gate-up projection
/// (`w` of `[2n, k]`, the gate rows then the up rows) and its activation. For decode-sized m
/// the skinny GEMM applies the activation as its epilogue (the same bits as `linear` into
/// `gate_up` then `gated_activation`, one launch and no round trip of the gate-up output);
/// otherwise it is those two ops, with `gate_up` (at least m·2n values) between them.
#[allow(clippy::too_many_arguments)]
pub fn linear_gated(
    gpu: &Gpu,
    activation: GatedActivation,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    gate_up: &mut CudaSlice<bf16>,
    y: &mut impl DevicePtrMut<bf16>,
    (m, n, k): (usize, usize, usize),
) -> CudaResult<()> {
    let (xp, wp) = (gpu.ptr(x), gpu.ptr(w));
    let skinny = (1..=GEMV_MAX_ROWS).contains(&m) && n > 0 && k > 0 && k.is_multiple_of(8);
    if !skinny || !xp.is_multiple_of(16) || !wp.is_multiple_of(16) {
        linear::<bf16>(gpu, x, w, None, gate_up, (m, 2 * n, k))?;
        return gated_activation(gpu, activation, &*gate_up, &gate_up.slice(n..), (m, n, 2 * n), y);
    }
    check(x.len() >= m * k && w.len() >= 2 * n * k && y.len() >= m * n, || {
        format!("gated linear m={m} n={n} k={k}: x {}, w {}, y {}", x.len(), w.len(), y.len())
    })?;
    let f = match activation {
        GatedActivation::Silu => &gpu.fns.gemv_silu[m - 1],
        GatedActivation::GeluTanh => &gpu.fns.gemv_gelu[m - 1],
    };
    let yp = gpu.ptr_mut(y);
    let (n_i, k_i) = (n as i32, k as i32);
    // A block per 2 outputs: their gate and up rows are its 4 rows (GEMV_ROWS).
    gpu.launch(f, cfg((n.div_ceil(2) as u32, 1, 1), 256, 0), &[&xp, &wp, &yp, &n_i, &k_i])
}
