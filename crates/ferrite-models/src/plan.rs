//! The decoder plan: one data description of a transformer stack, read by both executors
//! (`decoder` on the CPU, `gpu::decoder` on a CUDA device). Decoders are most of it; an
//! encoder (BERT) is the same plan with bidirectional attention, an encoder input and
//! post-LN layers.
//!
//! Model-wide it says how the tokens become the first residual stream (`InputKind`: the
//! token embedding, scaled or not, or an encoder's word + position + token-type embeddings
//! and their norm), which norm the model uses (RMSNorm with a `w` or `1 + w` weight, or
//! LayerNorm with a bias), the residual and logit multipliers, the final norm (none for a
//! post-LN encoder), the final softcap and the per-layer inputs; per layer, the attention
//! (`AttentionConfig`: heads, head dim, score scale, RoPE schedule or none, causal or not, q/k
//! norms, window, softcap, own KV or a donor's), the feed-forward (gated or plain, its width;
//! or routed experts, `MoePlan`, in place of the dense MLP or beside it) and the tensor names
//! (`LayerNames`), whose norms also say where the norms sit: an input norm and a pre-FFN norm
//! (pre-norm), those plus a norm on each sublayer output (sandwich), only the output norms
//! (olmo2's post-norm), or a norm of the residual stream after each sublayer joined it
//! (BERT's post-LN). A family file turns a config into a plan; nothing else differs between
//! families.

use ferrite_runtime::KvLayout;

use crate::blocks::AttentionConfig;
use crate::config::Activation;
use crate::moe::MoeShape;

/// The normalization of a model (every norm of the decoder and the final one).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum NormKind {
    /// RMSNorm; its weight applied as `offset + w` (Gemma 1–3: offset 1).
    Rms { offset: f32 },
    /// LayerNorm with a learned weight and bias (starcoder2).
    Layer,
}

/// How a layer's q, k and v projections are stored.
#[derive(Debug, Clone, PartialEq)]
pub enum QkvNames {
    /// `{q}`, `{k}`, `{v}` (`.weight`, `.bias`).
    Separate { q: String, k: String, v: String },
    /// One `[q + k + v rows, hidden]` tensor (phi3's `qkv_proj`).
    Fused(String),
}

/// How a layer's feed-forward weights are stored.
#[derive(Debug, Clone, PartialEq)]
pub enum MlpNames {
    /// `down(act(gate(x)) * up(x))` with separate gate and up.
    Gated { gate: String, up: String, down: String },
    /// The same with gate and up stacked in one `[2 * inter, hidden]` tensor (gate rows first).
    FusedGated { gate_up: String, down: String },
    /// `down(act(up(x)))` (starcoder2's `c_fc`, `c_proj`).
    Plain { up: String, down: String },
}

/// The tensor names of one layer (HF names, without `.weight`/`.bias`).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerNames {
    /// Norm of the attention input.
    pub input_norm: Option<String>,
    /// Norm of the attention output before its residual add.
    pub post_attn_norm: Option<String>,
    /// Norm of the feed-forward input.
    pub pre_ffn_norm: Option<String>,
    /// Norm of the feed-forward output before its residual add.
    pub post_ffn_norm: Option<String>,
    /// Norm of the residual stream once the attention output joined it (BERT's post-LN,
    /// `x = norm(x + attn(x))`).
    pub attn_residual_norm: Option<String>,
    /// Norm of the residual stream once the feed-forward output joined it.
    pub ffn_residual_norm: Option<String>,
    pub qkv: QkvNames,
    pub o: String,
    pub q_norm: String,
    pub k_norm: String,
    pub mlp: MlpNames,
}

impl LayerNames {
    /// The HF llama names of layer `i`: `input_layernorm`, `self_attn.{q,k,v,o}_proj`,
    /// `self_attn.{q,k}_norm`, `post_attention_layernorm` (the pre-FFN norm) and
    /// `mlp.{gate,up,down}_proj`.
    pub fn llama(i: usize) -> LayerNames {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        LayerNames {
            input_norm: Some(p("input_layernorm")),
            post_attn_norm: None,
            pre_ffn_norm: Some(p("post_attention_layernorm")),
            post_ffn_norm: None,
            attn_residual_norm: None,
            ffn_residual_norm: None,
            qkv: QkvNames::Separate { q: p("self_attn.q_proj"), k: p("self_attn.k_proj"), v: p("self_attn.v_proj") },
            o: p("self_attn.o_proj"),
            q_norm: p("self_attn.q_norm"),
            k_norm: p("self_attn.k_norm"),
            mlp: MlpNames::Gated { gate: p("mlp.gate_proj"), up: p("mlp.up_proj"), down: p("mlp.down_proj") },
        }
    }

    /// Gemma 2+'s four norms: `input_layernorm`, `post_attention_layernorm`,
    /// `pre_feedforward_layernorm`, `post_feedforward_layernorm`.
    pub fn sandwich(i: usize) -> LayerNames {
        let p = |s: &str| Some(format!("model.layers.{i}.{s}"));
        LayerNames {
            post_attn_norm: p("post_attention_layernorm"),
            pre_ffn_norm: p("pre_feedforward_layernorm"),
            post_ffn_norm: p("post_feedforward_layernorm"),
            ..LayerNames::llama(i)
        }
    }
}

/// Where a layer's experts sit and what their router reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeStyle {
    /// The experts are the layer's feed-forward: they and a linear router read the pre-FFN-normed
    /// input, and the dense MLP is absent (qwen3_moe, mixtral).
    Sparse,
    /// Gemma 4: beside the dense MLP; the router reads the residual, unit-RMSNormed, times a
    /// learned scale and `hidden^-1/2`, and scales each chosen expert by a learned factor; the
    /// experts read their own norm of the residual, and the normed outputs of both are summed.
    Gemma4,
}

/// The tensor names of a layer's experts.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertNames {
    /// The router's linear layer (`[experts, hidden]`).
    pub router: String,
    /// The experts' module: its projections are stored stacked per expert,
    /// `{experts}.gate_up_proj` (`[experts, 2 × inter, hidden]`, gate rows first) and
    /// `{experts}.down_proj` (transformers 5, Gemma 4); or stacked one tensor per projection,
    /// `{experts}.{gate}.weight` (`[experts, inter, hidden]`: GGUF's `ffn_gate_exps`); or
    /// one tensor per expert and projection, `{experts}.{e}.{gate}.weight`.
    pub experts: String,
    /// The projection names: `gate_proj`, `up_proj`, `down_proj` (Mixtral: `w1`, `w3`, `w2`).
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
}

/// A layer's routed mixture of experts: each token's top-k experts by softmax probability.
#[derive(Debug, Clone, PartialEq)]
pub struct MoePlan {
    pub shape: MoeShape,
    /// The chosen experts' probabilities are divided by their sum (Mixtral, Gemma 4, Qwen3-MoE's
    /// `norm_topk_prob`).
    pub renormalize: bool,
    pub style: MoeStyle,
    pub names: ExpertNames,
    /// A gated MLP every token runs through beside the routed experts (Qwen3-Next).
    pub shared: Option<SharedExpert>,
}

/// A shared expert: its output joins the routed experts' sum, scaled per token by
/// `sigmoid(gate · x)` when it has a gate (`[1, hidden]`).
#[derive(Debug, Clone, PartialEq)]
pub struct SharedExpert {
    pub intermediate: usize,
    pub mlp: MlpNames,
    pub gate: Option<String>,
}

/// The feed-forward part of a layer.
#[derive(Debug, Clone, PartialEq)]
pub struct FfnPlan {
    pub act: Activation,
    /// Width of the dense MLP.
    pub intermediate: usize,
    /// Biases on its projections.
    pub bias: bool,
    /// Routed experts, in place of the dense MLP or beside it (`MoeStyle`).
    pub moe: Option<MoePlan>,
}

impl FfnPlan {
    /// The layer has a dense MLP (no experts, or experts beside it).
    pub fn dense(&self) -> bool {
        self.moe.as_ref().is_none_or(|m| m.style != MoeStyle::Sparse)
    }
}

/// How a step's tokens become the first residual stream.
#[derive(Debug, Clone, PartialEq)]
pub enum InputKind {
    /// The token embedding `model.embed_tokens` (times `DecoderPlan::embed_scale`).
    Tokens,
    /// An encoder's (BERT): word, absolute position and token-type embeddings summed, then
    /// normed.
    Encoder(EncoderInput),
}

/// The tensor names of an encoder's input embeddings (without `.weight`/`.bias`).
#[derive(Debug, Clone, PartialEq)]
pub struct EncoderInput {
    /// `[vocab, hidden]`.
    pub words: String,
    /// `[positions, hidden]`: row `p` joins the token at position `p`.
    pub positions: String,
    /// The number of learned positions (`max_position_embeddings`).
    pub max_positions: usize,
    /// `[types, hidden]`: every token is of type 0 (one segment per input).
    pub token_types: String,
    pub types: usize,
    /// The norm of the sum (a LayerNorm for BERT).
    pub norm: String,
}

/// One decoder layer.
pub struct LayerPlan {
    pub attn: AttentionConfig,
    pub ffn: FfnPlan,
    pub names: LayerNames,
}

pub struct DecoderPlan {
    pub layers: Vec<LayerPlan>,
    pub layout: KvLayout,
    pub input: InputKind,
    pub norm: NormKind,
    pub eps: f32,
    /// The norm after the last layer (`model.norm`); none where each layer ends normed (a
    /// post-LN encoder).
    pub final_norm: Option<String>,
    /// Multiplies the token embedding (Gemma's `sqrt(hidden)`, granite's
    /// `embedding_multiplier`).
    pub embed_scale: Option<f32>,
    /// Multiplies each sublayer output before its residual add (granite's
    /// `residual_multiplier`).
    pub residual_scale: Option<f32>,
    /// Multiplies the logits (granite: `1 / logits_scaling`).
    pub logit_scale: Option<f32>,
    pub final_softcap: Option<f32>,
    /// (vocab, width) of Gemma 4's per-layer inputs.
    pub per_layer_input: Option<(usize, usize)>,
    /// Gemma 4 scales the residual stream by a learned scalar (`layer_scalar`) after each layer.
    pub layer_scalar: bool,
    /// RoPE rotates adjacent pairs of dims (GLM); the loader reorders the q/k rows so that
    /// the executors' rotate-half RoPE does the same (`weights::WeightLayout`).
    pub interleaved_rope: bool,
}

impl DecoderPlan {
    /// Whether every layer attends causally (false: a bidirectional encoder, which embeds
    /// and never generates).
    pub fn causal(&self) -> bool {
        self.layers.iter().all(|l| l.attn.params.causal)
    }

    /// The norm offset of an RMSNorm model (0 for LayerNorm).
    pub fn norm_offset(&self) -> f32 {
        match self.norm {
            NormKind::Rms { offset } => offset,
            NormKind::Layer => 0.0,
        }
    }
}
