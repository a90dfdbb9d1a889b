//! Gemma 4's mixture-of-experts block, which runs beside the dense MLP of a layer.
//!
//! A router (unscaled RMSNorm, a learned per-channel scale and `1/sqrt(hidden)`, a linear
//! layer, softmax) picks each token's top-k experts; their weights are renormalized to sum to 1
//! and multiplied by a learned per-expert scale. Each expert is a GeGLU MLP whose gate and up
//! projections are stored stacked (`experts.gate_up_proj`, `[experts, 2 × inter, hidden]`).
//! The block's output, normed, is added to the normed output of the dense MLP.

use ferrite_runtime::{cpu, Result as RtResult};

use crate::blocks::{Linear, Mlp, Norm};
use crate::config::Activation;
use crate::error::Result;
use crate::lora::cpu::LayerLora;
use crate::weights::Weights;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    pub num_experts: usize,
    pub top_k: usize,
    /// Width of each expert's MLP (`moe_intermediate_size`).
    pub intermediate: usize,
}

pub struct Moe {
    router_norm: Norm,
    router_scale: Vec<f32>,
    router: Linear,
    per_expert_scale: Vec<f32>,
    top_k: usize,
    experts: Vec<Mlp>,
    /// Norms the dense MLP's output (`post_feedforward_layernorm_1`).
    post_mlp_norm: Norm,
    /// Norms the experts' input (`pre_feedforward_layernorm_2`).
    pre_norm: Norm,
    /// Norms the experts' output (`post_feedforward_layernorm_2`).
    post_norm: Norm,
}

/// One token's route from its router scores (`scores`, one per expert, softmaxed in place):
/// its `top_k` (expert, weight) pairs, best first, the weights renormalized to sum to 1 and
/// times `per_expert_scale`. The CPU and CUDA models route with it.
pub fn route_row(scores: &mut [f32], top_k: usize, per_expert_scale: &[f32]) -> Vec<(usize, f32)> {
    cpu::softmax_in_place(scores);
    let mut order: Vec<usize> = (0..scores.len()).collect();
    // Stable: equal probabilities keep the lower expert first.
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    let top = &order[..top_k.min(scores.len())];
    let sum: f32 = top.iter().map(|&i| scores[i]).sum();
    top.iter().map(|&i| (i, scores[i] / sum * per_expert_scale[i])).collect()
}

impl Moe {
    /// The router, experts and norms of the layer `prefix` (`model.layers.N`).
    pub fn load(w: &Weights, prefix: &str, hidden: usize, shape: MoeShape, act: Activation, eps: f32) -> Result<Moe> {
        let (e, inter) = (shape.num_experts, shape.intermediate);
        let p = |s: &str| format!("{prefix}.{s}");
        let norm = |s: &str| Norm::load(w, &p(&format!("{s}.weight")), hidden, 0.0, eps);
        let gate_up = w.get(&p("experts.gate_up_proj"), &[e, 2 * inter, hidden])?;
        let down = w.get(&p("experts.down_proj"), &[e, hidden, inter])?;
        let experts = (0..e)
            .map(|x| -> Result<Mlp> {
                let rows =
                    |t: &ferrite_runtime::Tensor, r: std::ops::Range<usize>| t.slice_rows(r).map(Linear::from_tensor);
                let base = 2 * inter * x;
                Ok(Mlp::gated(
                    rows(&gate_up, base..base + inter)?,
                    rows(&gate_up, base + inter..base + 2 * inter)?,
                    rows(&down, hidden * x..hidden * (x + 1))?,
                    act,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Moe {
            router_norm: Norm::unit(hidden, eps),
            router_scale: w.get_f32(&p("router.scale"), &[hidden])?,
            router: Linear::load(w, &p("router.proj"), e, hidden, false)?,
            per_expert_scale: w.get_f32(&p("router.per_expert_scale"), &[e])?,
            top_k: shape.top_k,
            experts,
            post_mlp_norm: norm("post_feedforward_layernorm_1")?,
            pre_norm: norm("pre_feedforward_layernorm_2")?,
            post_norm: norm("post_feedforward_layernorm_2")?,
        })
    }

    /// Each token's `top_k` (expert, weight) pairs, best first.
    fn route(&self, x: &[f32], t: usize) -> RtResult<Vec<Vec<(usize, f32)>>> {
        let hidden = self.router_scale.len();
        let mut normed = vec![0f32; x.len()];
        self.router_norm.forward(x, &mut normed);
        let root = (hidden as f64).powf(-0.5) as f32;
        for row in normed.chunks_exact_mut(hidden) {
            row.iter_mut().zip(&self.router_scale).for_each(|(v, s)| *v = *v * s * root);
        }
        let mut scores = self.router.forward(&normed, t)?;
        let e = self.per_expert_scale.len();
        Ok(scores.chunks_exact_mut(e).map(|row| route_row(row, self.top_k, &self.per_expert_scale)).collect())
    }

    /// `mlp_out = post_mlp_norm(mlp_out) + post_norm(experts(pre_norm(residual)))`, where
    /// `residual` (`[t, hidden]`) is the layer's input to the feed-forward part.
    pub fn add_to_mlp(&self, residual: &[f32], t: usize, mlp_out: &mut [f32]) -> RtResult<()> {
        let hidden = self.router_scale.len();
        let routes = self.route(residual, t)?;
        let mut x = vec![0f32; residual.len()];
        self.pre_norm.forward(residual, &mut x);
        // Experts in ascending order, each over the tokens routed to it (as transformers sums).
        let mut out = vec![0f32; residual.len()];
        for (e, expert) in self.experts.iter().enumerate() {
            let picked: Vec<(usize, f32)> = routes
                .iter()
                .enumerate()
                .filter_map(|(tok, r)| r.iter().find(|(x, _)| *x == e).map(|(_, w)| (tok, *w)))
                .collect();
            if picked.is_empty() {
                continue;
            }
            let rows: Vec<f32> =
                picked.iter().flat_map(|&(tok, _)| &x[tok * hidden..(tok + 1) * hidden]).copied().collect();
            let mut y = vec![0f32; rows.len()];
            expert.forward(&rows, picked.len(), &mut y, LayerLora::NONE)?;
            for (&(tok, w), y) in picked.iter().zip(y.chunks_exact(hidden)) {
                out[tok * hidden..(tok + 1) * hidden].iter_mut().zip(y).for_each(|(o, v)| *o += v * w);
            }
        }
        self.post_mlp_norm.forward_in_place(mlp_out);
        self.post_norm.forward_in_place(&mut out);
        mlp_out.iter_mut().zip(&out).for_each(|(m, e)| *m += e);
        Ok(())
    }
}
