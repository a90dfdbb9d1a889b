//! Routed mixtures of experts on the CPU: the feed-forward kind a `MoePlan` describes.
//!
//! A router (a linear layer, softmax) picks each token's top-k experts; their probabilities are
//! renormalized to sum to 1 where the family says so. Each expert is a gated MLP. The experts
//! run one at a time, each over the rows of the tokens routed to it (gathered into one batch,
//! so each chosen expert's weights are read once per step, by the same matmul kernels as every
//! other layer, quantized or not), and their outputs are scattered back, times the routing
//! weights, in ascending expert order: a token's result does not depend on the tokens it is
//! batched with.
//!
//! Qwen3-MoE and Mixtral (`MoeStyle::Sparse`) replace the dense MLP with the experts. Gemma 4
//! (`MoeStyle::Gemma4`) runs them beside it: its router reads the residual, unit-RMSNormed,
//! times a learned per-channel scale and `1/sqrt(hidden)`, and multiplies each chosen weight
//! by a learned per-expert scale; the experts read their own norm of the residual, and the
//! normed outputs of the dense MLP and of the experts are summed.
//!
//! Expert weights load from any of the layouts `ExpertNames` lists (`ExpertLayout`): stacked
//! `gate_up_proj` / `down_proj` tensors (transformers 5, Gemma 4), GGUF's stacked
//! `ffn_{gate,up,down}_exps`, or one tensor per expert and projection (Hugging Face
//! checkpoints of Qwen3-MoE and Mixtral).

use std::collections::HashMap;

use ferrite_runtime::{cpu, Result as RtResult, RuntimeError, Tensor};

use crate::blocks::{Linear, Mlp, Norm};
use crate::config::Activation;
use crate::error::{LoadError, Result};
use crate::lora::cpu::LayerLora;
use crate::plan::{ExpertNames, MoePlan, MoeStyle};
use crate::weights::Weights;

mod layout;

pub use layout::{ExpertLayout, ExpertRows, Projection};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    pub num_experts: usize,
    pub top_k: usize,
    /// Width of each expert's MLP (`moe_intermediate_size`).
    pub intermediate: usize,
}

impl MoeShape {
    /// A shape with at least one expert, `top_k` of them at most, each of a positive width.
    pub fn checked(num_experts: usize, top_k: usize, intermediate: usize) -> std::result::Result<MoeShape, String> {
        if num_experts == 0 || top_k == 0 || intermediate == 0 {
            return Err(format!(
                "experts {num_experts}, experts per token {top_k}, expert width {intermediate}: each must be positive"
            ));
        }
        if top_k > num_experts {
            return Err(format!("{top_k} experts per token of {num_experts} experts"));
        }
        Ok(MoeShape { num_experts, top_k, intermediate })
    }
}

/// One token's route from its router logits (`scores`, one per expert, softmaxed in place):
/// its `top_k` (expert, weight) pairs, best first, the weights divided by their sum when
/// `renormalize`, and times `per_expert_scale` when given. The CPU model routes with it; the
/// CUDA kernel `moe_route` makes the same choice on the device.
pub fn route_row(
    scores: &mut [f32],
    top_k: usize,
    renormalize: bool,
    per_expert_scale: Option<&[f32]>,
) -> Vec<(usize, f32)> {
    cpu::softmax_in_place(scores);
    let mut order: Vec<usize> = (0..scores.len()).collect();
    // Stable: equal probabilities keep the lower expert first.
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    let top = &order[..top_k.min(scores.len())];
    let sum: f32 = if renormalize { top.iter().map(|&i| scores[i]).sum() } else { 1.0 };
    let scale = |i: usize| per_expert_scale.map_or(1.0, |s| s[i]);
    top.iter().map(|&i| (i, scores[i] / sum * scale(i))).collect()
}

/// A layer's experts, each a gated MLP over rows of the stored tensors.
pub struct Experts {
    experts: Vec<Mlp>,
    hidden: usize,
}

impl Experts {
    /// The experts `names` gives, in whichever layout the file stores them (`ExpertLayout`),
    /// each projection a row slice of its stored tensor.
    pub fn load(w: &Weights, names: &ExpertNames, shape: MoeShape, hidden: usize, act: Activation) -> Result<Experts> {
        let layout = ExpertLayout::find(w, names, shape, hidden)?;
        // Each stored tensor once (a stacked one holds every expert).
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        let mut linear = |e: usize, p: Projection| -> Result<Linear> {
            let at = layout.rows(e, p);
            let t = match tensors.get(&at.name) {
                Some(t) => t.clone(),
                None => {
                    let t = w.get(&at.name, &at.shape)?;
                    tensors.insert(at.name.clone(), t.clone());
                    t
                }
            };
            let part = if at.rows == (0..t.rows()) {
                t
            } else {
                t.slice_rows(at.rows).map_err(|err| LoadError::Other(format!("{}: {err}", at.name)))?
            };
            cpu::prepare_linear(&part);
            Ok(Linear::from_tensor(part))
        };
        let experts = (0..shape.num_experts)
            .map(|e| {
                let (gate, up) = (linear(e, Projection::Gate)?, linear(e, Projection::Up)?);
                Ok(Mlp::gated(gate, up, linear(e, Projection::Down)?, act))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Experts { experts, hidden })
    }

    fn len(&self) -> usize {
        self.experts.len()
    }

    /// `out[t] = Σ w · expert_e(x[t])` over token `t`'s route `routes[t]` of (expert, weight)
    /// pairs, summed in ascending expert order; `x` and `out` are `[tokens, hidden]`. Each
    /// expert runs once, over the gathered rows of the tokens routed to it.
    pub fn mix(&self, x: &[f32], routes: &[Vec<(usize, f32)>], out: &mut [f32]) -> RtResult<()> {
        let d = self.hidden;
        if x.len() != routes.len() * d || out.len() != x.len() {
            return Err(RuntimeError::Shape(format!(
                "experts of width {d}: {} inputs, {} outputs for {} routes",
                x.len(),
                out.len(),
                routes.len()
            )));
        }
        let mut picked: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.experts.len()];
        for (tok, route) in routes.iter().enumerate() {
            for &(e, w) in route {
                let slot = picked.get_mut(e).ok_or_else(|| RuntimeError::Shape(format!("no expert {e}")))?;
                slot.push((tok, w));
            }
        }
        out.fill(0.0);
        let mut rows = Vec::new();
        let mut y = Vec::new();
        for (expert, picked) in self.experts.iter().zip(&picked) {
            if picked.is_empty() {
                continue;
            }
            rows.clear();
            rows.extend(picked.iter().flat_map(|&(tok, _)| &x[tok * d..(tok + 1) * d]));
            y.resize(rows.len(), 0.0);
            expert.forward(&rows, picked.len(), &mut y, LayerLora::NONE)?;
            for (&(tok, w), y) in picked.iter().zip(y.chunks_exact(d)) {
                out[tok * d..(tok + 1) * d].iter_mut().zip(y).for_each(|(o, v)| *o += v * w);
            }
        }
        Ok(())
    }
}

/// Gemma 4's router input scale, per-expert scales and the norms around its experts.
struct Gemma4Parts {
    router_norm: Norm,
    /// The router input's learned per-channel scale, times `hidden^-1/2`.
    router_scale: Vec<f32>,
    per_expert_scale: Vec<f32>,
    /// Norms the dense MLP's output (`post_feedforward_layernorm_1`).
    post_mlp_norm: Norm,
    /// Norms the experts' input (`pre_feedforward_layernorm_2`).
    pre_norm: Norm,
    /// Norms the experts' output (`post_feedforward_layernorm_2`).
    post_norm: Norm,
}

/// A shared expert and its optional sigmoid gate (`[hidden]`).
struct Shared {
    mlp: Mlp,
    gate: Option<Vec<f32>>,
}

pub struct Moe {
    router: Linear,
    top_k: usize,
    renormalize: bool,
    experts: Experts,
    gemma4: Option<Gemma4Parts>,
    shared: Option<Shared>,
}

impl Moe {
    /// The router and experts `plan` names, of layer `layer` (`model.layers.N`, for Gemma 4's
    /// router scales and norms).
    pub fn load(w: &Weights, plan: &MoePlan, layer: &str, hidden: usize, act: Activation, eps: f32) -> Result<Moe> {
        let e = plan.shape.num_experts;
        let gemma4 = match plan.style {
            MoeStyle::Sparse => None,
            MoeStyle::Gemma4 => {
                let p = |s: &str| format!("{layer}.{s}");
                let norm = |s: &str| Norm::load(w, &p(&format!("{s}.weight")), hidden, 0.0, eps);
                let root = (hidden as f64).powf(-0.5) as f32;
                let scale = w.get_f32(&p("router.scale"), &[hidden])?;
                Some(Gemma4Parts {
                    router_norm: Norm::unit(hidden, eps),
                    router_scale: scale.iter().map(|s| s * root).collect(),
                    per_expert_scale: w.get_f32(&p("router.per_expert_scale"), &[e])?,
                    post_mlp_norm: norm("post_feedforward_layernorm_1")?,
                    pre_norm: norm("pre_feedforward_layernorm_2")?,
                    post_norm: norm("post_feedforward_layernorm_2")?,
                })
            }
        };
        let shared = match &plan.shared {
            Some(s) => Some(Shared {
                mlp: Mlp::load(w, &s.mlp, hidden, s.intermediate, act, false)?,
                gate: s
                    .gate
                    .as_ref()
                    .map(|g| {
                        let name = format!("{g}.weight");
                        // A GGUF file may store the `[1, hidden]` gate as a vector.
                        w.get_f32(&name, &[1, hidden]).or_else(|_| w.get_f32(&name, &[hidden]))
                    })
                    .transpose()?,
            }),
            None => None,
        };
        Ok(Moe {
            shared,
            router: Linear::load(w, &plan.names.router, e, hidden, false)?,
            top_k: plan.shape.top_k,
            renormalize: plan.renormalize,
            experts: Experts::load(w, &plan.names, plan.shape, hidden, act)?,
            gemma4,
        })
    }

    /// Each token's `top_k` (expert, weight) pairs, best first, from the router input `x`
    /// (`[t, hidden]`).
    fn route(&self, x: &[f32], t: usize) -> RtResult<Vec<Vec<(usize, f32)>>> {
        let mut scores = self.router.forward(x, t)?;
        let e = self.experts.len();
        let scale = self.gemma4.as_ref().map(|g| g.per_expert_scale.as_slice());
        Ok(scores.chunks_exact_mut(e).map(|row| route_row(row, self.top_k, self.renormalize, scale)).collect())
    }

    /// `out += sigmoid(gate · h) · shared(h)` per token, with a shared expert.
    fn add_shared(&self, h: &[f32], t: usize, out: &mut [f32]) -> RtResult<()> {
        let Some(s) = &self.shared else { return Ok(()) };
        let d = self.experts.hidden;
        let mut y = vec![0f32; out.len()];
        s.mlp.forward(h, t, &mut y, LayerLora::NONE)?;
        for ((o, y), x) in out.chunks_exact_mut(d).zip(y.chunks_exact(d)).zip(h.chunks_exact(d)) {
            let scale = match &s.gate {
                Some(g) => 1.0 / (1.0 + (-x.iter().zip(g).map(|(a, b)| a * b).sum::<f32>()).exp()),
                None => 1.0,
            };
            o.iter_mut().zip(y).for_each(|(o, y)| *o += scale * y);
        }
        Ok(())
    }

    /// The layer's feed-forward output: `out = experts(h)` (plus the shared expert's share) for a sparse layer, where `h`
    /// (`[t, hidden]`) is its normed input; for Gemma 4 `out` holds the dense MLP's output and
    /// becomes `post_mlp_norm(out) + post_norm(experts(pre_norm(residual)))`, where `residual`
    /// is the layer's input to the feed-forward part.
    pub fn forward(&self, h: &[f32], residual: &[f32], t: usize, out: &mut [f32]) -> RtResult<()> {
        let Some(g) = &self.gemma4 else {
            let routes = self.route(h, t)?;
            self.experts.mix(h, &routes, out)?;
            return self.add_shared(h, t, out);
        };
        let mut x = vec![0f32; residual.len()];
        g.router_norm.forward(residual, &mut x);
        for row in x.chunks_exact_mut(g.router_scale.len()) {
            row.iter_mut().zip(&g.router_scale).for_each(|(v, s)| *v *= s);
        }
        let routes = self.route(&x, t)?;
        g.pre_norm.forward(residual, &mut x);
        let mut mixed = vec![0f32; residual.len()];
        self.experts.mix(&x, &routes, &mut mixed)?;
        g.post_mlp_norm.forward_in_place(out);
        g.post_norm.forward_in_place(&mut mixed);
        out.iter_mut().zip(&mixed).for_each(|(m, e)| *m += e);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
