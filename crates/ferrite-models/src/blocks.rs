//! The building blocks the decoder architectures share, each loaded by its HF tensor names and
//! run on the CPU op set: linear layers, RMSNorm weights, the gated MLP, self-attention over the
//! paged KV cache, the LM head, and the KV layout of a stack of layers.
//!
//! One `Attention` covers every variant the architectures need: GQA with optional biases,
//! q/k norms (qwen3, Gemma 3/4), an unscaled v norm and keys doubling as values (Gemma 4), its
//! own RoPE schedule, sliding window and score softcap, and a KV cache layer that is either its
//! own or a donor layer's (Gemma 4's KV-shared layers compute no keys or values).

use std::sync::{Arc, Mutex, Weak};

use ferrite_runtime::cpu::{self, AttentionParams, Rope};
use ferrite_runtime::kv::KvLayerSpec;
use ferrite_runtime::kv_state::StateSpec;
use ferrite_runtime::{ForwardBatch, KvCache, KvGroupKind, KvLayout, Result as RtResult, Tensor};

use crate::config::{Activation, ModelConfig};
use crate::deltanet::DeltaNetConfig;
use crate::error::Result;
use crate::lora::cpu::LayerLora;
use crate::lora::LoraTarget;
use crate::plan::{LayerNames, MlpNames, NormKind, QkvNames};
use crate::rope_scaling::RopeScaling;
use crate::weights::Weights;

impl Activation {
    /// `gate = act(gate) * up`.
    pub fn gate(self, gate: &mut [f32], up: &[f32]) {
        match self {
            Activation::Silu => cpu::silu_mul(gate, up),
            Activation::GeluTanh => cpu::gelu_tanh_mul(gate, up),
            Activation::Gelu => cpu::activation::gelu_mul(gate, up),
        }
    }

    /// `x = act(x)`.
    pub fn apply(self, x: &mut [f32]) {
        match self {
            Activation::Silu => cpu::activation::silu(x),
            Activation::GeluTanh => cpu::activation::gelu_tanh(x),
            Activation::Gelu => cpu::activation::gelu(x),
        }
    }
}

/// `y = x Wᵀ (+ b)` for a weight of any dtype.
pub struct Linear {
    w: Tensor,
    bias: Option<Vec<f32>>,
}

impl Linear {
    /// `{prefix}.weight` of shape `[out, inp]` (and `{prefix}.bias` when `bias`).
    pub fn load(w: &Weights, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
        let weight = w.get(&format!("{prefix}.weight"), &[out, inp])?;
        cpu::prepare_linear(&weight);
        let bias = if bias { Some(w.get_f32(&format!("{prefix}.bias"), &[out])?) } else { None };
        Ok(Linear { w: weight, bias })
    }

    /// Rows `rows` of `{name}.weight` (`[total, inp]`), and of `{name}.bias` when `bias`: one
    /// projection of a fused tensor (phi3's `qkv_proj`, `gate_up_proj`).
    pub fn load_rows(
        w: &Weights,
        name: &str,
        total: usize,
        inp: usize,
        rows: std::ops::Range<usize>,
        bias: bool,
    ) -> Result<Linear> {
        let full = w.get(&format!("{name}.weight"), &[total, inp])?;
        let weight = full.slice_rows(rows.clone()).map_err(|e| crate::error::LoadError::Other(e.to_string()))?;
        cpu::prepare_linear(&weight);
        let bias = if bias { Some(w.get_f32(&format!("{name}.bias"), &[total])?[rows].to_vec()) } else { None };
        Ok(Linear { w: weight, bias })
    }

    pub fn from_tensor(w: Tensor) -> Linear {
        Linear { w, bias: None }
    }

    pub fn out_features(&self) -> usize {
        self.w.rows()
    }

    pub fn in_features(&self) -> usize {
        self.w.row_len()
    }

    /// (in, out) features.
    fn features(&self) -> (usize, usize) {
        (self.in_features(), self.out_features())
    }

    /// `x` is `[t, in]`; returns `[t, out]`.
    pub fn forward(&self, x: &[f32], t: usize) -> RtResult<Vec<f32>> {
        let mut out = vec![0f32; t * self.out_features()];
        self.forward_into(x, t, &mut out)?;
        Ok(out)
    }

    pub fn forward_into(&self, x: &[f32], t: usize, out: &mut [f32]) -> RtResult<()> {
        cpu::linear(x, t, &self.w, self.bias.as_deref(), out)
    }

    /// `[t, out]` of each of `linears`, which read the same `x` (`[t, in]`), in one
    /// `cpu::linear_many` (one quantization of `x`, one parallel loop).
    pub fn forward_many<const N: usize>(linears: [&Linear; N], x: &[f32], t: usize) -> RtResult<[Vec<f32>; N]> {
        let mut outs = linears.map(|l| vec![0f32; t * l.out_features()]);
        let ws: Vec<_> = linears.iter().map(|l| (&l.w, l.bias.as_deref())).collect();
        let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
        cpu::linear_many(x, t, &ws, &mut refs)?;
        Ok(outs)
    }
}

/// A norm over rows of its width: RMSNorm with the multiplier the model applies (see
/// `Weights::norm`), or LayerNorm when it has a bias.
pub struct Norm {
    weight: Vec<f32>,
    /// LayerNorm's bias (None: RMSNorm).
    bias: Option<Vec<f32>>,
    eps: f32,
}

impl Norm {
    /// The RMSNorm weight `name` (`offset + w` applied).
    pub fn load(w: &Weights, name: &str, dim: usize, offset: f32, eps: f32) -> Result<Norm> {
        Ok(Norm { weight: w.norm(name, dim, offset)?, bias: None, eps })
    }

    /// The norm `{prefix}.weight` of a model whose norms are `kind`: with `{prefix}.bias` for
    /// LayerNorm.
    pub fn load_kind(w: &Weights, prefix: &str, dim: usize, kind: NormKind, eps: f32) -> Result<Norm> {
        match kind {
            NormKind::Rms { offset } => Norm::load(w, &format!("{prefix}.weight"), dim, offset, eps),
            NormKind::Layer => Ok(Norm {
                weight: w.get_f32(&format!("{prefix}.weight"), &[dim])?,
                bias: Some(w.get_f32(&format!("{prefix}.bias"), &[dim])?),
                eps,
            }),
        }
    }

    /// An RMSNorm without a learned scale.
    pub fn unit(dim: usize, eps: f32) -> Norm {
        Norm { weight: vec![1.0; dim], bias: None, eps }
    }

    pub fn forward(&self, x: &[f32], out: &mut [f32]) {
        match &self.bias {
            None => cpu::rms_norm(x, &self.weight, self.eps, 0.0, out),
            Some(b) => cpu::layer_norm(x, &self.weight, b, self.eps, out),
        }
    }

    pub fn forward_in_place(&self, x: &mut [f32]) {
        match &self.bias {
            None => cpu::rms_norm_in_place(x, &self.weight, self.eps, 0.0),
            Some(b) => {
                let input = x.to_vec();
                cpu::layer_norm(&input, &self.weight, b, self.eps, x);
            }
        }
    }

    /// `x += residual`, then `forward(x, out)`, in one pass.
    pub fn forward_add(&self, x: &mut [f32], residual: &[f32], out: &mut [f32]) {
        match &self.bias {
            None => cpu::add_rms_norm(x, residual, &self.weight, self.eps, 0.0, out),
            Some(b) => cpu::add_layer_norm(x, residual, &self.weight, b, self.eps, out),
        }
    }
}

/// The MLP: gated, `down(act(gate(x)) * up(x))`, or plain, `down(act(up(x)))`.
pub struct Mlp {
    gate: Option<Linear>,
    up: Linear,
    down: Linear,
    act: Activation,
}

impl Mlp {
    /// The MLP of a layer stored as `names` says, `inter` wide, with biases when `bias`.
    pub fn load(
        w: &Weights,
        names: &MlpNames,
        hidden: usize,
        inter: usize,
        act: Activation,
        bias: bool,
    ) -> Result<Mlp> {
        let (gate, up, down) = match names {
            MlpNames::Gated { gate, up, down } => {
                (Some(Linear::load(w, gate, inter, hidden, bias)?), Linear::load(w, up, inter, hidden, bias)?, down)
            }
            MlpNames::FusedGated { gate_up, down } => (
                Some(Linear::load_rows(w, gate_up, 2 * inter, hidden, 0..inter, bias)?),
                Linear::load_rows(w, gate_up, 2 * inter, hidden, inter..2 * inter, bias)?,
                down,
            ),
            MlpNames::Plain { up, down } => (None, Linear::load(w, up, inter, hidden, bias)?, down),
        };
        Ok(Mlp { gate, up, down: Linear::load(w, down, hidden, inter, bias)?, act })
    }

    /// A gated MLP of these projections (a MoE expert).
    pub fn gated(gate: Linear, up: Linear, down: Linear, act: Activation) -> Mlp {
        Mlp { gate: Some(gate), up, down, act }
    }

    /// `x` is `[t, hidden]`; writes `[t, hidden]` into `out`, each projection with the
    /// update of the tokens `lora` adapts.
    pub fn forward(&self, x: &[f32], t: usize, out: &mut [f32], lora: LayerLora<'_>) -> RtResult<()> {
        let act = match &self.gate {
            Some(gate) => {
                let [mut gate, mut up] = Linear::forward_many([gate, &self.up], x, t)?;
                lora.add(LoraTarget::Gate, x, &mut gate)?;
                lora.add(LoraTarget::Up, x, &mut up)?;
                self.act.gate(&mut gate, &up);
                gate
            }
            None => {
                let mut up = self.up.forward(x, t)?;
                lora.add(LoraTarget::Up, x, &mut up)?;
                self.act.apply(&mut up);
                up
            }
        };
        self.down.forward_into(&act, t, out)?;
        lora.add(LoraTarget::Down, &act, out)
    }

    /// (in, out) features of the projection `target`, if the MLP has it.
    pub fn features(&self, target: LoraTarget) -> Option<(usize, usize)> {
        match target {
            LoraTarget::Gate => self.gate.as_ref().map(Linear::features),
            LoraTarget::Up => Some(self.up.features()),
            LoraTarget::Down => Some(self.down.features()),
            _ => None,
        }
    }
}

/// A layer's RoPE: fixed frequencies (with their table of angles, shared by every layer of
/// the same schedule), or (dynamic NTK) frequencies per row length.
struct LayerRope {
    scaling: RopeScaling,
    fixed: Option<Arc<Rope>>,
}

impl LayerRope {
    fn new(scaling: RopeScaling) -> LayerRope {
        let fixed = (!scaling.is_dynamic()).then(|| shared_rope(&scaling));
        LayerRope { scaling, fixed }
    }

    /// Rotate each `(x, heads)` (`x` is `[tokens, heads * head_dim]`).
    fn apply(&self, xs: &mut [(&mut [f32], usize)], batch: &ForwardBatch, hd: usize) {
        if let Some(rope) = &self.fixed {
            rope.apply_all(xs, &batch.positions, hd);
            return;
        }
        for row in &batch.rows {
            let span = row.query_start..row.query_start + row.query_len;
            let rope = self.scaling.rope_for(row.context_len);
            let mut spans: Vec<(&mut [f32], usize)> = (xs.iter_mut())
                .map(|(x, heads)| (&mut x[span.start * *heads * hd..span.end * *heads * hd], *heads))
                .collect();
            rope.apply_all(&mut spans, &batch.positions[span.clone()], hd);
        }
    }
}

/// The fixed `Rope` of `scaling`, one per schedule while any layer holds it, so a model's
/// layers share one table of angles.
fn shared_rope(scaling: &RopeScaling) -> Arc<Rope> {
    static LIVE: Mutex<Vec<(RopeScaling, Weak<Rope>)>> = Mutex::new(Vec::new());
    let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    live.retain(|(_, r)| r.strong_count() > 0);
    if let Some(rope) = live.iter().find(|(s, _)| s == scaling).and_then(|(_, r)| r.upgrade()) {
        return rope;
    }
    let base = scaling.rope_for(0);
    let rope = Arc::new(Rope::tabled(base.inv_freq, base.attention_scaling));
    live.push((scaling.clone(), Arc::downgrade(&rope)));
    rope
}

/// How one layer's self-attention is built.
pub struct AttentionConfig {
    /// Heads, head_dim, score scale, sliding window and softcap.
    pub params: AttentionParams,
    pub rope: RopeScaling,
    /// Biases on the q/k/v projections.
    pub bias: bool,
    /// RMSNorm on q and k before RoPE, with this norm offset: per head, or (`qk_norm_whole`,
    /// olmo2) over each token's whole projection.
    pub qk_norm: Option<f32>,
    pub qk_norm_whole: bool,
    /// A bias on the output projection (starcoder2).
    pub o_bias: bool,
    /// Unscaled per-head RMSNorm on v (Gemma 4).
    pub v_norm: bool,
    /// No v projection: the (un-normed) keys are the values (Gemma 4 `attention_k_eq_v`).
    pub k_eq_v: bool,
    /// Reads the KV of another layer and computes none (Gemma 4 KV-shared layers).
    pub shared: bool,
    /// The KV cache layer it writes (unless shared) and reads.
    pub kv_index: usize,
    pub eps: f32,
    /// A sigmoid gate on the attention output, per channel: each q head's projection rows are
    /// `[q, gate]` (Qwen3-Next, Qwen3.5).
    pub output_gate: bool,
    /// Linear attention in place of softmax attention: gated DeltaNet over a recurrent state
    /// slot (`deltanet`); the softmax fields above are then unused.
    pub linear: Option<DeltaNetConfig>,
}

/// The projections of a layer that computes its own keys and values.
struct KvProjection {
    k: Linear,
    /// None: the keys are the values.
    v: Option<Linear>,
    k_norm: Option<Norm>,
    v_norm: Option<Norm>,
}

pub struct Attention {
    q: Linear,
    q_norm: Option<Norm>,
    /// None for a layer that reads its donor's KV.
    kv: Option<KvProjection>,
    o: Linear,
    rope: LayerRope,
    params: AttentionParams,
    kv_index: usize,
    output_gate: bool,
}

impl Attention {
    /// The projections and q/k norms `names` gives of a layer with `hidden` inputs.
    pub fn load(w: &Weights, names: &LayerNames, hidden: usize, c: AttentionConfig) -> Result<Attention> {
        let (nh, nkv, hd) = (c.params.n_heads, c.params.n_kv_heads, c.params.head_dim);
        let norm = |name: &str, heads: usize| -> Result<Option<Norm>> {
            let dim = if c.qk_norm_whole { heads * hd } else { hd };
            c.qk_norm.map(|offset| Norm::load(w, &format!("{name}.weight"), dim, offset, c.eps)).transpose()
        };
        // A gated layer's q rows hold each head's q and then its gate.
        let (q_rows, kv_rows) = (nh * hd * if c.output_gate { 2 } else { 1 }, nkv * hd);
        let proj = |which: usize| -> Result<Linear> {
            match &names.qkv {
                QkvNames::Separate { q, k, v } => {
                    let (name, rows) = [(q, q_rows), (k, kv_rows), (v, kv_rows)][which];
                    Linear::load(w, name, rows, hidden, c.bias)
                }
                QkvNames::Fused(name) => {
                    let starts = [0, q_rows, q_rows + kv_rows, q_rows + 2 * kv_rows];
                    Linear::load_rows(w, name, starts[3], hidden, starts[which]..starts[which + 1], c.bias)
                }
            }
        };
        let kv = if c.shared {
            None
        } else {
            Some(KvProjection {
                k: proj(1)?,
                v: if c.k_eq_v { None } else { Some(proj(2)?) },
                k_norm: norm(&names.k_norm, nkv)?,
                v_norm: c.v_norm.then(|| Norm::unit(hd, c.eps)),
            })
        };
        Ok(Attention {
            q: proj(0)?,
            q_norm: norm(&names.q_norm, nh)?,
            kv,
            o: Linear::load(w, &names.o, hidden, nh * hd, c.o_bias)?,
            rope: LayerRope::new(c.rope),
            params: c.params,
            kv_index: c.kv_index,
            output_gate: c.output_gate,
        })
    }

    /// The offset a quantized K pool stores this layer's keys less (`KvCache::set_key_offsets`,
    /// `[n_kv_heads][head_dim]`): what every key shares, its k bias as RoPE leaves it on average
    /// over `context` positions — whole in channels that barely turn, nothing in those that
    /// turn many times. None without a k bias, with k norms (they rescale the bias per token)
    /// or a score softcap (the shift would not cancel), and for a layer that reads another's KV.
    pub fn key_offset(&self, context: usize) -> Option<Vec<f32>> {
        let kv = self.kv.as_ref().filter(|kv| kv.k_norm.is_none() && self.params.softcap.is_none())?;
        let bias = kv.k.bias.as_ref()?;
        let rope = self.rope.scaling.rope_for(0);
        let (hd, half, scale) = (self.params.head_dim, rope.inv_freq.len(), f64::from(rope.attention_scaling));
        // The mean of cos and sin of p·f over p in 0..context.
        let p = context.max(1) as f64;
        let means: Vec<(f64, f64)> = (rope.inv_freq.iter())
            .map(|&f| {
                let f = f64::from(f);
                let ratio = if (f / 2.0).sin().abs() < 1e-12 { p } else { (p * f / 2.0).sin() / (f / 2.0).sin() };
                let mid = (p - 1.0) * f / 2.0;
                (ratio * mid.cos() / p, ratio * mid.sin() / p)
            })
            .collect();
        let mut out = bias.clone();
        for (o, b) in out.chunks_mut(hd).zip(bias.chunks(hd)) {
            for (i, &(c, s)) in means.iter().enumerate() {
                let (x, y) = (f64::from(b[i]), f64::from(b[i + half]));
                o[i] = (scale * (x * c - y * s)) as f32;
                o[i + half] = (scale * (y * c + x * s)) as f32;
            }
        }
        Some(out)
    }

    /// The KV cache layer it writes (None: it reads another layer's).
    pub fn writes_kv(&self) -> Option<usize> {
        self.kv.as_ref().map(|_| self.kv_index)
    }

    /// (in, out) features of the projection `target`, if the layer computes it.
    pub fn features(&self, target: LoraTarget) -> Option<(usize, usize)> {
        match target {
            LoraTarget::Q => Some(self.q.features()),
            LoraTarget::K => self.kv.as_ref().map(|kv| kv.k.features()),
            LoraTarget::V => self.kv.as_ref().and_then(|kv| kv.v.as_ref()).map(Linear::features),
            LoraTarget::O => Some(self.o.features()),
            _ => None,
        }
    }

    /// `h` is `[t, hidden]`; writes this layer's K/V (unless shared), attends over its KV cache
    /// layer and writes the output projection `[t, hidden]` into `out`; each projection gets
    /// the update of the tokens `lora` adapts.
    pub fn forward(
        &self,
        h: &[f32],
        batch: &ForwardBatch,
        kv: &mut KvCache,
        out: &mut [f32],
        lora: LayerLora<'_>,
    ) -> RtResult<()> {
        let t = batch.num_tokens();
        let p = &self.params;
        // q, k and v read the same input: one call quantizes it once.
        let (mut q, new_kv) = match &self.kv {
            Some(KvProjection { k, v: Some(v), .. }) => {
                let [mut q, mut keys, mut values] = Linear::forward_many([&self.q, k, v], h, t)?;
                lora.add(LoraTarget::K, h, &mut keys)?;
                lora.add(LoraTarget::V, h, &mut values)?;
                lora.add(LoraTarget::Q, h, &mut q)?;
                (q, Some((keys, values)))
            }
            Some(KvProjection { k, v: None, .. }) => {
                let [mut q, mut keys] = Linear::forward_many([&self.q, k], h, t)?;
                lora.add(LoraTarget::K, h, &mut keys)?;
                lora.add(LoraTarget::Q, h, &mut q)?;
                let values = keys.clone();
                (q, Some((keys, values)))
            }
            None => {
                let mut q = self.q.forward(h, t)?;
                lora.add(LoraTarget::Q, h, &mut q)?;
                (q, None)
            }
        };
        let gate = if self.output_gate { Some(split_gate(&mut q, p.n_heads, p.head_dim)) } else { None };
        if let Some(n) = &self.q_norm {
            n.forward_in_place(&mut q);
        }
        let block_size = kv.block_size();
        let layer = kv.layer_mut(self.kv_index)?;
        if let (Some(KvProjection { k_norm, v_norm, .. }), Some((mut keys, mut values))) = (&self.kv, new_kv) {
            if let Some(n) = k_norm {
                n.forward_in_place(&mut keys);
            }
            if let Some(n) = v_norm {
                n.forward_in_place(&mut values);
            }
            // Queries and keys at the same positions: their angles are computed once.
            self.rope.apply(&mut [(&mut q, p.n_heads), (&mut keys, p.n_kv_heads)], batch, p.head_dim);
            cpu::write_kv(&keys, &values, batch, layer, block_size)?;
        } else {
            self.rope.apply(&mut [(&mut q, p.n_heads)], batch, p.head_dim);
        }
        let mut attn = vec![0f32; t * p.n_heads * p.head_dim];
        cpu::paged_attention(&q, batch, layer, block_size, p, &mut attn)?;
        if let Some(gate) = gate {
            attn.iter_mut().zip(&gate).for_each(|(a, g)| *a /= 1.0 + (-g).exp());
        }
        self.o.forward_into(&attn, t, out)?;
        lora.add(LoraTarget::O, &attn, out)
    }
}

/// Split each head's `[q, gate]` rows of `q` (`[t, heads * 2 * hd]`) in place: `q` keeps the
/// queries (`[t, heads * hd]`); returns the gates, the same shape.
fn split_gate(q: &mut Vec<f32>, heads: usize, hd: usize) -> Vec<f32> {
    let mut gate = Vec::with_capacity(q.len() / 2);
    let mut queries = Vec::with_capacity(q.len() / 2);
    for head in q.chunks_exact(2 * hd) {
        queries.extend_from_slice(&head[..hd]);
        gate.extend_from_slice(&head[hd..]);
    }
    debug_assert_eq!(queries.len() % (heads * hd), 0);
    *q = queries;
    gate
}

/// The token embedding, times `scale` (Gemma's `sqrt(hidden)`) when given.
pub fn embed(table: &Tensor, tokens: &[u32], scale: Option<f32>) -> RtResult<Vec<f32>> {
    let mut x = vec![0f32; tokens.len() * table.row_len()];
    cpu::embedding(table, tokens, &mut x)?;
    if let Some(s) = scale {
        x.iter_mut().for_each(|v| *v *= s);
    }
    Ok(x)
}

pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// The final norm (none for a post-LN encoder), the output projection and an optional logit
/// softcap.
pub struct LmHead {
    norm: Option<Norm>,
    w: Tensor,
    /// Multiplies the logits (granite's `1 / logits_scaling`).
    scale: Option<f32>,
    softcap: Option<f32>,
}

impl LmHead {
    /// The final norm `norm` and `lm_head` (or the embedding `embed` when tied and absent).
    pub fn load(
        w: &Weights,
        cfg: &ModelConfig,
        embed: &Tensor,
        norm: Option<Norm>,
        scale: Option<f32>,
        softcap: Option<f32>,
    ) -> Result<LmHead> {
        let head = if cfg.tie_word_embeddings && !w.contains("lm_head.weight") {
            embed.clone()
        } else {
            w.get("lm_head.weight", &[cfg.vocab_size, cfg.hidden_size])?
        };
        cpu::prepare_linear(&head);
        Ok(LmHead { norm, w: head, scale, softcap })
    }

    /// The final norm of every row of `x` (`[t, hidden]`): the model's output states.
    pub fn norm_rows(&self, x: Vec<f32>) -> Vec<f32> {
        let Some(norm) = &self.norm else { return x };
        let mut normed = vec![0f32; x.len()];
        norm.forward(&x, &mut normed);
        normed
    }

    /// Logits `[logits_indices.len(), vocab]` of the rows of `x` (`[t, hidden]`) the batch asks for.
    pub fn logits(&self, x: &[f32], batch: &ForwardBatch) -> RtResult<Vec<f32>> {
        let d = self.w.row_len();
        let n = batch.logits_indices.len();
        if n == 0 {
            // A prefill chunk that ends no prompt.
            return Ok(Vec::new());
        }
        let mut picked = Vec::with_capacity(n * d);
        for &idx in &batch.logits_indices {
            picked.extend_from_slice(&x[idx * d..(idx + 1) * d]);
        }
        let normed = self.norm_rows(picked);
        let mut logits = vec![0f32; n * self.w.rows()];
        cpu::linear(&normed, n, &self.w, None, &mut logits)?;
        if let Some(s) = self.scale {
            logits.iter_mut().for_each(|v| *v *= s);
        }
        if let Some(cap) = self.softcap {
            cpu::activation::softcap(&mut logits, cap);
        }
        Ok(logits)
    }
}

/// What one layer needs from the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKv {
    /// Its own keys and values, in a group of this kind.
    Own { kind: KvGroupKind, n_kv_heads: usize, head_dim: usize },
    /// The KV of an earlier layer (by model layer index), which must own its KV.
    Donor(usize),
    /// A recurrent state (linear attention) of this shape, in the recurrent group's slots.
    State(StateShape),
}

/// The shape of a linear-attention layer's state (`kv_state::StateSpec` without its group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateShape {
    pub conv_channels: usize,
    pub conv_kernel: usize,
    pub heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
}

/// The KV layout of a layer stack and, per model layer, the KV cache layer it reads (for a
/// state layer: its index in `KvLayout::states`). Groups are full attention first, then one
/// per sliding window in order of appearance, then the recurrent group of all state layers.
pub fn kv_layout(layers: &[LayerKv]) -> std::result::Result<(KvLayout, Vec<usize>), String> {
    let mut groups: Vec<KvGroupKind> = Vec::new();
    let kinds = layers.iter().filter_map(|l| match l {
        LayerKv::Own { kind, .. } => Some(*kind),
        LayerKv::Donor(_) | LayerKv::State(_) => None,
    });
    let (full, sliding): (Vec<_>, Vec<_>) = kinds.partition(|k| *k == KvGroupKind::Full);
    for kind in full.into_iter().chain(sliding) {
        if !groups.contains(&kind) {
            groups.push(kind);
        }
    }
    if layers.iter().any(|l| matches!(l, LayerKv::State(_))) {
        groups.push(KvGroupKind::Recurrent);
    }
    let (mut specs, mut states) = (Vec::new(), Vec::new());
    let mut index = Vec::with_capacity(layers.len());
    for (i, l) in layers.iter().enumerate() {
        match *l {
            LayerKv::Own { kind: KvGroupKind::Recurrent, .. } => {
                return Err(format!("layer {i}: a recurrent group holds states, not keys and values"))
            }
            LayerKv::Own { kind, n_kv_heads, head_dim } => {
                let group = groups.iter().position(|g| *g == kind).unwrap_or(0);
                index.push(specs.len());
                specs.push(KvLayerSpec { n_kv_heads, head_dim, group });
            }
            LayerKv::State(s) => {
                let group = groups.len() - 1;
                index.push(states.len());
                states.push(StateSpec {
                    conv_channels: s.conv_channels,
                    conv_kernel: s.conv_kernel,
                    heads: s.heads,
                    k_dim: s.k_dim,
                    v_dim: s.v_dim,
                    group,
                });
            }
            LayerKv::Donor(d) if d < i && matches!(layers[d], LayerKv::Own { .. }) => index.push(index[d]),
            LayerKv::Donor(d) => return Err(format!("layer {i} reads the KV of layer {d}, which owns none before it")),
        }
    }
    Ok((KvLayout { groups, layers: specs, states }, index))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_puts_full_first_and_maps_donors() {
        let sliding = KvGroupKind::Sliding { window: 8 };
        let layers = [
            LayerKv::Own { kind: sliding, n_kv_heads: 2, head_dim: 16 },
            LayerKv::Own { kind: KvGroupKind::Full, n_kv_heads: 1, head_dim: 32 },
            LayerKv::Own { kind: sliding, n_kv_heads: 2, head_dim: 16 },
            LayerKv::Donor(2),
            LayerKv::Donor(1),
        ];
        let (layout, index) = kv_layout(&layers).expect("layout");
        assert_eq!(layout.groups, vec![KvGroupKind::Full, sliding]);
        assert_eq!(layout.layers.iter().map(|l| l.group).collect::<Vec<_>>(), vec![1, 0, 1]);
        assert_eq!(index, vec![0, 1, 2, 2, 1]);
        assert!(kv_layout(&[LayerKv::Donor(0)]).is_err());
    }

    #[test]
    fn state_layers_share_one_recurrent_group_after_the_attention_groups() {
        let state = StateShape { conv_channels: 24, conv_kernel: 4, heads: 2, k_dim: 4, v_dim: 8 };
        let full = LayerKv::Own { kind: KvGroupKind::Full, n_kv_heads: 1, head_dim: 16 };
        let (layout, index) = kv_layout(&[LayerKv::State(state), LayerKv::State(state), full]).expect("layout");
        assert_eq!(layout.groups, vec![KvGroupKind::Full, KvGroupKind::Recurrent]);
        assert_eq!(index, vec![0, 1, 0]);
        assert_eq!(layout.states.len(), 2);
        assert!(layout.states.iter().all(|s| s.group == 1 && s.conv_channels == 24));
        assert_eq!(layout.recurrent_group(), Some(1));
    }
}
