//! The architecture table: one row per family, with its HF `model_type`, its GGUF
//! `general.architecture` (where ferrite reads that format), the config quirks the generic
//! config reader needs, and the plan builder of its family file. A new family is one file
//! under `families/` and one row here.

mod bert;
mod gemma;
mod gemma4;
mod glm4;
mod granite;
mod llama;
mod mixtral;
mod olmo2;
mod phi3;
mod qwen3_5;
mod qwen3_moe;
mod qwen3_next;
mod smollm3;
mod sparse_moe;
mod starcoder2;

use crate::config::{ConfigSource, ModelConfig};
use crate::error::Result;
use crate::plan::DecoderPlan;

/// How a family reads `sliding_window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowRule {
    /// No sliding window.
    Never,
    /// Every layer slides when `sliding_window` is set (mistral).
    Key,
    /// The window of the sliding layers: `sliding_window`, this when the key is absent, none
    /// when it is null (Gemma 2+).
    Default(usize),
    /// Qwen: `use_sliding_window = true` is refused, the window unused otherwise.
    QwenFlag,
}

/// What the generic config reader must know of a family.
#[derive(Debug, Clone, Copy)]
pub struct Quirks {
    /// The config key of the MLP activation and its value when absent.
    pub act_key: &'static str,
    pub default_act: &'static str,
    /// `tie_word_embeddings` when absent.
    pub tie_default: bool,
    /// q/k/v biases regardless of `attention_bias` (qwen2).
    pub qkv_bias: bool,
    /// Per-head q/k norms.
    pub qk_norm: bool,
    pub window: WindowRule,
    /// RoPE theta when the config gives none.
    pub default_theta: f64,
    /// GGUF: the sliding window when `attention.sliding_window` is 0 or absent (None: no
    /// window), and whether the key is read at all.
    pub gguf_window: Option<Option<usize>>,
    /// GGUF: llama.cpp permuted the q/k rows (its llama rope layout).
    pub gguf_unpermute_qk: bool,
    /// GGUF: `post_attention_norm` is a sublayer output norm, not the pre-FFN norm.
    pub gguf_sandwich: bool,
}

const LLAMA: Quirks = Quirks {
    act_key: "hidden_act",
    default_act: "silu",
    tie_default: false,
    qkv_bias: false,
    qk_norm: false,
    window: WindowRule::Never,
    default_theta: 10_000.0,
    gguf_window: None,
    gguf_unpermute_qk: false,
    gguf_sandwich: false,
};

const GEMMA: Quirks = Quirks {
    act_key: "hidden_activation",
    default_act: "gelu_pytorch_tanh",
    tie_default: true,
    window: WindowRule::Default(4096),
    gguf_window: Some(None),
    gguf_sandwich: true,
    ..LLAMA
};

/// One family: its names in each format, its quirks and its plan.
#[derive(Debug)]
pub struct Family {
    /// The HF `model_type`.
    pub name: &'static str,
    /// The GGUF `general.architecture`, where ferrite reads that format.
    pub gguf: Option<&'static str>,
    pub quirks: Quirks,
    /// The plan of a config of this family (it may adjust `cfg`, e.g. Gemma 4 sets the RoPE
    /// of its global layers).
    pub plan: fn(&mut ModelConfig, &ConfigSource) -> Result<DecoderPlan>,
}

/// Every family ferrite runs.
pub static FAMILIES: &[Family] = &[
    Family {
        name: "llama",
        gguf: Some("llama"),
        quirks: Quirks { gguf_unpermute_qk: true, ..LLAMA },
        plan: llama::plan,
    },
    Family {
        name: "mistral",
        gguf: Some("mistral"),
        quirks: Quirks { window: WindowRule::Key, ..LLAMA },
        plan: llama::plan,
    },
    Family {
        name: "qwen2",
        gguf: Some("qwen2"),
        quirks: Quirks { qkv_bias: true, window: WindowRule::QwenFlag, ..LLAMA },
        plan: llama::plan,
    },
    Family {
        name: "qwen3",
        gguf: Some("qwen3"),
        quirks: Quirks { qk_norm: true, window: WindowRule::QwenFlag, ..LLAMA },
        plan: llama::plan,
    },
    Family {
        name: "qwen3_moe",
        gguf: Some("qwen3moe"),
        quirks: Quirks { qk_norm: true, window: WindowRule::QwenFlag, ..LLAMA },
        plan: qwen3_moe::plan,
    },
    Family {
        name: "qwen3_5_text",
        gguf: Some("qwen35"),
        quirks: Quirks { qk_norm: true, window: WindowRule::QwenFlag, gguf_sandwich: true, ..LLAMA },
        plan: qwen3_5::plan,
    },
    Family {
        name: "qwen3_next",
        gguf: Some("qwen3next"),
        quirks: Quirks { qk_norm: true, window: WindowRule::QwenFlag, gguf_sandwich: true, ..LLAMA },
        plan: qwen3_next::plan,
    },
    Family {
        name: "mixtral",
        // As `llama` with expert tensors (`llama::plan`).
        gguf: None,
        quirks: Quirks { window: WindowRule::Key, default_theta: 1_000_000.0, ..LLAMA },
        plan: mixtral::plan,
    },
    Family { name: "phi3", gguf: Some("phi3"), quirks: Quirks { window: WindowRule::Key, ..LLAMA }, plan: phi3::plan },
    Family { name: "olmo2", gguf: Some("olmo2"), quirks: Quirks { gguf_sandwich: true, ..LLAMA }, plan: olmo2::plan },
    Family { name: "glm4", gguf: Some("glm4"), quirks: LLAMA, plan: glm4::plan },
    Family {
        name: "granite",
        gguf: Some("granite"),
        quirks: Quirks { gguf_unpermute_qk: true, ..LLAMA },
        plan: granite::plan,
    },
    Family {
        name: "starcoder2",
        gguf: Some("starcoder2"),
        quirks: Quirks {
            default_act: "gelu_pytorch_tanh",
            tie_default: true,
            window: WindowRule::Key,
            gguf_window: Some(None),
            ..LLAMA
        },
        plan: starcoder2::plan,
    },
    Family {
        name: "smollm3",
        gguf: Some("smollm3"),
        quirks: Quirks { window: WindowRule::QwenFlag, gguf_unpermute_qk: true, ..LLAMA },
        plan: smollm3::plan,
    },
    Family {
        name: "gemma",
        gguf: Some("gemma"),
        quirks: Quirks { act_key: "hidden_act", window: WindowRule::Never, gguf_sandwich: false, ..GEMMA },
        plan: gemma::plan_gemma,
    },
    Family {
        name: "gemma2",
        gguf: Some("gemma2"),
        quirks: Quirks { gguf_window: Some(Some(4096)), ..GEMMA },
        plan: gemma::plan_gemma2,
    },
    Family {
        name: "gemma3_text",
        gguf: Some("gemma3"),
        quirks: Quirks { qk_norm: true, default_theta: 1_000_000.0, ..GEMMA },
        plan: gemma::plan_gemma3,
    },
    Family {
        name: "gemma4_text",
        gguf: None,
        quirks: Quirks { qk_norm: true, window: WindowRule::Default(512), gguf_sandwich: false, ..GEMMA },
        plan: gemma4::plan,
    },
    Family {
        name: "bert",
        // The encoder of MiniLM / bge-small class embedders (`BertModel`); it only embeds.
        gguf: None,
        quirks: Quirks { default_act: "gelu", tie_default: true, ..LLAMA },
        plan: bert::plan,
    },
];

/// The family of an HF `model_type`.
pub fn from_hf(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.name == name)
}

/// The family of a GGUF `general.architecture`.
pub fn from_gguf(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.gguf == Some(name))
}

/// The supported names of one format, for error messages.
pub fn supported(gguf: bool) -> String {
    let names: Vec<&str> = FAMILIES.iter().filter_map(|f| if gguf { f.gguf } else { Some(f.name) }).collect();
    names.join(", ")
}
