//! Token selection on the device: argmax per row; and sampling with per-row temperature,
//! top-k, top-p and min-p from a per-row uniform number after the rows' logit edits (bias,
//! penalties, bans), returning the chosen token, its log-probability (under the edited logits,
//! before temperature) and, when asked, the most likely alternatives with theirs. Only token
//! ids and log-probabilities need to cross to the host.

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut};

use crate::cuda::context::{cfg, Gpu};
use crate::cuda::error::{CudaError, CudaResult};
pub use crate::sampling::RowSampling;
use crate::sampling::{is_greedy_temperature, LogitEdit, SampledToken};

/// Threads of the one-block-per-row sampling kernels (SAMPLE_THREADS).
const THREADS: u32 = 1024;
/// The most alternatives `top_logprobs_rows` reports (TOP_MAX).
pub const MAX_TOP: usize = 32;
/// Words of one edit in the kernel's layout: row, token, bias, repetition, subtract, ban.
const EDIT_WORDS: usize = 6;

/// A batch's sampling parameters on the device, in one buffer filled by one copy: five
/// columns of `rows` words (temperature, top-k, top-p, min-p, uniform), then the edits.
pub struct SamplingParamsDev {
    rows: usize,
    edits: usize,
    /// Alternatives to report per row (the most any row asked for).
    top: usize,
    packed: CudaSlice<u32>,
}

impl SamplingParamsDev {
    /// The parameters of `rows`, without edits or alternatives.
    pub fn upload(gpu: &Gpu, rows: &[RowSampling]) -> CudaResult<SamplingParamsDev> {
        let mut p = SamplingParamsDev::with_capacity(gpu, rows.len(), 0)?;
        p.update(gpu, rows, &[], 0, usize::MAX)?;
        Ok(p)
    }

    /// Room for `rows` rows and `edits` edits (`update` grows it when a step needs more).
    pub fn with_capacity(gpu: &Gpu, rows: usize, edits: usize) -> CudaResult<SamplingParamsDev> {
        Ok(SamplingParamsDev { rows: 0, edits: 0, top: 0, packed: gpu.alloc((5 * rows + EDIT_WORDS * edits).max(1))? })
    }

    /// Copy a step's parameters in: `rows`, the `(row, edit)` pairs (tokens below `vocab`, at
    /// most one edit per (row, token)), and `top` alternatives per row (at most `MAX_TOP`).
    pub fn update(
        &mut self,
        gpu: &Gpu,
        rows: &[RowSampling],
        edits: &[(usize, LogitEdit)],
        top: usize,
        vocab: usize,
    ) -> CudaResult<()> {
        if top > MAX_TOP {
            return Err(CudaError::Shape(format!("{top} top log-probabilities (at most {MAX_TOP})")));
        }
        if let Some((r, e)) = edits.iter().find(|(r, e)| *r >= rows.len() || e.token as usize >= vocab) {
            return Err(CudaError::Shape(format!(
                "a logit edit of token {} in row {r} ({} rows of {vocab})",
                e.token,
                rows.len()
            )));
        }
        let n = rows.len();
        let mut host = Vec::with_capacity(5 * n + EDIT_WORDS * edits.len());
        // The kernel samples at any temperature above 0: the greedy ones go as 0.
        host.extend(
            rows.iter().map(|r| if is_greedy_temperature(r.temperature) { 0.0 } else { r.temperature }.to_bits()),
        );
        host.extend(rows.iter().map(|r| r.top_k.min(i32::MAX as u32)));
        host.extend(rows.iter().map(|r| r.top_p.to_bits()));
        host.extend(rows.iter().map(|r| r.min_p.to_bits()));
        host.extend(rows.iter().map(|r| r.uniform.clamp(0.0, 1.0 - f32::EPSILON).to_bits()));
        for (r, e) in edits {
            host.extend([*r as u32, e.token, e.bias.to_bits(), e.repetition.to_bits(), e.subtract.to_bits()]);
            host.push(u32::from(e.ban));
        }
        if host.len() > self.packed.len() {
            self.packed = gpu.alloc(host.len().next_power_of_two())?;
        }
        gpu.upload_into(&host, &mut self.packed)?;
        (self.rows, self.edits, self.top) = (n, edits.len(), top);
        Ok(())
    }

    /// Device address of column `c` (0 temperature .. 4 uniform), or of the edits (5).
    fn column(&self, gpu: &Gpu, c: usize) -> u64 {
        gpu.ptr(&self.packed) + (c * self.rows * 4) as u64
    }
}

/// A batch's picks on the device, in one buffer read back by one copy: tokens, log-probability
/// bits, then `top` alternative ids and log-probability bits a row.
pub struct SampledDev {
    buf: CudaSlice<u32>,
    rows: usize,
    top: usize,
}

impl SampledDev {
    pub fn new(gpu: &Gpu, rows: usize) -> CudaResult<SampledDev> {
        Ok(SampledDev { buf: gpu.alloc((2 * rows).max(1))?, rows: 0, top: 0 })
    }

    /// Room for `rows` rows of `top` alternatives (reallocated only when larger).
    fn fit(&mut self, gpu: &Gpu, rows: usize, top: usize) -> CudaResult<()> {
        let need = 2 * rows * (1 + top);
        if need > self.buf.len() {
            self.buf = gpu.alloc(need.next_power_of_two())?;
        }
        (self.rows, self.top) = (rows, top);
        Ok(())
    }

    /// The picks of the last `pick` (waits for the stream); row r keeps `top[r]` alternatives.
    pub fn download(&self, gpu: &Gpu, top: &[usize]) -> CudaResult<Vec<SampledToken>> {
        SampledDev::parse(&gpu.download(&self.picks())?, self.shape(), top)
    }

    /// (rows, alternatives a row) of the last `pick`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.top)
    }

    /// The last `pick`'s whole result, as `parse` reads it.
    pub fn picks(&self) -> CudaView<'_, u32> {
        self.buf.slice(..2 * self.rows * (1 + self.top))
    }

    /// The last `pick`'s token ids, one a row.
    pub fn tokens(&self) -> CudaView<'_, u32> {
        self.buf.slice(..self.rows)
    }

    /// The picks in `host` (a copy of `picks()` of a pick of `(rows, alternatives)`); row r
    /// keeps `top[r]` alternatives.
    pub fn parse(host: &[u32], (n, k): (usize, usize), top: &[usize]) -> CudaResult<Vec<SampledToken>> {
        if top.len() != n || top.iter().any(|&t| t > k) || host.len() != 2 * n * (1 + k) {
            return Err(CudaError::Shape(format!("{top:?} alternatives of {n} rows picked with {k}")));
        }
        let (tokens, rest) = host.split_at(n);
        let (lps, rest) = rest.split_at(n);
        let (ids, top_lps) = rest.split_at(n * k);
        Ok((0..n)
            .map(|r| SampledToken {
                token: tokens[r],
                logprob: f32::from_bits(lps[r]),
                top: (0..top[r])
                    .map(|a| (ids[r * k + a], f32::from_bits(top_lps[r * k + a])))
                    .filter(|&(id, _)| id != u32::MAX)
                    .collect(),
            })
            .collect())
    }
}

/// Set the step's token ids listed in `pairs` — (token index, pick row) — from `picks`, the
/// token ids of the step queued before, without a trip to the host.
pub fn carry_picks(
    gpu: &Gpu,
    picks: &impl DevicePtr<u32>,
    pairs: &impl DevicePtr<u32>,
    n: usize,
    ids: &mut impl DevicePtrMut<u32>,
) -> CudaResult<()> {
    if pairs.len() < 2 * n {
        return Err(CudaError::Shape(format!("{n} carried picks in a buffer of {} words", pairs.len())));
    }
    if n == 0 {
        return Ok(());
    }
    let (sp, pp, ip, n) = (gpu.ptr(picks), gpu.ptr(pairs), gpu.ptr_mut(ids), n as i32);
    gpu.launch(&gpu.fns.carry_picks, cfg(((n as u32).div_ceil(256), 1, 1), 256, 0), &[&sp, &pp, &ip, &n])
}

fn check_logits(logits: usize, (rows, vocab, stride): (usize, usize, usize), outs: usize) -> CudaResult<()> {
    if rows == 0 || vocab == 0 || stride < vocab || logits < (rows - 1) * stride + vocab || outs < rows {
        return Err(CudaError::Shape(format!(
            "{rows} rows of {vocab} logits (stride {stride}) in {logits} values, {outs} outputs"
        )));
    }
    Ok(())
}

/// Per-row state of `argmax`'s parallel reduction (a 64-bit key and a counter a row, which
/// the kernel leaves at zero), for up to `rows` rows.
pub struct ArgmaxScratch {
    keys: CudaSlice<u64>,
    counters: CudaSlice<u32>,
}

impl ArgmaxScratch {
    pub fn new(gpu: &Gpu, rows: usize) -> CudaResult<ArgmaxScratch> {
        Ok(ArgmaxScratch { keys: gpu.alloc(rows.max(1))?, counters: gpu.alloc(rows.max(1))? })
    }
}

/// Logits each block of `argmax` reads (one round of its loads), and the most blocks a row.
const ARGMAX_PART: usize = 16_384;
const ARGMAX_MAX_PARTS: usize = 32;

/// `out[r]` = index of the largest logit of row r (first on ties; NaN never wins), each row
/// read by up to `ARGMAX_MAX_PARTS` blocks at once.
pub fn argmax(
    gpu: &Gpu,
    logits: &impl DevicePtr<f32>,
    (rows, vocab, stride): (usize, usize, usize),
    scratch: &mut ArgmaxScratch,
    out: &mut impl DevicePtrMut<u32>,
) -> CudaResult<()> {
    check_logits(logits.len(), (rows, vocab, stride), out.len())?;
    if scratch.keys.len() < rows {
        return Err(CudaError::Shape(format!("argmax scratch for {} rows, {rows} asked", scratch.keys.len())));
    }
    let parts = vocab.div_ceil(ARGMAX_PART).clamp(1, ARGMAX_MAX_PARTS) as u32;
    let (lp, op) = (gpu.ptr(logits), gpu.ptr_mut(out));
    let (kp, cp) = (gpu.ptr_mut(&mut scratch.keys), gpu.ptr_mut(&mut scratch.counters));
    let (v, s) = (vocab as i32, stride as i32);
    gpu.launch(&gpu.fns.argmax_rows, cfg((rows as u32, parts, 1), THREADS, 0), &[&lp, &v, &s, &kp, &cp, &op])
}

/// Sample one token per row into `tokens`, with its log-probability into `logprobs` (the
/// logits as they are: `pick` applies the edits first).
pub fn sample(
    gpu: &Gpu,
    logits: &impl DevicePtr<f32>,
    (vocab, stride): (usize, usize),
    params: &SamplingParamsDev,
    tokens: &mut impl DevicePtrMut<u32>,
    logprobs: &mut impl DevicePtrMut<f32>,
) -> CudaResult<()> {
    check_logits(logits.len(), (params.rows, vocab, stride), tokens.len().min(logprobs.len()))?;
    launch_sample(gpu, gpu.ptr(logits), (vocab, stride), params, gpu.ptr_mut(tokens), gpu.ptr_mut(logprobs))
}

fn launch_sample(
    gpu: &Gpu,
    lp: u64,
    (vocab, stride): (usize, usize),
    params: &SamplingParamsDev,
    tp: u64,
    pp: u64,
) -> CudaResult<()> {
    let [t, k, p, m, u] = [0, 1, 2, 3, 4].map(|c| params.column(gpu, c));
    let (v, s) = (vocab as i32, stride as i32);
    let grid = (params.rows as u32, 1, 1);
    gpu.launch(&gpu.fns.sample_rows, cfg(grid, THREADS, 0), &[&lp, &v, &s, &t, &k, &p, &m, &u, &tp, &pp])
}

/// A step's picks: apply each row's logit edits to `logits` (in place), sample a token per
/// row, and gather the `params.top` most likely alternatives, all into `out`.
pub fn pick(
    gpu: &Gpu,
    logits: &mut impl DevicePtrMut<f32>,
    (vocab, stride): (usize, usize),
    params: &SamplingParamsDev,
    out: &mut SampledDev,
) -> CudaResult<()> {
    let rows = params.rows;
    check_logits(logits.len(), (rows, vocab, stride), rows)?;
    out.fit(gpu, rows, params.top)?;
    let lp = gpu.ptr_mut(logits);
    let (v, s) = (vocab as i32, stride as i32);
    if params.edits > 0 {
        let (ep, n) = (params.column(gpu, 5), params.edits as i32);
        gpu.launch(&gpu.fns.edit_logits, cfg((gpu.grid_for(params.edits, 256), 1, 1), 256, 0), &[&lp, &s, &ep, &n])?;
    }
    let base = gpu.ptr(&out.buf);
    let at = |words: usize| base + 4 * words as u64;
    launch_sample(gpu, lp, (vocab, stride), params, at(0), at(rows))?;
    if params.top > 0 {
        let (ip, tp, k) = (at(2 * rows), at(2 * rows + rows * params.top), params.top as i32);
        gpu.launch(&gpu.fns.top_logprobs_rows, cfg((rows as u32, 1, 1), THREADS, 0), &[&lp, &v, &s, &k, &ip, &tp])?;
    }
    Ok(())
}
