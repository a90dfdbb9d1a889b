//! Gated DeltaNet layers on the device: the CUDA executor's side of `crate::deltanet`.
//!
//! The input projections are one matrix, `[q, k, v (the conv's channels), z, b, a]` rows
//! (Qwen3-Next's key-head-grouped `in_proj_qkvz` / `in_proj_ba` put in that order at load),
//! whose GEMM writes f32 rows; then, all in f32, the causal conv + SiLU continuing each row's
//! window in its state slot, the q/k L2 norms, the gates, the gated delta rule over the slot's
//! matrices (a chunked scan for prefill rows, the one-step kernel for the rest), and the
//! per-head RMSNorm times `silu(z)` to bf16 for the output projection
//! (`ferrite_runtime::cuda::ops::deltanet`). The state slots live in the device KV cache
//! (`KvCache::device_state_mut`); which slot a row reads and writes is uploaded once a step
//! (`StateTable`), before and outside any graph, so decode steps replay.

use ferrite_runtime::cuda::ops::{self, Matrix, StateTable};
use ferrite_runtime::cuda::{CudaSlice, Gpu};
use ferrite_runtime::kv_state::state_rows;
use ferrite_runtime::{ForwardBatch, KvCache, Padding, Result as RtResult, RuntimeError};
use half::bf16;

use super::decoder_weights::{Part, Source};
use crate::deltanet::{ungroup, DecayParam, DeltaNetConfig, Packing, L2_EPS};
use crate::error::Result;
use crate::plan::DecoderPlan;

/// A DeltaNet layer's weights on the device.
pub struct DeltaWeights {
    /// `[channels + v_heads · v_dim + 2 · v_heads, hidden]`: q, k, v, z, b, a rows.
    proj: Matrix,
    /// `[kernel][channels]`.
    conv: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    /// `−exp(A_log)` per value head.
    neg_rate: CudaSlice<f32>,
    /// `[v_dim]`.
    norm: CudaSlice<f32>,
    out: Matrix,
}

/// Widths of a layer's fused projection: (conv channels, z, each of b and a, the whole row).
fn widths(c: &DeltaNetConfig) -> (usize, usize, usize, usize) {
    let s = c.shape;
    let (channels, vd, nv) = (c.conv_channels(), s.v_heads * s.v_dim, s.v_heads);
    (channels, vd, nv, channels + vd + 2 * nv)
}

impl DeltaWeights {
    /// The weights of layer `c` (`hidden` inputs) from `src`, in either packing.
    pub(super) fn load(src: &mut dyn Source, gpu: &Gpu, c: &DeltaNetConfig, hidden: usize) -> Result<DeltaWeights> {
        let s = c.shape;
        let (channels, vd, nv, _) = widths(c);
        let p = |n: &str| format!("{}.{n}", c.prefix);
        let r = s.v_heads / s.k_heads;
        // (tensor, its rows, the row order it contributes): rows grouped by key head are
        // taken part by part (`ungroup`), each group's run of a part one piece.
        let grouped = |name: String, total: usize, sizes: &[usize]| (name, total, ungroup(s.k_heads, sizes));
        let mut tensors: Vec<(String, usize, Vec<usize>)> = match c.qkvz {
            Packing::Split => {
                vec![(p("in_proj_qkv"), channels, (0..channels).collect()), (p("in_proj_z"), vd, (0..vd).collect())]
            }
            Packing::Grouped => {
                vec![grouped(p("in_proj_qkvz"), channels + vd, &[s.k_dim, s.k_dim, r * s.v_dim, r * s.v_dim])]
            }
        };
        match c.ba {
            Packing::Split => {
                tensors.extend([(p("in_proj_b"), nv, (0..nv).collect()), (p("in_proj_a"), nv, (0..nv).collect())])
            }
            Packing::Grouped => tensors.push(grouped(p("in_proj_ba"), 2 * nv, &[r, r])),
        }
        let mut parts = Vec::new();
        for (name, total, order) in &tensors {
            parts.extend(runs(order).into_iter().map(|rows| Part { name, total: *total, rows }));
        }
        let proj = src.matrix(&parts, hidden)?;
        let k = c.conv_kernel;
        let taps = src.values(&p("conv1d.weight"), &[&[channels, 1, k], &[channels, k]])?;
        let conv: Vec<f32> =
            (0..k).flat_map(|j| (0..channels).map(move |ch| (ch, j))).map(|(ch, j)| taps[ch * k + j]).collect();
        let rate = src.values(&p("A_log"), &[&[nv]])?;
        let neg_rate: Vec<f32> = match c.decay {
            DecayParam::Log => rate.iter().map(|a| -a.exp()).collect(),
            DecayParam::NegExp => rate,
        };
        Ok(DeltaWeights {
            proj,
            conv: gpu.upload(&conv)?,
            dt_bias: gpu.upload(&src.values(&p("dt_bias"), &[&[nv]])?)?,
            neg_rate: gpu.upload(&neg_rate)?,
            norm: gpu.upload(&src.vector(&p("norm.weight"), s.v_dim, 0.0)?)?,
            out: src.matrix(&[Part::whole(&p("out_proj"), hidden)], vd)?,
        })
    }

    /// Device bytes of the weights.
    pub fn bytes(&self) -> usize {
        let vectors =
            [&self.conv, &self.dt_bias, &self.neg_rate, &self.norm].iter().map(|v| 4 * v.len()).sum::<usize>();
        self.proj.bytes() + self.out.bytes() + vectors
    }

    /// bf16 values of dequantization scratch its GEMMs use (`Matrix::scratch_len`).
    pub fn scratch_len(&self, tokens: usize) -> usize {
        self.proj.scratch_len(tokens).max(self.out.scratch_len(tokens))
    }
}

/// `order` as runs of consecutive row indices.
fn runs(order: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for &i in order {
        match out.last_mut() {
            Some(run) if run.end == i => run.end += 1,
            _ => out.push(i..i + 1),
        }
    }
    out
}

/// A step's DeltaNet activations (sized for the widest layer) and its state table.
pub struct DeltaBuffers {
    /// The fused projection's f32 rows.
    proj: CudaSlice<f32>,
    /// The conv's outputs `[tokens, channels]`: q and k normalized in place, then v.
    conv: CudaSlice<f32>,
    beta: CudaSlice<f32>,
    g: CudaSlice<f32>,
    /// The delta rule's output `[tokens, v_heads · v_dim]`, and it normed and gated in bf16.
    o: CudaSlice<f32>,
    normed: CudaSlice<bf16>,
    table: StateTable,
}

impl DeltaBuffers {
    /// Buffers for `plan`'s DeltaNet layers (none without any) for steps of `tokens` tokens.
    pub fn new(gpu: &Gpu, plan: &DecoderPlan, tokens: usize) -> RtResult<Option<DeltaBuffers>> {
        let layers: Vec<&DeltaNetConfig> = plan.layers.iter().filter_map(|l| l.attn.linear.as_ref()).collect();
        if layers.is_empty() {
            return Ok(None);
        }
        let widest = |f: &dyn Fn(&DeltaNetConfig) -> usize| layers.iter().map(|c| f(c)).max().unwrap_or(0) * tokens;
        let f32s = |n: usize| gpu.alloc::<f32>(n.max(1));
        Ok(Some(DeltaBuffers {
            proj: f32s(widest(&|c| widths(c).3))?,
            conv: f32s(widest(&|c| c.conv_channels()))?,
            beta: f32s(widest(&|c| c.shape.v_heads))?,
            g: f32s(widest(&|c| c.shape.v_heads))?,
            o: f32s(widest(&|c| c.shape.v_heads * c.shape.v_dim))?,
            normed: gpu.alloc::<bf16>(widest(&|c| c.shape.v_heads * c.shape.v_dim).max(1))?,
            table: StateTable::new(gpu, tokens)?,
        }))
    }

    /// Upload which state slots each row of `batch` reads and writes (`batch`'s rows, padded
    /// as `pad` says with rows that touch no slot) for the step's DeltaNet layers.
    pub fn upload(
        &mut self,
        gpu: &Gpu,
        batch: &ForwardBatch,
        pad: Padding,
        kv: &KvCache,
        group: usize,
    ) -> RtResult<()> {
        let state = state_rows(batch, group, kv.block_size())?;
        let slots = kv.group_blocks().get(group).copied().unwrap_or(0);
        self.table.upload(gpu, &state, pad, slots)
    }
}

/// Queue DeltaNet layer `c` over `input` (`[tokens, hidden]` normed rows, bf16): its output
/// projection lands in `out`; the rows' state slots are read and written as the step's table
/// says.
#[allow(clippy::too_many_arguments)]
pub fn queue_deltanet(
    gpu: &Gpu,
    c: &DeltaNetConfig,
    w: &DeltaWeights,
    b: &mut DeltaBuffers,
    kv: &mut KvCache,
    input: &CudaSlice<bf16>,
    out: &mut CudaSlice<bf16>,
    (tokens, hidden): (usize, usize),
    dequant: &mut Option<CudaSlice<bf16>>,
) -> RtResult<()> {
    if b.table.tokens() != tokens {
        return Err(RuntimeError::Shape(format!(
            "a DeltaNet step of {tokens} tokens over a state table of {}",
            b.table.tokens()
        )));
    }
    let s = c.shape;
    let (channels, vd, nv, width) = widths(c);
    w.proj.linear::<f32>(gpu, input, None, &mut b.proj, (tokens, width, hidden), dequant.as_mut())?;
    let pool = kv.device_state_mut(c.state)?;
    ops::delta_conv(gpu, &b.proj, width, &w.conv, &b.table, pool, &mut b.conv)?;
    let q_scale = 1.0 / (s.k_dim as f32).sqrt();
    ops::delta_qk_norm(gpu, &mut b.conv, (tokens, channels), (s.k_heads, s.k_dim), q_scale, L2_EPS)?;
    let gates = (tokens, width, channels + vd, channels + vd + nv);
    ops::delta_gates(gpu, &b.proj, gates, &w.neg_rate, &w.dt_bias, &mut b.beta, &mut b.g)?;
    ops::delta_rule(gpu, &b.conv, channels, &b.g, &b.beta, &s, &b.table, pool, &mut b.o)?;
    let z = b.proj.slice(channels..);
    ops::delta_out_norm(gpu, &b.o, &z, width, &w.norm, (tokens, nv, s.v_dim), c.eps, &mut b.normed)?;
    w.out.linear(gpu, &b.normed, None, out, (tokens, hidden, vd), dequant.as_mut())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_order_becomes_runs_of_consecutive_rows() {
        // Two key-head groups of [q(2), k(1)]: q0 q0' q1 q1' k0 k1 → rows 0-1, 3-4, 2, 5.
        assert_eq!(runs(&ungroup(2, &[2, 1])), vec![0..2, 3..5, 2..3, 5..6]);
        assert_eq!(runs(&[0, 1, 2]), vec![0..3]);
    }
}
