//! Gated DeltaNet on the device (kernels in `deltanet.cu`): a layer's recurrent states in
//! device memory (`DeviceStatePool`, one per state layer of a device KV cache, indexed by the
//! recurrent group's slot ids like the host `kv_state::StatePool`), a step's rows as the
//! kernels read them (`StateTable`: which slot each row reads and which it writes after which
//! token, `kv_state::state_rows`), and the ops the CPU's `cpu::gated_delta` mirrors: the
//! causal conv + SiLU continuing each row's window, the q/k L2 norm, the gates, the gated
//! delta rule, and the per-head output norm times `silu(z)`.
//!
//! The delta rule runs two ways, routed by row length on the host from the step's table: rows
//! of at least `DELTA_CHUNK_MIN_TOKENS` tokens (prefill) take the chunked scan
//! (`delta_chunk_k*`, listed in the table), shorter ones (decode, verify spans) the sequential
//! one-step kernel (`delta_rule_k*`, which skips the long rows).
//!
//! The step table is uploaded before a step, outside any CUDA graph, into buffers sized once,
//! so a decode step replays with the new step's slots and launches nothing else (a decode
//! step has no long row, so its graph holds the sequential kernel alone).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::batch::Padding;
use crate::cpu::gated_delta::DeltaShape;
use crate::cuda::context::{cfg, Gpu};
use crate::cuda::error::{CudaError, CudaResult};
use crate::error::{Result, RuntimeError};
use crate::kv_state::{check_rows, StateRow, StateSpec};

/// The widest key head the delta-rule kernels keep in registers.
pub const DELTA_MAX_K_DIM: usize = 128;
/// The most taps of the causal conv (`MAX_CONV_KERNEL` in `deltanet.cu`).
pub const DELTA_MAX_CONV_KERNEL: usize = 8;
/// The delta-rule kernels' register widths (`delta_rule_k{32,64,128}`).
pub(crate) const DELTA_K_DIMS: [usize; 3] = [32, 64, 128];

/// Ints a row takes in a `StateTable` (`ROW_FIELDS` in `deltanet.cu`).
const ROW_FIELDS: usize = 5;

/// Rows of at least this many tokens take the chunked scan, shorter ones the sequential
/// kernel. A chunk of the scan costs about what 9 sequential tokens do whatever its fill (the
/// estimate in `deltanet.cu`'s header), and verify spans (a handful of tokens, each a state
/// write) are far below it; decode rows (one token) never reach it.
pub const DELTA_CHUNK_MIN_TOKENS: usize = 16;
/// Tokens a chunk, value columns a block and threads a block of the chunked scan (`DC`,
/// `DBV`, `DC_THREADS` in `deltanet.cu`).
const CHUNK: usize = 32;
const CHUNK_COLS: usize = 32;
const CHUNK_THREADS: u32 = 256;

/// Dynamic shared memory of `delta_chunk_k{kmax}`, bytes: K and Q `[CHUNK][kmax + 1]`, the
/// state tile `[kmax][CHUNK_COLS]`, A and P `[CHUNK][CHUNK + 1]`, R and O `[CHUNK][CHUNK_COLS]`,
/// and two gate vectors (the layout in `delta_chunk`).
pub(crate) fn delta_chunk_shared(kmax: usize) -> usize {
    4 * (2 * CHUNK * (kmax + 1) + kmax * CHUNK_COLS + 2 * CHUNK * (CHUNK + 1) + 2 * CHUNK * CHUNK_COLS + 2 * CHUNK)
}

fn check(ok: bool, what: impl FnOnce() -> String) -> CudaResult<()> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape(what()))
    }
}

/// One layer's recurrent states on the device, one per slot: the conv windows
/// `[slot][conv_kernel − 1][channels]` and the matrices `[slot][heads][k_dim][v_dim]`, f32.
pub struct DeviceStatePool {
    pub spec: StateSpec,
    pub conv: CudaSlice<f32>,
    pub ssm: CudaSlice<f32>,
    slots: usize,
}

impl DeviceStatePool {
    /// `slots` zero states.
    pub fn zeroed(gpu: &Gpu, spec: StateSpec, slots: usize) -> CudaResult<DeviceStatePool> {
        check(spec.conv_kernel <= DELTA_MAX_CONV_KERNEL && spec.k_dim <= DELTA_MAX_K_DIM, || {
            format!(
                "a recurrent state of {} conv taps and key heads of {} (the CUDA kernels take up to \
                 {DELTA_MAX_CONV_KERNEL} taps and {DELTA_MAX_K_DIM})",
                spec.conv_kernel, spec.k_dim
            )
        })?;
        Ok(DeviceStatePool {
            spec,
            conv: gpu.alloc((slots * spec.conv_values()).max(1))?,
            ssm: gpu.alloc((slots * spec.ssm_values()).max(1))?,
            slots,
        })
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Device bytes of the pool.
    pub fn bytes(&self) -> usize {
        self.slots * self.spec.slot_bytes()
    }
}

/// A step's rows as the kernels read them: per row `[first token, tokens, read slot (−1:
/// none), first write, end of writes]`, the writes as `(n, slot)` pairs, each token's row, and
/// the rows of at least `chunk_min` tokens (the chunked scan's).
pub struct StateTable {
    rows: CudaSlice<i32>,
    writes: CudaSlice<i32>,
    tok_row: CudaSlice<i32>,
    chunked: CudaSlice<i32>,
    /// The uploaded step's rows, tokens (padding included) and long rows.
    n_rows: usize,
    tokens: usize,
    n_chunked: usize,
    chunk_min: usize,
}

impl StateTable {
    /// Room for steps of up to `tokens` tokens (a row has one at least; a token ends at most
    /// two writes: a verify span's slot and its table entry's).
    pub fn new(gpu: &Gpu, tokens: usize) -> CudaResult<StateTable> {
        let tokens = tokens.max(1);
        Ok(StateTable {
            rows: gpu.alloc(tokens * ROW_FIELDS)?,
            writes: gpu.alloc(2 * 2 * tokens)?,
            tok_row: gpu.alloc(tokens)?,
            chunked: gpu.alloc(tokens.div_ceil(DELTA_CHUNK_MIN_TOKENS))?,
            n_rows: 0,
            tokens: 0,
            n_chunked: 0,
            chunk_min: DELTA_CHUNK_MIN_TOKENS,
        })
    }

    /// Route rows of at least `tokens` tokens (1 or more) to the chunked scan from the next
    /// upload on, instead of `DELTA_CHUNK_MIN_TOKENS`: the tests run the same rows through
    /// either kernel (`usize::MAX`: the sequential one alone). A table routing rows shorter
    /// than `DELTA_CHUNK_MIN_TOKENS` keeps a list as long as its rows.
    pub fn set_chunk_min(&mut self, gpu: &Gpu, tokens: usize) -> CudaResult<()> {
        let tokens = tokens.max(1);
        let need = self.tok_row.len().div_ceil(tokens.min(self.tok_row.len()));
        if need > self.chunked.len() {
            self.chunked = gpu.alloc(need)?;
        }
        self.chunk_min = tokens;
        Ok(())
    }

    /// Queue the upload of `rows` (checked against pools of `slots` slots), followed by rows
    /// of `pad.query` tokens that read and write nothing up to `pad.rows` rows (a graph's
    /// bucket). The rows must cover the step's tokens in order.
    pub fn upload(&mut self, gpu: &Gpu, rows: &[StateRow], pad: Padding, slots: usize) -> Result<()> {
        let pad_rows = pad.rows;
        check_rows(slots, rows)?;
        let mut table = Vec::with_capacity(ROW_FIELDS * pad_rows.max(rows.len()));
        let (mut writes, mut tok_row, mut chunked) = (Vec::new(), Vec::new(), Vec::new());
        for (r, row) in rows.iter().enumerate() {
            if row.tokens.is_empty() && row.writes.is_empty() {
                // A row of no query tokens reads and writes nothing.
                continue;
            }
            if row.tokens.start != tok_row.len() || row.tokens.is_empty() {
                return Err(RuntimeError::Shape(format!(
                    "state row {r} covers tokens {:?} after {} tokens",
                    row.tokens,
                    tok_row.len()
                )));
            }
            let first = writes.len() / 2;
            for &(n, slot) in &row.writes {
                if n == 0 || n > row.tokens.len() {
                    return Err(RuntimeError::Shape(format!("state row {r} writes after {n} of its tokens")));
                }
                writes.extend([n as i32, slot as i32]);
            }
            let (read, index) = (row.read.map_or(-1, |s| s as i32), (table.len() / ROW_FIELDS) as i32);
            table.extend([
                row.tokens.start as i32,
                row.tokens.len() as i32,
                read,
                first as i32,
                (writes.len() / 2) as i32,
            ]);
            tok_row.extend(std::iter::repeat_n(index, row.tokens.len()));
            if row.tokens.len() >= self.chunk_min {
                chunked.push(index);
            }
        }
        for _ in rows.len()..pad_rows {
            let (index, start, w) = (table.len() / ROW_FIELDS, tok_row.len(), writes.len() / 2);
            table.extend([start as i32, pad.query as i32, -1, w as i32, w as i32]);
            tok_row.extend(std::iter::repeat_n(index as i32, pad.query));
            if pad.query >= self.chunk_min {
                chunked.push(index as i32);
            }
        }
        if table.len() > self.rows.len() || writes.len() > self.writes.len() || tok_row.len() > self.tok_row.len() {
            return Err(RuntimeError::Shape(format!(
                "a step of {} state rows, {} tokens and {} writes outgrows its table",
                table.len() / ROW_FIELDS,
                tok_row.len(),
                writes.len() / 2
            )));
        }
        gpu.upload_into(&table, &mut self.rows)?;
        gpu.upload_into(&tok_row, &mut self.tok_row)?;
        if !writes.is_empty() {
            gpu.upload_into(&writes, &mut self.writes)?;
        }
        if !chunked.is_empty() {
            gpu.upload_into(&chunked, &mut self.chunked)?;
        }
        (self.n_rows, self.tokens, self.n_chunked) = (table.len() / ROW_FIELDS, tok_row.len(), chunked.len());
        Ok(())
    }

    /// The uploaded step's tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

/// The causal depthwise conv + SiLU of the step's tokens: `x` holds each token's conv inputs
/// at the start of a row of `x_stride` values, `weight` is `[kernel][channels]`; `out`
/// (`[tokens, channels]`) gets the outputs and each write of a row its window.
pub fn delta_conv(
    gpu: &Gpu,
    x: &impl DevicePtr<f32>,
    x_stride: usize,
    weight: &impl DevicePtr<f32>,
    table: &StateTable,
    pool: &mut DeviceStatePool,
    out: &mut impl DevicePtrMut<f32>,
) -> CudaResult<()> {
    let (c, kernel, t) = (pool.spec.conv_channels, pool.spec.conv_kernel, table.tokens);
    check(
        kernel >= 1 && x_stride >= c && x.len() >= t * x_stride && weight.len() >= kernel * c && out.len() >= t * c,
        || format!("delta_conv of {t} tokens, {c} channels, {kernel} taps: x {} stride {x_stride}", x.len()),
    )?;
    if t == 0 {
        return Ok(());
    }
    let (xp, wp, rp, tp, sp, wrp) = (
        gpu.ptr(x),
        gpu.ptr(weight),
        gpu.ptr(&table.rows),
        gpu.ptr(&table.tok_row),
        gpu.ptr_mut(&mut pool.conv),
        gpu.ptr(&table.writes),
    );
    let op = gpu.ptr_mut(out);
    let [xs, ci, ki, ti] = [x_stride, c, kernel, t].map(|v| v as i32);
    gpu.launch(
        &gpu.fns.delta_conv,
        cfg((gpu.grid_for(t * c, 256), 1, 1), 256, 0),
        &[&xp, &xs, &wp, &ci, &ki, &rp, &tp, &sp, &op, &ti],
    )?;
    gpu.launch(
        &gpu.fns.delta_conv_state,
        cfg((c.div_ceil(128) as u32, table.n_rows as u32, 1), 128, 0),
        &[&xp, &xs, &ci, &ki, &rp, &wrp, &sp],
    )
}

/// L2-normalize each q and k head of the step's conv outputs in place: rows of `stride`
/// values holding `k_heads` q heads then `k_heads` k heads of `k_dim`; q also times `q_scale`.
pub fn delta_qk_norm(
    gpu: &Gpu,
    x: &mut impl DevicePtrMut<f32>,
    (tokens, stride): (usize, usize),
    (k_heads, k_dim): (usize, usize),
    q_scale: f32,
    eps: f32,
) -> CudaResult<()> {
    let need = if tokens == 0 { 0 } else { (tokens - 1) * stride + 2 * k_heads * k_dim };
    check(x.len() >= need && stride >= 2 * k_heads * k_dim, || {
        format!("delta_qk_norm of {tokens} tokens, {k_heads} heads of {k_dim}: x {} stride {stride}", x.len())
    })?;
    if tokens == 0 || k_heads * k_dim == 0 {
        return Ok(());
    }
    let xp = gpu.ptr_mut(x);
    let [st, kh, kd] = [stride, k_heads, k_dim].map(|v| v as i32);
    gpu.launch(
        &gpu.fns.delta_qk_norm,
        cfg((tokens as u32, 2 * k_heads as u32, 1), 32, 0),
        &[&xp, &st, &kh, &kd, &q_scale, &eps],
    )
}

/// `beta = sigmoid(b)` and `g = neg_rate · softplus(a + dt_bias)` (`[tokens, v_heads]` each)
/// from rows of `stride` values of `proj` with `b` at `b_off` and `a` at `a_off`.
#[allow(clippy::too_many_arguments)]
pub fn delta_gates(
    gpu: &Gpu,
    proj: &impl DevicePtr<f32>,
    (tokens, stride, b_off, a_off): (usize, usize, usize, usize),
    neg_rate: &impl DevicePtr<f32>,
    dt_bias: &impl DevicePtr<f32>,
    beta: &mut impl DevicePtrMut<f32>,
    g: &mut impl DevicePtrMut<f32>,
) -> CudaResult<()> {
    let nv = neg_rate.len();
    let need = if tokens == 0 { 0 } else { (tokens - 1) * stride + b_off.max(a_off) + nv };
    check(
        proj.len() >= need
            && b_off.max(a_off) + nv <= stride
            && dt_bias.len() >= nv
            && beta.len() >= tokens * nv
            && g.len() >= tokens * nv,
        || format!("delta_gates of {tokens} tokens, {nv} heads: proj {} stride {stride}", proj.len()),
    )?;
    if tokens * nv == 0 {
        return Ok(());
    }
    let (pp, np, dp, bp, gp) = (gpu.ptr(proj), gpu.ptr(neg_rate), gpu.ptr(dt_bias), gpu.ptr_mut(beta), gpu.ptr_mut(g));
    let [st, bo, ao, nvi, ti] = [stride, b_off, a_off, nv, tokens].map(|v| v as i32);
    gpu.launch(
        &gpu.fns.delta_gates,
        cfg((gpu.grid_for(tokens * nv, 256), 1, 1), 256, 0),
        &[&pp, &st, &bo, &ao, &np, &dp, &nvi, &ti, &bp, &gp],
    )
}

/// The gated delta rule over the step's rows: `qkv` rows of `stride` values hold q (`k_heads ·
/// k_dim`, normalized), k (the same) and v (`v_heads · v_dim`) in turn; `g`, `beta` are
/// `[tokens, v_heads]`; `out` gets `[tokens, v_heads · v_dim]`. Each row starts from its read
/// slot's matrices and stores them after the token counts its writes name. The table's long
/// rows take the chunked scan (equal to the sequential kernel to f32 rounding), unless the
/// device cannot give its blocks their shared memory; the rest the sequential kernel.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule(
    gpu: &Gpu,
    qkv: &impl DevicePtr<f32>,
    stride: usize,
    g: &impl DevicePtr<f32>,
    beta: &impl DevicePtr<f32>,
    shape: &DeltaShape,
    table: &StateTable,
    pool: &mut DeviceStatePool,
    out: &mut impl DevicePtrMut<f32>,
) -> CudaResult<()> {
    let DeltaShape { k_heads, v_heads, k_dim, v_dim, tiled } = *shape;
    let t = table.tokens;
    let (kd, vd) = (k_heads * k_dim, v_heads * v_dim);
    let spec = pool.spec;
    let kernel = DELTA_K_DIMS.iter().position(|&k| k >= k_dim);
    check(
        k_heads > 0
            && v_heads.is_multiple_of(k_heads)
            && (spec.heads, spec.k_dim, spec.v_dim) == (v_heads, k_dim, v_dim)
            && kernel.is_some()
            && stride >= 2 * kd + vd
            && qkv.len() >= t * stride
            && g.len() >= t * v_heads
            && beta.len() >= t * v_heads
            && out.len() >= t * vd,
        || {
            format!(
                "delta_rule of {t} tokens, {shape:?} (state {}x{}x{}): qkv {} stride {stride}, out {}",
                spec.heads,
                spec.k_dim,
                spec.v_dim,
                qkv.len(),
                out.len()
            )
        },
    )?;
    let Some(kernel) = kernel.filter(|_| t > 0 && v_dim > 0) else { return Ok(()) };
    let base = gpu.ptr(qkv);
    let (qp, kp, vp) = (base, base + 4 * kd as u64, base + 8 * kd as u64);
    let (gp, bp, rp, wp) = (gpu.ptr(g), gpu.ptr(beta), gpu.ptr(&table.rows), gpu.ptr(&table.writes));
    let (sp, op) = (gpu.ptr_mut(&mut pool.ssm), gpu.ptr_mut(out));
    let [st, khi, nvi, kdi, vdi, ti] = [stride, k_heads, v_heads, k_dim, v_dim, usize::from(tiled)].map(|v| v as i32);
    let shared = delta_chunk_shared(DELTA_K_DIMS[kernel]);
    let chunked = table.n_chunked > 0 && shared <= gpu.info().max_shared_per_block;
    // The sequential kernel skips rows of `chunk_min` tokens or more: all of them its own
    // when the chunked scan cannot run.
    let chunk_min = if chunked { table.chunk_min.min(i32::MAX as usize) as i32 } else { i32::MAX };
    if !chunked || table.n_chunked < table.n_rows {
        gpu.launch(
            &gpu.fns.delta_rule[kernel],
            cfg((table.n_rows as u32, v_heads as u32, v_dim.div_ceil(32) as u32), 32, 0),
            &[&qp, &kp, &st, &vp, &st, &gp, &bp, &khi, &nvi, &kdi, &vdi, &ti, &rp, &wp, &chunk_min, &sp, &op],
        )?;
    }
    if chunked {
        let cp = gpu.ptr(&table.chunked);
        let grid = (table.n_chunked as u32, v_heads as u32, v_dim.div_ceil(CHUNK_COLS) as u32);
        gpu.launch(
            &gpu.fns.delta_chunk[kernel],
            cfg(grid, CHUNK_THREADS, shared),
            &[&qp, &kp, &st, &vp, &st, &gp, &bp, &khi, &nvi, &kdi, &vdi, &ti, &rp, &wp, &cp, &sp, &op],
        )?;
    }
    Ok(())
}

/// `out = silu(z) · rmsnorm(o) · weight` per value head: `o` is `[tokens, v_heads · v_dim]`,
/// `z` rows of `z_stride` values, `weight` `[v_dim]`; bf16 out (the output projection's input).
#[allow(clippy::too_many_arguments)]
pub fn delta_out_norm(
    gpu: &Gpu,
    o: &impl DevicePtr<f32>,
    z: &impl DevicePtr<f32>,
    z_stride: usize,
    weight: &impl DevicePtr<f32>,
    (tokens, v_heads, v_dim): (usize, usize, usize),
    eps: f32,
    out: &mut impl DevicePtrMut<bf16>,
) -> CudaResult<()> {
    let vd = v_heads * v_dim;
    let need = if tokens == 0 { 0 } else { (tokens - 1) * z_stride + vd };
    check(
        o.len() >= tokens * vd
            && z.len() >= need
            && z_stride >= vd
            && weight.len() >= v_dim
            && out.len() >= tokens * vd,
        || format!("delta_out_norm of {tokens} tokens, {v_heads} heads of {v_dim}: o {} z {}", o.len(), z.len()),
    )?;
    if tokens * vd == 0 {
        return Ok(());
    }
    let (opp, zp, wp, outp) = (gpu.ptr(o), gpu.ptr(z), gpu.ptr(weight), gpu.ptr_mut(out));
    let [zs, nvi, vdi] = [z_stride, v_heads, v_dim].map(|v| v as i32);
    gpu.launch(
        &gpu.fns.delta_out_norm,
        cfg((tokens as u32, v_heads as u32, 1), 32, 0),
        &[&opp, &zp, &zs, &wp, &nvi, &vdi, &eps, &outp],
    )
}
