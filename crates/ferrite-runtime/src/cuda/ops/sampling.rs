//! Token selection on the device: argmax per row, and sampling with per-row temperature,
//! top-k, top-p and min-p from a per-row uniform number, returning the chosen token and its
//! log-probability (under the logits as given, before temperature). Only token ids and
//! log-probabilities need to cross to the host.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use crate::cuda::context::{cfg, Gpu};
use crate::cuda::error::{CudaError, CudaResult};

/// Threads of the one-block-per-row sampling kernels (SAMPLE_THREADS).
const THREADS: u32 = 1024;

/// One row's sampling parameters. `uniform` in [0, 1) is the row's random draw: the caller
/// derives it from the request's (seed, step), so a row's token never depends on its batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: u32,
    /// 1 means no nucleus cut.
    pub top_p: f32,
    /// 0 means no min-p cut.
    pub min_p: f32,
    pub uniform: f32,
}

/// A batch's sampling parameters on the device.
pub struct SamplingParamsDev {
    rows: usize,
    temperature: CudaSlice<f32>,
    top_k: CudaSlice<i32>,
    top_p: CudaSlice<f32>,
    min_p: CudaSlice<f32>,
    uniform: CudaSlice<f32>,
}

impl SamplingParamsDev {
    pub fn upload(gpu: &Gpu, rows: &[RowSampling]) -> CudaResult<SamplingParamsDev> {
        let col = |f: fn(&RowSampling) -> f32| -> CudaResult<CudaSlice<f32>> {
            gpu.upload(&rows.iter().map(f).collect::<Vec<_>>())
        };
        let top_k: Vec<i32> = rows.iter().map(|r| r.top_k.min(i32::MAX as u32) as i32).collect();
        Ok(SamplingParamsDev {
            rows: rows.len(),
            temperature: col(|r| r.temperature)?,
            top_k: gpu.upload(&top_k)?,
            top_p: col(|r| r.top_p)?,
            min_p: col(|r| r.min_p)?,
            uniform: col(|r| r.uniform.clamp(0.0, 1.0 - f32::EPSILON))?,
        })
    }
}

fn check_logits(logits: usize, (rows, vocab, stride): (usize, usize, usize), outs: usize) -> CudaResult<()> {
    if rows == 0 || vocab == 0 || stride < vocab || logits < (rows - 1) * stride + vocab || outs < rows {
        return Err(CudaError::Shape(format!(
            "{rows} rows of {vocab} logits (stride {stride}) in {logits} values, {outs} outputs"
        )));
    }
    Ok(())
}

/// `out[r]` = index of the largest logit of row r (first on ties; NaN never wins).
pub fn argmax(
    gpu: &Gpu,
    logits: &impl DevicePtr<f32>,
    (rows, vocab, stride): (usize, usize, usize),
    out: &mut impl DevicePtrMut<u32>,
) -> CudaResult<()> {
    check_logits(logits.len(), (rows, vocab, stride), out.len())?;
    let (lp, op) = (gpu.ptr(logits), gpu.ptr_mut(out));
    let (v, s) = (vocab as i32, stride as i32);
    gpu.launch(&gpu.fns.argmax_rows, cfg((rows as u32, 1, 1), THREADS, 0), &[&lp, &v, &s, &op])
}

/// Sample one token per row into `tokens`, with its log-probability into `logprobs`.
pub fn sample(
    gpu: &Gpu,
    logits: &impl DevicePtr<f32>,
    (vocab, stride): (usize, usize),
    params: &SamplingParamsDev,
    tokens: &mut impl DevicePtrMut<u32>,
    logprobs: &mut impl DevicePtrMut<f32>,
) -> CudaResult<()> {
    let rows = params.rows;
    check_logits(logits.len(), (rows, vocab, stride), tokens.len().min(logprobs.len()))?;
    let (lp, tp, pp) = (gpu.ptr(logits), gpu.ptr_mut(tokens), gpu.ptr_mut(logprobs));
    let (t, k, p, m, u) = (
        gpu.ptr(&params.temperature),
        gpu.ptr(&params.top_k),
        gpu.ptr(&params.top_p),
        gpu.ptr(&params.min_p),
        gpu.ptr(&params.uniform),
    );
    let (v, s) = (vocab as i32, stride as i32);
    gpu.launch(&gpu.fns.sample_rows, cfg((rows as u32, 1, 1), THREADS, 0), &[&lp, &v, &s, &t, &k, &p, &m, &u, &tp, &pp])
}
