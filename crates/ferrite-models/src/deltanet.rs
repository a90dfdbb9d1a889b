//! Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5) on the CPU: the attention kind of a
//! layer whose `AttentionConfig::linear` is set. It keeps no keys or values: each sequence
//! carries a recurrent state in a slot of the model's recurrent KV group (`kv_state`).
//!
//! A step: the input projections (q, k and v of every head into the causal conv; the output
//! gate `z`; the per-head `b` and `a`), the causal depthwise conv + SiLU continuing the slot's
//! window, q and k L2-normalized (q also scaled by `1/sqrt(k_dim)`), `β = sigmoid(b)` and the
//! log decay `g = −exp(A_log) · softplus(a + dt_bias)`, the gated delta rule over the slot's
//! matrices (`cpu::gated_delta`), an RMSNorm of each head's output times `silu(z)`, and the
//! output projection. Which slot a row reads and which slots it writes (block-end snapshots
//! for the prefix cache, its end, a verify row's per-token states) is `state_rows`.
//!
//! Weights load from either packing: Qwen3.5's separate `in_proj_qkv`, `in_proj_z`,
//! `in_proj_b`, `in_proj_a`, or Qwen3-Next's `in_proj_qkvz` and `in_proj_ba`, whose rows are
//! grouped by key head (`[q, k, v…, z…]` and `[b…, a…]` per key head) and are put in the
//! separate order at load. A GGUF file stores the decay as `−exp(A_log)` already.

use ferrite_runtime::cpu::gated_delta::{self, DeltaShape};
use ferrite_runtime::cpu::{self};
use ferrite_runtime::kv_state::state_rows;
use ferrite_runtime::{ForwardBatch, KvCache, Result as RtResult, Tensor};

use crate::blocks::Linear;
use crate::error::{LoadError, Result};
use crate::weights::Weights;

/// How a family's file stores a pair of projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    /// One tensor each (`in_proj_qkv` + `in_proj_z`; `in_proj_b` + `in_proj_a`).
    Split,
    /// One tensor whose rows are grouped by key head (`in_proj_qkvz`; `in_proj_ba`).
    Grouped,
}

/// How the decay parameter is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecayParam {
    /// `A_log` (HF): the decay rate is `exp(A_log)`.
    Log,
    /// `−exp(A_log)` itself (llama.cpp's `ssm_a`).
    NegExp,
}

/// One gated DeltaNet layer.
#[derive(Debug, Clone, PartialEq)]
pub struct DeltaNetConfig {
    pub shape: DeltaShape,
    pub conv_kernel: usize,
    /// The layer's index in `KvLayout::states`.
    pub state: usize,
    pub eps: f32,
    /// The module's name, `model.layers.N.linear_attn`.
    pub prefix: String,
    pub qkvz: Packing,
    pub ba: Packing,
    pub decay: DecayParam,
}

impl DeltaNetConfig {
    /// Channels of the causal conv: q and k of every key head, v of every value head.
    pub fn conv_channels(&self) -> usize {
        let s = &self.shape;
        2 * s.k_heads * s.k_dim + s.v_heads * s.v_dim
    }

    /// An error unless the heads divide evenly and every size is positive.
    pub fn check(&self) -> std::result::Result<(), String> {
        let s = &self.shape;
        if [s.k_heads, s.v_heads, s.k_dim, s.v_dim, self.conv_kernel].contains(&0) {
            return Err(format!("{}: a linear-attention size is 0 ({s:?}, conv {})", self.prefix, self.conv_kernel));
        }
        if !s.v_heads.is_multiple_of(s.k_heads) {
            return Err(format!(
                "{}: {} value heads are not a multiple of {} key heads",
                self.prefix, s.v_heads, s.k_heads
            ));
        }
        Ok(())
    }
}

pub struct GatedDeltaNet {
    qkv: Linear,
    z: Linear,
    b: Linear,
    a: Linear,
    /// `[kernel][channels]`.
    conv: Vec<f32>,
    dt_bias: Vec<f32>,
    /// `−exp(A_log)` per value head.
    neg_rate: Vec<f32>,
    norm: Vec<f32>,
    out: Linear,
    c: DeltaNetConfig,
}

impl GatedDeltaNet {
    pub fn load(w: &Weights, hidden: usize, c: DeltaNetConfig) -> Result<GatedDeltaNet> {
        c.check().map_err(LoadError::Other)?;
        let s = c.shape;
        let vd = s.v_heads * s.v_dim;
        let channels = c.conv_channels();
        let p = |n: &str| format!("{}.{n}", c.prefix);
        let bad = |name: &str, e: ferrite_runtime::RuntimeError| LoadError::Other(format!("{name}: {e}"));
        let (qkv, z) = match c.qkvz {
            Packing::Split => (Linear::load(w, &p("in_proj_qkv"), channels, hidden, false)?, {
                Linear::load(w, &p("in_proj_z"), vd, hidden, false)?
            }),
            Packing::Grouped => {
                let name = p("in_proj_qkvz");
                let r = s.v_heads / s.k_heads;
                let per = [s.k_dim, s.k_dim, r * s.v_dim, r * s.v_dim];
                let t = w.get(&format!("{name}.weight"), &[channels + vd, hidden])?;
                let t = t.permute_rows(&ungroup(s.k_heads, &per)).map_err(|e| bad(&name, e))?;
                (rows(&t, 0..channels, &name)?, rows(&t, channels..channels + vd, &name)?)
            }
        };
        let (b, a) = match c.ba {
            Packing::Split => (
                Linear::load(w, &p("in_proj_b"), s.v_heads, hidden, false)?,
                Linear::load(w, &p("in_proj_a"), s.v_heads, hidden, false)?,
            ),
            Packing::Grouped => {
                let name = p("in_proj_ba");
                let r = s.v_heads / s.k_heads;
                let t = w.get(&format!("{name}.weight"), &[2 * s.v_heads, hidden])?;
                let t = t.permute_rows(&ungroup(s.k_heads, &[r, r])).map_err(|e| bad(&name, e))?;
                (rows(&t, 0..s.v_heads, &name)?, rows(&t, s.v_heads..2 * s.v_heads, &name)?)
            }
        };
        let k = c.conv_kernel;
        let conv_name = p("conv1d.weight");
        let conv = match w.get_f32(&conv_name, &[channels, 1, k]) {
            Ok(v) => v,
            // GGUF files store it squeezed.
            Err(_) => w.get_f32(&conv_name, &[channels, k])?,
        };
        let conv = (0..k).flat_map(|j| (0..channels).map(move |ch| (ch, j))).map(|(ch, j)| conv[ch * k + j]).collect();
        let rate = w.get_f32(&p("A_log"), &[s.v_heads])?;
        let neg_rate = match c.decay {
            DecayParam::Log => rate.iter().map(|a| -a.exp()).collect(),
            DecayParam::NegExp => rate,
        };
        Ok(GatedDeltaNet {
            qkv,
            z,
            b,
            a,
            conv,
            dt_bias: w.get_f32(&p("dt_bias"), &[s.v_heads])?,
            neg_rate,
            norm: w.norm(&p("norm.weight"), s.v_dim, 0.0)?,
            out: Linear::load(w, &p("out_proj"), hidden, vd, false)?,
            c,
        })
    }

    /// `h` is `[t, hidden]`; reads and writes the rows' state slots and writes the output
    /// projection `[t, hidden]` into `out`.
    pub fn forward(&self, h: &[f32], batch: &ForwardBatch, kv: &mut KvCache, out: &mut [f32]) -> RtResult<()> {
        let t = batch.num_tokens();
        let s = self.c.shape;
        let (kd, vd) = (s.k_heads * s.k_dim, s.v_heads * s.v_dim);
        let channels = self.c.conv_channels();
        let [mut qkv, mut z, b, a] = Linear::forward_many([&self.qkv, &self.z, &self.b, &self.a], h, t)?;
        let block_size = kv.block_size();
        let pool = kv.state_mut(self.c.state)?;
        let rows = state_rows(batch, pool.spec.group, block_size)?;
        gated_delta::causal_conv_silu(&mut qkv, &self.conv, self.c.conv_kernel, pool, &rows)?;
        let (mut q, mut k, mut v) =
            (Vec::with_capacity(t * kd), Vec::with_capacity(t * kd), Vec::with_capacity(t * vd));
        for tok in qkv.chunks_exact(channels) {
            q.extend_from_slice(&tok[..kd]);
            k.extend_from_slice(&tok[kd..2 * kd]);
            v.extend_from_slice(&tok[2 * kd..]);
        }
        drop(qkv);
        gated_delta::l2_normalize(&mut q, s.k_dim, L2_EPS, 1.0 / (s.k_dim as f32).sqrt());
        gated_delta::l2_normalize(&mut k, s.k_dim, L2_EPS, 1.0);
        let (beta, g) = gated_delta::gates(&b, &a, &self.neg_rate, &self.dt_bias);
        let mut o = vec![0f32; t * vd];
        gated_delta::gated_delta_rule(&q, &k, &v, &g, &beta, &s, pool, &rows, &mut o)?;
        cpu::rms_norm_in_place(&mut o, &self.norm, self.c.eps, 0.0);
        // z ← silu(z) · normed output.
        cpu::silu_mul(&mut z, &o);
        self.out.forward_into(&z, t, out)
    }
}

/// The L2 norm's epsilon (transformers' and FLA's `l2norm`).
pub(crate) const L2_EPS: f32 = 1e-6;

/// The row order that turns rows grouped by key head — per group, parts of `sizes` rows — into
/// each part for every group in turn (`[q…, k…, v…, z…]` from `[q, k, v, z]` per group).
pub(crate) fn ungroup(groups: usize, sizes: &[usize]) -> Vec<usize> {
    let per: usize = sizes.iter().sum();
    let mut order = Vec::with_capacity(groups * per);
    let mut start = 0;
    for &size in sizes {
        for g in 0..groups {
            order.extend(g * per + start..g * per + start + size);
        }
        start += size;
    }
    order
}

/// Rows `r` of `t` as a matmul weight.
fn rows(t: &Tensor, r: std::ops::Range<usize>, name: &str) -> Result<Linear> {
    let part = t.slice_rows(r).map_err(|e| LoadError::Other(format!("{name}: {e}")))?;
    cpu::prepare_linear(&part);
    Ok(Linear::from_tensor(part))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouped_rows_are_put_in_part_order() {
        // Two groups of [q(1), k(1), v(2)]: q0 k0 v0 v0' q1 k1 v1 v1' → q0 q1 k0 k1 v0 v0' v1 v1'.
        assert_eq!(ungroup(2, &[1, 1, 2]), vec![0, 4, 1, 5, 2, 3, 6, 7]);
    }
}
