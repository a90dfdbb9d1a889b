//! `GpuLlama`: the llama family (llama, mistral, qwen2; SmolLM2, Llama 3.x, Qwen 2.5 shapes)
//! on one CUDA device, behind the same `CausalLm` interface as the CPU model, with bf16 or
//! GGUF block-quantized weight matrices (`ops::Matrix`); the step machinery, graphs and LM
//! head are `runner`'s.
//!
//! A step is: embedding gather → per layer [RMSNorm (fused with the residual add) → fused
//! QKV GEMM (+bias) → RoPE on q and k in place with the KV write (one kernel) → paged
//! attention (in decode, one kernel: the attention rotates q and the new key and stores K and
//! V itself) → output GEMM → RMSNorm + residual → fused gate-up GEMM → SwiGLU (one kernel in
//! decode) → down GEMM] → final norm → gather of the rows that want logits → LM head GEMM (f32
//! logits) → argmax, or after the step the rows' own sampling (`forward_sampled`: logit edits,
//! temperature, top-k/top-p/min-p, log-probabilities). Activations are bf16, every kernel computes in f32, GEMMs accumulate in
//! f32.

use std::sync::Arc;

use ferrite_runtime::cpu::AttentionParams;
use ferrite_runtime::cuda::ops::{self, GatedActivation, Matrix, RopeShape};
use ferrite_runtime::cuda::{CudaSlice, DevicePtr, Gpu};
use ferrite_runtime::{KvCache, KvGroupKind, KvLayout, Result as RtResult};
use half::bf16;

use super::runner::{step_inputs, Decode, GpuModel, LayerBuffers, Layers, StepIo};
use super::weights::{qkv_rows, LlamaWeights};
use crate::config::{Activation, ModelConfig};
use crate::error::{LoadError, Result};

/// The llama family on the device.
pub type GpuLlama = GpuModel<LlamaLayers>;

pub struct LlamaLayers {
    cfg: ModelConfig,
    layout: KvLayout,
    params: [AttentionParams; 1],
    act: GatedActivation,
    w: LlamaWeights,
    inv_freq: CudaSlice<f32>,
    rope_scaling: f32,
}

/// Why a config cannot run on this path, if it cannot.
pub fn unsupported(cfg: &ModelConfig) -> Option<String> {
    use crate::config::Architecture as A;
    if !matches!(cfg.arch, A::Llama | A::Mistral | A::Qwen2) {
        return Some(format!("the {} architecture has no CUDA path yet", cfg.arch.name()));
    }
    if cfg.qk_norm {
        return Some("q/k norms have no CUDA path yet".into());
    }
    if cfg.rope.is_dynamic() {
        return Some("dynamic NTK RoPE has no CUDA path yet".into());
    }
    if ![64, 128, 256].contains(&cfg.head_dim) {
        return Some(format!("head_dim {} has no CUDA attention kernel (64, 128, 256)", cfg.head_dim));
    }
    None
}

impl GpuLlama {
    /// A model of `cfg` with weights `w` already on `gpu`.
    pub fn new(cfg: ModelConfig, w: LlamaWeights, gpu: Arc<Gpu>) -> Result<GpuLlama> {
        if let Some(why) = unsupported(&cfg) {
            return Err(LoadError::Other(why));
        }
        let kind = match cfg.sliding_window {
            Some(window) => KvGroupKind::Sliding { window },
            None => KvGroupKind::Full,
        };
        let layout = KvLayout::uniform(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kind);
        let params = AttentionParams {
            n_heads: cfg.num_heads,
            n_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            window: cfg.sliding_window,
            softcap: None,
        };
        let rope = cfg.rope.rope_for(0);
        let act = match cfg.hidden_act {
            Activation::Silu => GatedActivation::Silu,
            Activation::GeluTanh => GatedActivation::GeluTanh,
        };
        let bytes = w.bytes;
        let layers = LlamaLayers {
            layout,
            params: [params],
            act,
            inv_freq: gpu.upload(&rope.inv_freq)?,
            rope_scaling: rope.attention_scaling,
            cfg,
            w,
        };
        Ok(GpuModel::from_layers(layers, gpu, bytes))
    }
}

impl Layers for LlamaLayers {
    type Buffers = LayerBuffers;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn attention(&self) -> &[AttentionParams] {
        &self.params
    }

    fn buffers(&self, gpu: &Gpu, tokens: usize) -> RtResult<LayerBuffers> {
        let cfg = &self.cfg;
        let attn = cfg.num_heads * cfg.head_dim;
        LayerBuffers::new(gpu, tokens, qkv_rows(cfg), attn, cfg.hidden_size, cfg.intermediate_size)
    }

    fn queue_layers(
        &self,
        gpu: &Gpu,
        ws: &mut StepIo,
        b: &mut LayerBuffers,
        kv: &mut KvCache,
        tokens: usize,
        decode: Option<Decode>,
    ) -> RtResult<()> {
        let cfg = &self.cfg;
        let (d, v, inter) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let (q_w, qkv_w) = (nh * hd, qkv_rows(cfg));
        let eps = cfg.rms_norm_eps;
        let plan = decode.map(|dec| dec.plan(gpu, &self.params[0]));
        let [ids, positions, _] = step_inputs(&ws.inputs, tokens, 0)?;
        self.w.embed.embedding(gpu, (v, d), &ids, tokens, 1.0, &mut ws.x)?;
        for (i, l) in self.w.layers.iter().enumerate() {
            if i == 0 {
                ops::rms_norm(gpu, &ws.x, None, &l.attn_norm, (tokens, d), eps, 0.0, &mut ws.h)?;
            } else {
                ops::rms_norm(gpu, &b.o, Some(&mut ws.x), &l.attn_norm, (tokens, d), eps, 0.0, &mut ws.h)?;
            }
            let bias = l.qkv_bias.as_ref().map(|b| b as &dyn DevicePtr<bf16>);
            l.qkv.linear(gpu, &ws.h, bias, &mut b.qkv, (tokens, qkv_w, d), ws.dequant.as_mut())?;
            let layer_kv = kv.device_layer_mut(i)?;
            let p = &self.params[0];
            if let Some(plan) = plan {
                // Decode: the attention kernel rotates q and the new keys and stores K and V.
                let rope = (&self.inv_freq, self.rope_scaling);
                let (meta, scratch) = (&ws.metas[0], &mut ws.scratch);
                ops::decode_attention_rope(
                    gpu,
                    &b.qkv,
                    qkv_w,
                    meta,
                    layer_kv,
                    p,
                    rope,
                    plan,
                    scratch,
                    &mut b.attn,
                    q_w,
                )?;
            } else {
                let shape = RopeShape { tokens, n_heads: nh + nkv, head_dim: hd, stride: qkv_w };
                let store = Some((&ws.metas[0], &mut *layer_kv));
                ops::rope(gpu, &mut b.qkv, &positions, &self.inv_freq, self.rope_scaling, shape, store)?;
                ops::attention(gpu, &b.qkv, qkv_w, &ws.metas[0], layer_kv, p, None, &mut ws.scratch, &mut b.attn, q_w)?;
            }
            l.o.linear(gpu, &b.attn, None, &mut b.o, (tokens, d, q_w), ws.dequant.as_mut())?;
            ops::rms_norm(gpu, &b.o, Some(&mut ws.x), &l.ffn_norm, (tokens, d), eps, 0.0, &mut ws.h)?;
            let shape = (tokens, inter, d);
            l.gate_up.linear_gated(gpu, self.act, &ws.h, &mut b.gate_up, &mut b.act, shape, ws.dequant.as_mut())?;
            l.down.linear(gpu, &b.act, None, &mut b.o, (tokens, d, inter), ws.dequant.as_mut())?;
        }
        Ok(())
    }

    fn final_norm(&self, gpu: &Gpu, ws: &mut StepIo, b: &mut LayerBuffers, tokens: usize) -> RtResult<()> {
        let (d, eps) = (self.cfg.hidden_size, self.cfg.rms_norm_eps);
        ops::rms_norm(gpu, &b.o, Some(&mut ws.x), &self.w.final_norm, (tokens, d), eps, 0.0, &mut ws.h)?;
        Ok(())
    }

    fn lm_head(&self) -> &Matrix {
        &self.w.lm_head
    }

    fn scratch_len(&self) -> usize {
        self.w.scratch_len()
    }
}
