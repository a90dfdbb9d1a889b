//! Paged attention on the device: the per-step metadata, the KV write, decode attention
//! (split-K, merged in the same launch) and variable-length prefill attention (tensor cores).
//!
//! A step's `ForwardBatch` becomes one `AttentionMeta` per KV group — block tables, context
//! lengths, query spans, the slot of every new token and the prefill tile list — uploaded
//! once and read by every layer of the group. `attention` runs the decode kernel when every
//! row has one query token and the prefill kernel otherwise; both take the CPU op's
//! `AttentionParams` (GQA, sliding window, softcap) and read the cache layout
//! `[block][kv_head][slot][head_dim]` in the pools' format (`kv_pool`: bf16, or int8 / int4
//! / fp8 codes dequantized as they are loaded, by the kernel instantiated for that format).

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::batch::{ForwardBatch, Padding, NO_BLOCK};
use crate::cpu::AttentionParams;
use crate::cuda::context::{cfg, Gpu};
use crate::cuda::error::{CudaError, CudaResult};
use crate::cuda::functions::head_dim_index;
use crate::cuda::ops::gemma::{qkv_norm, QkvHeads};
use crate::cuda::ops::kv_pool::{DeviceKv, KvArgs};

/// Query tokens per prefill tile (the kernel's BM), and threads of both kernels.
const PREFILL_TILE: usize = 64;
const THREADS: u32 = 128;
/// The decode kernel's warps (DEC_WARPS).
const DEC_WARPS: usize = 4;
/// The longest partition a decode plan makes (longer ones only cost parallelism).
const MAX_PARTITION: usize = 512;

/// Query heads one decode CTA takes (the kernel's GC) for a GQA group of `group` heads.
fn heads_per_cta(group: usize) -> usize {
    if group <= 4 {
        4
    } else {
        8
    }
}

/// Keys a decode CTA reads per round (every lane group one load of K and V in flight per
/// key it takes): DEC_WARPS × keys per warp load (32 lanes / (head_dim / 8)) ×
/// DEC_UNROLL(GC), the same for every KV format.
fn keys_per_round(head_dim: usize, gc: usize) -> usize {
    let unroll = if gc <= 4 { 4 } else { 2 };
    DEC_WARPS * (256 / head_dim).max(1) * unroll
}

/// A step's attention metadata for one KV group, on the device.
///
/// The arrays travel as one buffer in one copy: context lengths, query starts, slots,
/// prefill tiles, then block tables, each starting where the one before ends for this step's
/// shape. The buffer keeps its address from one step to the next (`update` copies into it),
/// and a step's offsets depend only on its (rows, tokens, table stride, tiles), so a CUDA
/// graph captured over a step replays over the next step of the same shape.
pub struct AttentionMeta {
    pub rows: usize,
    pub tokens: usize,
    /// Longest context of any row (sizes the decode split).
    pub max_context: usize,
    /// Most query tokens of any row (1: a pure decode step).
    pub max_query: usize,
    block_size: usize,
    bt_stride: usize,
    packed: CudaSlice<i32>,
    n_tiles: usize,
}

/// Where each array of a step sits in `AttentionMeta::packed`: (offset, length).
#[derive(Debug, Clone, Copy)]
struct Regions {
    context_lens: (usize, usize),
    query_start: (usize, usize),
    slot_mapping: (usize, usize),
    tiles: (usize, usize),
    block_tables: (usize, usize),
}

impl Regions {
    fn new(rows: usize, tokens: usize, bt_stride: usize, n_tiles: usize) -> Regions {
        let lens = [rows, rows + 1, tokens, 2 * n_tiles, rows * bt_stride];
        let mut at = 0;
        let [c, q, s, t, b] = lens.map(|n| {
            at += n;
            (at - n, n)
        });
        Regions { context_lens: c, query_start: q, slot_mapping: s, tiles: t, block_tables: b }
    }

    fn end(&self) -> usize {
        self.block_tables.0 + self.block_tables.1
    }
}

/// The host side of `AttentionMeta` before it is copied to the device.
struct HostMeta {
    max_context: usize,
    max_query: usize,
    bt_stride: usize,
    block_tables: Vec<i32>,
    context_lens: Vec<i32>,
    query_start: Vec<i32>,
    slot_mapping: Vec<i32>,
    tiles: Vec<i32>,
}

impl HostMeta {
    /// `batch`'s metadata for `group`; block tables padded to `stride` entries when given,
    /// and the empty rows of `pad` appended (context 0, no slot: a graph's bucket padding,
    /// whose outputs are zeros — every key past the row's context is masked — and whose keys
    /// are never stored).
    fn build(
        batch: &ForwardBatch,
        group: usize,
        block_size: usize,
        stride: Option<usize>,
        pad: Padding,
    ) -> CudaResult<HostMeta> {
        let (pad_rows, pad_query) = (pad.extra_rows(batch), pad.query);
        let rows = batch.rows.len();
        let tokens = batch.num_tokens();
        if rows == 0 || tokens == 0 || block_size == 0 || batch.positions.len() != tokens {
            return Err(CudaError::Shape(format!(
                "attention metadata: {rows} rows, {tokens} tokens, block size {block_size}"
            )));
        }
        let tables: Vec<&[u32]> = batch
            .rows
            .iter()
            .map(|r| r.block_tables.get(group).map(Vec::as_slice))
            .collect::<Option<_>>()
            .ok_or_else(|| CudaError::Shape(format!("a row has no block table for KV group {group}")))?;
        let longest = tables.iter().map(|t| t.len()).max().unwrap_or(0).max(1);
        let bt_stride = match stride {
            Some(s) if s < longest => {
                return Err(CudaError::Shape(format!("a block table of {longest} blocks exceeds the {s} planned")))
            }
            Some(s) => s,
            None => longest,
        };
        let mut block_tables = vec![-1i32; (rows + pad_rows) * bt_stride];
        for (dst, t) in block_tables.chunks_exact_mut(bt_stride).zip(&tables) {
            for (d, &b) in dst.iter_mut().zip(t.iter()) {
                *d = if b == NO_BLOCK { -1 } else { b as i32 };
            }
        }
        let mut query_start = Vec::with_capacity(rows + 1);
        let mut slot_mapping = vec![-1i32; tokens];
        let mut tiles = Vec::new();
        let mut next = 0;
        for (r, (row, table)) in batch.rows.iter().zip(&tables).enumerate() {
            let end = row.query_start + row.query_len;
            // Rows are packed in order: each starts where the previous one ended.
            if row.query_start != next || end > tokens || row.context_len < row.query_len {
                return Err(CudaError::Shape(format!(
                    "row {r} spans tokens {}..{end} with context {}",
                    row.query_start, row.context_len
                )));
            }
            query_start.push(row.query_start as i32);
            next = end;
            for (slot, &pos) in
                slot_mapping[row.query_start..end].iter_mut().zip(&batch.positions[row.query_start..end])
            {
                let pos = pos as usize;
                match table.get(pos / block_size) {
                    Some(&b) if b != NO_BLOCK => *slot = (b as usize * block_size + pos % block_size) as i32,
                    _ => return Err(CudaError::Shape(format!("position {pos} of row {r} has no cache block"))),
                }
            }
            for t0 in (0..row.query_len).step_by(PREFILL_TILE) {
                tiles.extend([r as i32, t0 as i32]);
            }
        }
        let pad_tokens = pad_rows * pad_query;
        query_start.extend((0..pad_rows).map(|i| (tokens + i * pad_query) as i32));
        slot_mapping.resize(tokens + pad_tokens, -1);
        for i in 0..pad_rows {
            tiles.extend((0..pad_query).step_by(PREFILL_TILE).flat_map(|t0| [(rows + i) as i32, t0 as i32]));
        }
        query_start.push((tokens + pad_tokens) as i32);
        let mut context_lens: Vec<i32> = batch.rows.iter().map(|r| r.context_len as i32).collect();
        context_lens.resize(rows + pad_rows, 0);
        Ok(HostMeta {
            max_context: batch.rows.iter().map(|r| r.context_len).max().unwrap_or(0),
            max_query: batch.rows.iter().map(|r| r.query_len).max().unwrap_or(0),
            bt_stride,
            block_tables,
            context_lens,
            query_start,
            slot_mapping,
            tiles,
        })
    }
}

impl AttentionMeta {
    fn regions(&self) -> Regions {
        Regions::new(self.rows, self.tokens, self.bt_stride, self.n_tiles)
    }

    fn view(&self, (at, len): (usize, usize)) -> CudaView<'_, i32> {
        self.packed.slice(at..at + len)
    }

    /// The cache slot of each query token (negative: none) and the block size it counts in,
    /// for kernels that store keys besides `write_kv`.
    pub(crate) fn slots(&self) -> (CudaView<'_, i32>, usize) {
        (self.view(self.regions().slot_mapping), self.block_size)
    }

    /// Build and upload the metadata of `batch` for KV group `group` with `block_size`.
    pub fn upload(gpu: &Gpu, batch: &ForwardBatch, group: usize, block_size: usize) -> CudaResult<AttentionMeta> {
        let h = HostMeta::build(batch, group, block_size, None, Padding::none(batch))?;
        let mut meta = AttentionMeta::with_capacity(gpu, batch.rows.len(), batch.num_tokens(), h.bt_stride)?;
        meta.block_size = block_size;
        meta.store(gpu, h, batch.rows.len(), batch.num_tokens())?;
        Ok(meta)
    }

    /// Room for steps of up to `rows` rows and `tokens` tokens whose block tables have up to
    /// `bt_stride` entries.
    pub fn with_capacity(gpu: &Gpu, rows: usize, tokens: usize, bt_stride: usize) -> CudaResult<AttentionMeta> {
        let (rows, tokens, bt_stride) = (rows.max(1), tokens.max(1), bt_stride.max(1));
        let most = Regions::new(rows, tokens, bt_stride, rows + tokens.div_ceil(PREFILL_TILE));
        Ok(AttentionMeta {
            rows: 0,
            tokens: 0,
            max_context: 0,
            max_query: 0,
            block_size: 0,
            bt_stride,
            packed: gpu.alloc(most.end())?,
            n_tiles: 0,
        })
    }

    /// Copy the metadata of `batch` into this buffer (an error when it does not fit),
    /// padded with `pad`'s empty rows (see `HostMeta::build`), block tables `stride` entries
    /// apart when given (what a captured graph was built with), else as long as the longest.
    pub fn update(
        &mut self,
        gpu: &Gpu,
        batch: &ForwardBatch,
        group: usize,
        block_size: usize,
        pad: Padding,
        stride: Option<usize>,
    ) -> CudaResult<()> {
        let h = HostMeta::build(batch, group, block_size, stride, pad)?;
        self.block_size = block_size;
        self.store(gpu, h, batch.rows.len() + pad.extra_rows(batch), pad.tokens(batch))
    }

    fn store(&mut self, gpu: &Gpu, h: HostMeta, rows: usize, tokens: usize) -> CudaResult<()> {
        let n_tiles = h.tiles.len() / 2;
        let r = Regions::new(rows, tokens, h.bt_stride, n_tiles);
        if r.end() > self.packed.len() {
            return Err(CudaError::Shape(format!(
                "attention metadata of {rows} rows, {tokens} tokens, {} table entries exceeds its buffer",
                h.block_tables.len()
            )));
        }
        let mut host = Vec::with_capacity(r.end());
        for part in [&h.context_lens, &h.query_start, &h.slot_mapping, &h.tiles, &h.block_tables] {
            host.extend_from_slice(part);
        }
        debug_assert_eq!(host.len(), r.end());
        gpu.upload_into(&host, &mut self.packed)?;
        self.rows = rows;
        self.tokens = tokens;
        self.max_context = h.max_context;
        self.max_query = h.max_query;
        self.bt_stride = h.bt_stride;
        self.n_tiles = n_tiles;
        Ok(())
    }
}

fn check_cache(kv: &DeviceKv, meta: &AttentionMeta, p: &AttentionParams) -> CudaResult<()> {
    if kv.block_size != meta.block_size
        || kv.n_kv_heads != p.n_kv_heads
        || kv.head_dim != p.head_dim
        || !kv.sized()
        || p.n_kv_heads == 0
        || !p.n_heads.is_multiple_of(p.n_kv_heads)
    {
        return Err(CudaError::Shape(format!(
            "attention {}/{} heads x {} vs cache of {} KV heads x {}, block size {} (meta {})",
            p.n_heads, p.n_kv_heads, p.head_dim, kv.n_kv_heads, kv.head_dim, kv.block_size, meta.block_size
        )));
    }
    Ok(())
}

/// How a decode step splits each row's keys: partitions of `partition` keys, at most
/// `splits` of them (the split-K grid depth).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodePlan {
    pub partition: usize,
    pub splits: usize,
}

impl DecodePlan {
    /// Enough CTAs to give every SM two, in partitions of whole rounds of the kernel (at
    /// most `MAX_PARTITION` keys). `max_context` bounds every row's context.
    pub fn new(gpu: &Gpu, rows: usize, p: &AttentionParams, max_context: usize) -> DecodePlan {
        let visible = p.window.map_or(max_context, |w| w.min(max_context)).max(1);
        let group = (p.n_heads / p.n_kv_heads.max(1)).max(1);
        let gc = heads_per_cta(group);
        let round = keys_per_round(p.head_dim, gc);
        let ctas = (rows * p.n_kv_heads * group.div_ceil(gc)).max(1);
        let want_splits = (2 * gpu.info().multiprocessors).div_ceil(ctas).max(1);
        let partition = visible.div_ceil(want_splits).next_multiple_of(round).clamp(round, MAX_PARTITION.max(round));
        DecodePlan { partition, splits: visible.div_ceil(partition) }
    }

    fn shared_bytes(&self, p: &AttentionParams, block_size: usize) -> usize {
        let gc = heads_per_cta(p.n_heads / p.n_kv_heads);
        let blocks = self.partition / block_size + 2;
        // q, the warps' outputs and (max, sum), the merge flag, the block ids, then the
        // merge's per-partition (max, sum) and each head's total.
        let merge = 2 * gc * self.splits + gc;
        4 * (gc * p.head_dim + DEC_WARPS * gc * p.head_dim + DEC_WARPS * gc * 2 + 1 + blocks + merge)
    }
}

/// Split-K partial results of a decode step (reused across steps and layers), and the
/// counters by which the last partition of each (row, head chunk) finds itself; the kernel
/// leaves them at zero.
pub struct DecodeScratch {
    out: CudaSlice<f32>,
    ml: CudaSlice<f32>,
    counters: CudaSlice<i32>,
}

impl DecodeScratch {
    pub fn new(gpu: &Gpu, rows: usize, n_heads: usize, head_dim: usize, splits: usize) -> CudaResult<DecodeScratch> {
        let n = (rows * n_heads * splits).max(1);
        // A head chunk has at least one head: rows × n_heads counters cover every chunk.
        let counters = gpu.alloc((rows * n_heads).max(1))?;
        Ok(DecodeScratch { out: gpu.alloc(n * head_dim)?, ml: gpu.alloc(2 * n)?, counters })
    }

    /// Whether a decode step of `rows` rows of `n_heads` heads in `splits` splits fits.
    pub fn fits(&self, rows: usize, n_heads: usize, head_dim: usize, splits: usize) -> bool {
        let n = rows * n_heads * splits;
        self.out.len() >= n * head_dim && self.ml.len() >= 2 * n && self.counters.len() >= rows * n_heads
    }
}

/// Attention of the step's queries (`[tokens, n_heads * head_dim]` rows of `q_stride`
/// values) over the cache into `out` (rows of `out_stride`): the decode kernel when every
/// row has one query token (planned by `plan`, or by `DecodePlan::new` when None), else the
/// prefill kernel.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    gpu: &Gpu,
    q: &impl DevicePtr<bf16>,
    q_stride: usize,
    meta: &AttentionMeta,
    kv: &DeviceKv,
    p: &AttentionParams,
    plan: Option<DecodePlan>,
    scratch: &mut DecodeScratch,
    out: &mut impl DevicePtrMut<bf16>,
    out_stride: usize,
) -> CudaResult<()> {
    check_cache(kv, meta, p)?;
    let width = p.n_heads * p.head_dim;
    let span = |stride: usize| (meta.tokens - 1) * stride + width;
    if q_stride < width || out_stride < width || q.len() < span(q_stride) || out.len() < span(out_stride) {
        return Err(CudaError::Shape(format!(
            "attention: q {} / out {} for {} tokens of {width}",
            q.len(),
            out.len(),
            meta.tokens
        )));
    }
    let hd = head_dim_index(p.head_dim)?;
    let (qp, op) = (gpu.ptr(q), gpu.ptr_mut(out));
    // The prefill kernel reads query rows as 16-byte words and writes bf16 pairs.
    if !qp.is_multiple_of(16) || !q_stride.is_multiple_of(8) || !op.is_multiple_of(4) || !out_stride.is_multiple_of(2) {
        return Err(CudaError::Shape(format!(
            "attention: q (stride {q_stride}) must be 16-byte aligned, out (stride {out_stride}) 4-byte"
        )));
    }
    let c = kv.args(gpu);
    let f = kv.format();
    if meta.max_query <= 1 && meta.tokens == meta.rows {
        let plan = plan.unwrap_or_else(|| DecodePlan::new(gpu, meta.rows, p, meta.max_context));
        return launch_decode(gpu, (qp, q_stride), meta, (&c, f), p, plan, scratch, (op, out_stride), NOTHING_FOLDED);
    }
    let a = KernelArgs::new(gpu, meta, p, q_stride, out_stride);
    let r = meta.regions();
    let (qsp, tp) = (gpu.ptr(&meta.view(r.query_start)), gpu.ptr(&meta.view(r.tiles)));
    let shared = (PREFILL_TILE + 2 * 64) * (p.head_dim + 8) * 2;
    gpu.launch(
        &gpu.fns.prefill_attention[f][hd],
        cfg((meta.n_tiles as u32, p.n_heads as u32, 1), THREADS, shared),
        &[
            &op,
            &a.os,
            &qp,
            &a.qs,
            &c.k,
            &c.v,
            &c.k_params,
            &c.v_params,
            &c.shift,
            &a.bt,
            &a.bts,
            &qsp,
            &a.cl,
            &tp,
            &a.nh,
            &a.nkv,
            &a.bs,
            &p.scale,
            &a.softcap,
            &a.window,
        ],
    )
}

/// What both attention kernels take besides their buffers: the block tables and context
/// lengths of `meta`, the query and output strides, the table stride, head counts, block
/// size, softcap (0: none) and window (0: none), as the kernels' argument types.
struct KernelArgs {
    bt: u64,
    cl: u64,
    qs: i32,
    os: i32,
    bts: i32,
    nh: i32,
    nkv: i32,
    bs: i32,
    softcap: f32,
    window: i32,
}

impl KernelArgs {
    fn new(gpu: &Gpu, meta: &AttentionMeta, p: &AttentionParams, q_stride: usize, out_stride: usize) -> KernelArgs {
        let r = meta.regions();
        let [qs, os, bts, nh, nkv, bs] =
            [q_stride, out_stride, meta.bt_stride, p.n_heads, p.n_kv_heads, meta.block_size].map(|x| x as i32);
        KernelArgs {
            bt: gpu.ptr(&meta.view(r.block_tables)),
            cl: gpu.ptr(&meta.view(r.context_lens)),
            qs,
            os,
            bts,
            nh,
            nkv,
            bs,
            softcap: p.softcap.unwrap_or(0.0),
            window: p.window.map_or(0, |w| w as i32),
        }
    }
}

/// What a decode launch does to its queries and new keys itself: RoPE (inv_freq's address,
/// pairs, scaling, offset of the key heads in a query row) and per-head q/k RMSNorms (the
/// weights' addresses, eps); null addresses for none.
#[derive(Debug, Clone, Copy)]
struct Folded {
    inv_freq: u64,
    half: i32,
    scaling: f32,
    k_offset: i32,
    q_norm: u64,
    k_norm: u64,
    eps: f32,
}

const NOTHING_FOLDED: Folded =
    Folded { inv_freq: 0, half: 0, scaling: 1.0, k_offset: 0, q_norm: 0, k_norm: 0, eps: 0.0 };

/// Per-head RMSNorm weights of the queries and keys (Qwen3's `q_norm` / `k_norm`), `head_dim`
/// values each, and their eps.
#[derive(Clone, Copy)]
pub struct QkNorms<'a> {
    pub q: &'a CudaSlice<f32>,
    pub k: &'a CudaSlice<f32>,
    pub eps: f32,
}

#[allow(clippy::too_many_arguments)]
fn launch_decode(
    gpu: &Gpu,
    (qp, q_stride): (u64, usize),
    meta: &AttentionMeta,
    (c, f): (&KvArgs, usize),
    p: &AttentionParams,
    plan: DecodePlan,
    scratch: &mut DecodeScratch,
    (op, out_stride): (u64, usize),
    folded: Folded,
) -> CudaResult<()> {
    let hd = head_dim_index(p.head_dim)?;
    let splits = plan.splits.max(1);
    let visible = p.window.map_or(meta.max_context, |w| w.min(meta.max_context));
    if plan.partition == 0 || splits * plan.partition < visible {
        return Err(CudaError::Shape(format!("decode plan {plan:?} does not cover {visible} keys")));
    }
    if !scratch.fits(meta.rows, p.n_heads, p.head_dim, splits) {
        return Err(CudaError::Shape(format!("decode scratch too small for {} rows x {splits} splits", meta.rows)));
    }
    let a = KernelArgs::new(gpu, meta, p, q_stride, out_stride);
    let group = p.n_heads / p.n_kv_heads;
    let gc = heads_per_cta(group);
    let (po, pm, cn) =
        (gpu.ptr_mut(&mut scratch.out), gpu.ptr_mut(&mut scratch.ml), gpu.ptr_mut(&mut scratch.counters));
    let (part, ms) = (plan.partition as i32, splits as i32);
    let grid = ((p.n_kv_heads * group.div_ceil(gc)) as u32, meta.rows as u32, splits as u32);
    gpu.launch(
        &gpu.fns.paged_decode[f][usize::from(gc > 4)][hd],
        cfg(grid, THREADS, plan.shared_bytes(p, meta.block_size)),
        &[
            &op,
            &a.os,
            &po,
            &pm,
            &cn,
            &qp,
            &a.qs,
            &c.k,
            &c.v,
            &c.k_params,
            &c.v_params,
            &c.shift,
            &c.fp8_scales,
            &a.bt,
            &a.bts,
            &a.cl,
            &a.nh,
            &a.nkv,
            &a.bs,
            &p.scale,
            &a.softcap,
            &a.window,
            &part,
            &ms,
            &folded.inv_freq,
            &folded.half,
            &folded.scaling,
            &folded.k_offset,
            &folded.q_norm,
            &folded.k_norm,
            &folded.eps,
        ],
    )
}

/// Decode attention over a fused QKV buffer of unrotated rows (`[tokens, (n_heads + 2 ·
/// n_kv_heads) · head_dim]` rows of `qkv_stride`: query, key, value heads), in one launch
/// doing what `qkv_norm` (with `norms`: the query and key heads RMSNormed per head), `rope`
/// (rotating by `inv_freq`, scaled by `scaling`, and storing the new keys and values into
/// `kv`) then `attention` do — the same bits. A decode step's RoPE and q/k-norm launches go
/// (an fp8 cache, which calibrates its scales on the stored keys, gets the norm launch, in
/// place in `qkv`). Every row must have one query token, at position `context_len - 1`.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_rope(
    gpu: &Gpu,
    qkv: &mut CudaSlice<bf16>,
    qkv_stride: usize,
    meta: &AttentionMeta,
    kv: &mut DeviceKv,
    p: &AttentionParams,
    (inv_freq, scaling): (&impl DevicePtr<f32>, f32),
    norms: Option<QkNorms>,
    plan: DecodePlan,
    scratch: &mut DecodeScratch,
    out: &mut impl DevicePtrMut<bf16>,
    out_stride: usize,
) -> CudaResult<()> {
    check_cache(kv, meta, p)?;
    let (width, kv_width) = (p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim);
    let half = inv_freq.len();
    let need = |stride: usize, w: usize| (meta.tokens.max(1) - 1) * stride + w;
    if meta.max_query > 1
        || meta.tokens != meta.rows
        || 2 * half > p.head_dim
        || qkv_stride < width + 2 * kv_width
        || out_stride < width
        || qkv.len() < need(qkv_stride, width + 2 * kv_width)
        || out.len() < need(out_stride, width)
        || norms.is_some_and(|n| n.q.len() < p.head_dim || n.k.len() < p.head_dim)
    {
        return Err(CudaError::Shape(format!(
            "decode attention with RoPE: {} rows / {} tokens (longest query {}), qkv {} (stride {qkv_stride}), out {} \
             (stride {out_stride}), {half} rotary pairs of head dim {}, norms of {:?}",
            meta.rows,
            meta.tokens,
            meta.max_query,
            qkv.len(),
            out.len(),
            p.head_dim,
            norms.map(|n| (n.q.len(), n.k.len()))
        )));
    }
    let mut folded =
        Folded { inv_freq: gpu.ptr(inv_freq), half: half as i32, scaling, k_offset: width as i32, ..NOTHING_FOLDED };
    match norms {
        Some(n) if kv.fp8_scales().is_some() => {
            let heads = QkvHeads {
                tokens: meta.tokens,
                stride: qkv_stride,
                head_dim: p.head_dim,
                n_q: p.n_heads,
                n_k: p.n_kv_heads,
                n_v: 0,
            };
            qkv_norm(gpu, qkv, heads, Some(n.q), Some(n.k), n.eps)?;
        }
        Some(n) => folded = Folded { q_norm: gpu.ptr(n.q), k_norm: gpu.ptr(n.k), eps: n.eps, ..folded },
        None => {}
    }
    let (qp, op) = (gpu.ptr(&*qkv), gpu.ptr_mut(out));
    // An fp8 cache's first write calibrates on the keys before rotation: a rotated pair is at
    // most sqrt(2) times its larger element, times the RoPE scaling.
    let k_at = qp + (width * std::mem::size_of::<bf16>()) as u64;
    let v_at = k_at + (kv_width * std::mem::size_of::<bf16>()) as u64;
    kv.calibrate(gpu, (k_at, v_at), qkv_stride, meta, std::f32::consts::SQRT_2 * scaling.max(1.0))?;
    let c = kv.args(gpu);
    launch_decode(gpu, (qp, qkv_stride), meta, (&c, kv.format()), p, plan, scratch, (op, out_stride), folded)
}
