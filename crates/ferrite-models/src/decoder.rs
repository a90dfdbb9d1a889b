//! `Decoder`: the CPU executor of a `DecoderPlan`, for every family.
//!
//! A step: the first residual stream (`input`: the token embedding, scaled when the plan says
//! so, or an encoder's summed and normed embeddings; Gemma 4 also computes its per-layer
//! inputs), then per layer the attention and the feed-forward part (a dense MLP, routed
//! experts (`moe`), or both), each with the norms the layer's names list (input norm, output
//! norm, both, or neither), its output scaled (granite) and added to the residual stream,
//! normed there when the layer is post-LN (BERT), then Gemma 4's per-layer input and layer
//! scalar; the final norm (if any), the LM head, the logit scale and softcap. A sublayer output
//! is added to the residual in the same pass as the norm that reads the sum
//! (`Norm::forward_add`) whenever one follows, so every family gets that fusion. A decoder
//! with an embedding head (`embedding`) also embeds: the final norm (if any) of every token,
//! then the head's pooling. LoRA adapters attach at run time (`attach_lora`); a
//! step's rows may each run through one, and every adapted projection adds its update to the
//! base projection's output (`lora::cpu`).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use ferrite_runtime::{ForwardBatch, KvCache, KvLayout, Result as RtResult, RuntimeError, Tensor};

use crate::blocks::{self, Attention, AttentionConfig, Linear, LmHead, Mlp, Norm};
use crate::config::ModelConfig;
use crate::deltanet::GatedDeltaNet;
use crate::embedding::{EmbeddingHead, EmbeddingSpec};
use crate::error::Result;
use crate::input::Input;
use crate::lora::cpu::{CpuLora, LoraStep};
use crate::lora::{LoraAdapter, LoraTarget};
use crate::model::{CausalLm, Pending, StepOutput, Want};
use crate::moe::Moe;
use crate::plan::DecoderPlan;
use crate::weights::Weights;

/// Gemma 4's per-layer inputs: a second token embedding and a projection of the embeddings.
struct PerLayerInput {
    embed: Tensor,
    embed_scale: f32,
    projection: Linear,
    projection_scale: f32,
    norm: Norm,
    width: usize,
}

impl PerLayerInput {
    /// `[t, layers * width]`: `(norm(proj(x) / sqrt(hidden)) + embed(tokens) * sqrt(width)) / sqrt(2)`.
    fn inputs(&self, x: &[f32], tokens: &[u32]) -> RtResult<Vec<f32>> {
        let tok = blocks::embed(&self.embed, tokens, Some(self.embed_scale))?;
        let mut proj = self.projection.forward(x, tokens.len())?;
        proj.iter_mut().for_each(|v| *v *= self.projection_scale);
        self.norm.forward_in_place(&mut proj);
        let scale = 0.5f64.sqrt() as f32;
        proj.iter_mut().zip(&tok).for_each(|(p, e)| *p = (*p + e) * scale);
        Ok(proj)
    }
}

/// A layer's use of its per-layer input: `x += norm(proj(act(gate(x)) * input))`.
struct LayerInput {
    gate: Linear,
    projection: Linear,
    norm: Norm,
}

/// A layer's token mixer: softmax attention over the KV cache, or gated DeltaNet linear
/// attention over a recurrent state slot.
enum Mixer {
    Attention(Attention),
    Linear(GatedDeltaNet),
}

impl Mixer {
    fn load(w: &Weights, names: &crate::plan::LayerNames, hidden: usize, mut c: AttentionConfig) -> Result<Mixer> {
        match c.linear.take() {
            Some(linear) => GatedDeltaNet::load(w, hidden, linear).map(Mixer::Linear),
            None => Attention::load(w, names, hidden, c).map(Mixer::Attention),
        }
    }

    fn forward(
        &self,
        h: &[f32],
        batch: &ForwardBatch,
        kv: &mut KvCache,
        out: &mut [f32],
        lora: crate::lora::cpu::LayerLora<'_>,
    ) -> RtResult<()> {
        match self {
            Mixer::Attention(a) => a.forward(h, batch, kv, out, lora),
            Mixer::Linear(l) => l.forward(h, batch, kv, out),
        }
    }

    /// (in, out) features of the attention projection `target` (a linear-attention layer has
    /// none an adapter may target).
    fn features(&self, target: crate::lora::LoraTarget) -> Option<(usize, usize)> {
        match self {
            Mixer::Attention(a) => a.features(target),
            Mixer::Linear(_) => None,
        }
    }
}

struct Layer {
    input_norm: Option<Norm>,
    attn: Mixer,
    post_attn_norm: Option<Norm>,
    attn_residual_norm: Option<Norm>,
    pre_ffn_norm: Option<Norm>,
    /// None for a layer whose experts replace it.
    mlp: Option<Mlp>,
    moe: Option<Moe>,
    post_ffn_norm: Option<Norm>,
    ffn_residual_norm: Option<Norm>,
    input: Option<LayerInput>,
    scalar: f32,
}

pub struct Decoder {
    cfg: ModelConfig,
    input: Input,
    residual_scale: Option<f32>,
    per_layer_input: Option<PerLayerInput>,
    layers: Vec<Layer>,
    head: LmHead,
    layout: KvLayout,
    /// Attached LoRA adapters by id.
    loras: RwLock<HashMap<u32, Arc<CpuLora>>>,
    embedding: Option<EmbeddingHead>,
    causal: bool,
}

/// The residual stream `x` and a sublayer output `o` that may still have to join it.
struct Stream {
    x: Vec<f32>,
    o: Vec<f32>,
    /// `o` is not yet added to `x`.
    pending: bool,
}

impl Stream {
    /// `h = norm(x)`, adding a pending `o` to `x` in the same pass.
    fn norm_into(&mut self, norm: &Norm, h: &mut [f32]) {
        if std::mem::take(&mut self.pending) {
            norm.forward_add(&mut self.x, &self.o, h);
        } else {
            norm.forward(&self.x, h);
        }
    }

    /// `x = norm(x + o)` (a post-LN layer), with `scratch` as wide as `x`.
    fn norm_stream(&mut self, norm: &Norm, scratch: &mut Vec<f32>) {
        self.norm_into(norm, scratch);
        std::mem::swap(&mut self.x, scratch);
    }

    /// Add a pending `o` to `x`.
    fn settle(&mut self) {
        if std::mem::take(&mut self.pending) {
            blocks::add_in_place(&mut self.x, &self.o);
        }
    }

    /// `o` is a sublayer's output: normed by `post_norm`, scaled, and left to join `x`.
    fn sublayer_done(&mut self, post_norm: Option<&Norm>, scale: Option<f32>) {
        if let Some(n) = post_norm {
            n.forward_in_place(&mut self.o);
        }
        if let Some(s) = scale {
            self.o.iter_mut().for_each(|v| *v *= s);
        }
        self.pending = true;
    }
}

impl Decoder {
    /// Build `plan` from `weights`, checking every tensor; `progress` is told after each layer.
    pub fn load(cfg: ModelConfig, plan: DecoderPlan, w: &Weights, progress: &dyn Fn(usize)) -> Result<Decoder> {
        let (d, eps, n, offset) = (cfg.hidden_size, plan.eps, plan.layers.len(), plan.norm_offset());
        let causal = plan.causal();
        let first = Input::load(w, &cfg, &plan)?;
        let norm = |name: &Option<String>| -> Result<Option<Norm>> {
            name.as_ref().map(|name| Norm::load_kind(w, name, d, plan.norm, eps)).transpose()
        };
        let mut layers = Vec::with_capacity(n);
        for (i, l) in plan.layers.into_iter().enumerate() {
            let p = |name: &str| format!("model.layers.{i}.{name}");
            let input = match plan.per_layer_input {
                Some((_, width)) => Some(LayerInput {
                    gate: Linear::load(w, &p("per_layer_input_gate"), width, d, false)?,
                    projection: Linear::load(w, &p("per_layer_projection"), d, width, false)?,
                    norm: Norm::load(w, &p("post_per_layer_input_norm.weight"), d, offset, eps)?,
                }),
                None => None,
            };
            let names = &l.names;
            let ffn = &l.ffn;
            let moe = ffn.moe.as_ref().map(|m| Moe::load(w, m, &format!("model.layers.{i}"), d, ffn.act, eps));
            let mlp = ffn.dense().then(|| Mlp::load(w, &names.mlp, d, ffn.intermediate, ffn.act, ffn.bias));
            layers.push(Layer {
                input_norm: norm(&names.input_norm)?,
                attn: Mixer::load(w, names, d, l.attn)?,
                post_attn_norm: norm(&names.post_attn_norm)?,
                attn_residual_norm: norm(&names.attn_residual_norm)?,
                pre_ffn_norm: norm(&names.pre_ffn_norm)?,
                mlp: mlp.transpose()?,
                moe: moe.transpose()?,
                post_ffn_norm: norm(&names.post_ffn_norm)?,
                ffn_residual_norm: norm(&names.ffn_residual_norm)?,
                input,
                scalar: if plan.layer_scalar { w.get_f32(&p("layer_scalar"), &[1])?[0] } else { 1.0 },
            });
            progress(i + 1);
        }
        let per_layer_input = match plan.per_layer_input {
            Some((vocab, width)) => Some(PerLayerInput {
                embed: w.get("model.embed_tokens_per_layer.weight", &[vocab, n * width])?,
                embed_scale: (width as f64).sqrt() as f32,
                projection: Linear::load(w, "model.per_layer_model_projection", n * width, d, false)?,
                projection_scale: (d as f64).powf(-0.5) as f32,
                norm: Norm::load(w, "model.per_layer_projection_norm.weight", width, 0.0, eps)?,
                width,
            }),
            None => None,
        };
        let final_norm = plan.final_norm.as_ref().map(|n| Norm::load_kind(w, n, d, plan.norm, eps)).transpose()?;
        let head = LmHead::load(w, &cfg, first.table(), final_norm, plan.logit_scale, plan.final_softcap)?;
        Ok(Decoder {
            cfg,
            input: first,
            residual_scale: plan.residual_scale,
            per_layer_input,
            layers,
            head,
            layout: plan.layout,
            loras: RwLock::default(),
            embedding: None,
            causal,
        })
    }

    /// The decoder, embedding with `head`.
    pub fn with_embedding(self, head: Option<EmbeddingHead>) -> Decoder {
        Decoder { embedding: head, ..self }
    }

    /// `input` of layer `i` (`[t, layers * width]` per-layer inputs) joins the residual.
    fn add_layer_input(&self, s: &mut Stream, li: &LayerInput, inputs: &[f32], i: usize, t: usize) -> RtResult<()> {
        let Some(pli) = &self.per_layer_input else { return Ok(()) };
        let (n, width) = (self.layers.len(), pli.width);
        s.settle();
        let mut gate = li.gate.forward(&s.x, t)?;
        let mine: Vec<f32> =
            (0..t).flat_map(|tok| &inputs[(tok * n + i) * width..(tok * n + i + 1) * width]).copied().collect();
        self.cfg.hidden_act.gate(&mut gate, &mine);
        li.projection.forward_into(&gate, t, &mut s.o)?;
        s.sublayer_done(Some(&li.norm), None);
        Ok(())
    }

    /// The residual stream after the last layer, `[tokens, hidden]`, after writing the
    /// batch's K/V into `kv`.
    fn forward(&self, batch: &ForwardBatch, kv: &mut KvCache) -> RtResult<Vec<f32>> {
        let t = batch.num_tokens();
        let attached: Vec<(u32, Arc<CpuLora>)> = if batch.has_adapters() {
            let loras = self.loras.read().unwrap_or_else(|e| e.into_inner());
            loras.iter().map(|(&id, l)| (id, l.clone())).collect()
        } else {
            Vec::new()
        };
        let lora = LoraStep::new(batch, |id| attached.iter().find(|(i, _)| *i == id).map(|(_, l)| &**l))?;
        let x = self.input.forward(batch)?;
        let inputs = self.per_layer_input.as_ref().map(|p| p.inputs(&x, &batch.tokens)).transpose()?;
        let mut h = vec![0f32; x.len()];
        let mut s = Stream { o: vec![0f32; x.len()], x, pending: false };
        for (i, l) in self.layers.iter().enumerate() {
            match &l.input_norm {
                Some(norm) => {
                    s.norm_into(norm, &mut h);
                    l.attn.forward(&h, batch, kv, &mut s.o, lora.layer(i))?;
                }
                None => {
                    s.settle();
                    l.attn.forward(&s.x, batch, kv, &mut s.o, lora.layer(i))?;
                }
            }
            s.sublayer_done(l.post_attn_norm.as_ref(), self.residual_scale);
            if let Some(norm) = &l.attn_residual_norm {
                s.norm_stream(norm, &mut h);
            }
            let input: &[f32] = match &l.pre_ffn_norm {
                Some(norm) => {
                    s.norm_into(norm, &mut h);
                    &h
                }
                None => {
                    s.settle();
                    &s.x
                }
            };
            if let Some(mlp) = &l.mlp {
                mlp.forward(input, t, &mut s.o, lora.layer(i))?;
            }
            if let Some(moe) = &l.moe {
                // Gemma 4's experts and router read the residual stream before the FFN norm.
                moe.forward(input, &s.x, t, &mut s.o)?;
            }
            s.sublayer_done(l.post_ffn_norm.as_ref(), self.residual_scale);
            if let Some(norm) = &l.ffn_residual_norm {
                s.norm_stream(norm, &mut h);
            }
            if let (Some(li), Some(inputs)) = (&l.input, &inputs) {
                self.add_layer_input(&mut s, li, inputs, i, t)?;
            }
            if l.scalar != 1.0 {
                s.settle();
                s.x.iter_mut().for_each(|v| *v *= l.scalar);
            }
        }
        s.settle();
        Ok(s.x)
    }
}

impl CausalLm for Decoder {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn kv_layout(&self) -> KvLayout {
        self.layout.clone()
    }

    fn kv_key_offsets(&self) -> Vec<Option<Vec<f32>>> {
        let mut out = vec![None; self.layout.layers.len()];
        for l in &self.layers {
            let Mixer::Attention(attn) = &l.attn else { continue };
            if let Some(i) = attn.writes_kv().filter(|&i| i < out.len()) {
                out[i] = attn.key_offset(self.cfg.max_context());
            }
        }
        out
    }

    fn attach_lora(&self, id: u32, adapter: &LoraAdapter) -> Result<()> {
        let shapes = self.lora_shapes();
        let lora = CpuLora::new(adapter, self.layers.len(), |i, target| shapes[i][target.index()])?;
        self.loras.write().unwrap_or_else(|e| e.into_inner()).insert(id, Arc::new(lora));
        Ok(())
    }

    fn detach_lora(&self, id: u32) {
        self.loras.write().unwrap_or_else(|e| e.into_inner()).remove(&id);
    }

    fn lora_shapes(&self) -> Vec<[Option<(usize, usize)>; 7]> {
        let features = |l: &Layer, t| l.attn.features(t).or_else(|| l.mlp.as_ref().and_then(|m| m.features(t)));
        self.layers.iter().map(|l| LoraTarget::ALL.map(|t| features(l, t))).collect()
    }

    /// Runs at once: the handle is resolved.
    fn step(&self, batch: &ForwardBatch, kv: &mut KvCache, want: Want<'_>) -> RtResult<Pending> {
        if !batch.carried.is_empty() {
            return Err(RuntimeError::Shape("a CPU model keeps no picks on a device to carry".into()));
        }
        if !self.causal {
            return Err(RuntimeError::Unsupported("a bidirectional model only embeds".into()));
        }
        let logits = self.head.logits(&self.forward(batch, kv)?, batch)?;
        StepOutput::from_logits(logits, self.cfg.vocab_size, want).map(Pending::ready)
    }

    fn embedding(&self) -> Option<&EmbeddingSpec> {
        self.embedding.as_ref().map(EmbeddingHead::spec)
    }

    fn generates(&self) -> bool {
        self.causal
    }

    fn embed(&self, batch: &ForwardBatch, kv: &mut KvCache) -> RtResult<Vec<Vec<f32>>> {
        let head =
            self.embedding.as_ref().ok_or_else(|| RuntimeError::Unsupported("this model does not embed".into()))?;
        let states = self.head.norm_rows(self.forward(batch, kv)?);
        head.embed(&states, self.cfg.hidden_size, batch)
    }
}
