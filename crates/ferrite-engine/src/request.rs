//! Requests into the engine and the outputs that stream back.

use crate::fill::FillMode;
use crate::sampling::{SamplingParams, TokenLogprob};
use crate::spec::{FillUsage, SpecUsage};
use crate::structured::Constraint;

pub type RequestId = u64;

/// Everything about how one request generates.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RequestParams {
    pub sampling: SamplingParams,
    /// At most this many tokens per choice (default: until the context is full).
    pub max_tokens: Option<usize>,
    /// End tokens and stop strings are ignored until this many tokens exist.
    pub min_tokens: usize,
    /// Keep generating past the model's end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Extra token ids that end generation.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation (matched on decoded text, not emitted).
    pub stop: Vec<String>,
    /// Return log-probabilities with this many alternatives per token (0 = the chosen token's).
    pub logprobs: Option<usize>,
    /// Number of independent choices for the prompt (they share its KV blocks).
    pub n: usize,
    /// Fill mode; `None` takes the engine's default.
    pub fill: Option<FillMode>,
    /// The shape the output must take (structured output); every choice follows it.
    pub constraint: Option<Constraint>,
    /// The LoRA adapter (by the name it was loaded under) the request runs through; None: the
    /// base model.
    #[serde(default)]
    pub adapter: Option<String>,
    /// Embed the prompt instead of continuing it: a prefill-only request whose one output
    /// carries the model's embedding of the whole prompt (no sampling, no KV kept after).
    #[serde(default)]
    pub embed: bool,
    /// The KV precision the request asks for (`kv_cache_dtype`); None: the engine's
    /// (`Limits::kv_start` says what a request may choose).
    #[serde(default)]
    pub kv_cache_dtype: Option<KvPrecision>,
    /// The position its KV turns quantized at (`quantized_kv_start`); None: the engine's.
    #[serde(default)]
    pub quantized_kv_start: Option<usize>,
}

/// The KV precision a request asks for (`kv_cache_dtype`): the engine's default, full
/// precision (the cache's f16 on the CPU, bf16 on a GPU), or a quantized type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvPrecision {
    Auto,
    Full,
    Int8,
    Int4,
    Fp8,
}

/// The names `kv_cache_dtype` takes.
pub const KV_PRECISION_NAMES: &str = "auto, f16, bf16, int8, int4, fp8";

impl std::str::FromStr for KvPrecision {
    type Err = String;

    fn from_str(s: &str) -> Result<KvPrecision, String> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "auto" => KvPrecision::Auto,
            "f16" | "fp16" | "bf16" => KvPrecision::Full,
            "int8" => KvPrecision::Int8,
            "int4" => KvPrecision::Int4,
            "fp8" | "fp8_e4m3" => KvPrecision::Fp8,
            other => return Err(format!("unknown kv_cache_dtype '{other}' ({KV_PRECISION_NAMES})")),
        })
    }
}

impl KvPrecision {
    /// The quantized type's name, as a cache's scheme names it (`int8`, `int4`, `fp8`).
    pub fn quantized_name(self) -> Option<&'static str> {
        match self {
            KvPrecision::Int8 => Some("int8"),
            KvPrecision::Int4 => Some("int4"),
            KvPrecision::Fp8 => Some("fp8"),
            KvPrecision::Auto | KvPrecision::Full => None,
        }
    }
}

impl Default for RequestParams {
    fn default() -> Self {
        RequestParams {
            sampling: SamplingParams::default(),
            max_tokens: None,
            min_tokens: 0,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            logprobs: None,
            n: 1,
            fill: None,
            constraint: None,
            adapter: None,
            embed: false,
            kv_cache_dtype: None,
            quantized_kv_start: None,
        }
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: RequestParams,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FinishReason {
    /// An end token or stop string.
    Stop,
    /// max_tokens or the context length.
    Length,
    /// Cancelled by the caller.
    Abort,
    /// The model failed; the message is in `Finished::error`.
    Error,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub fill: FillUsage,
    pub speculation: SpecUsage,
    pub tiers: TierUsage,
}

/// Where a request's cached tokens came from beyond the KV pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TierUsage {
    /// Prompt tokens (of `cached_tokens`) restored from the host-RAM tier.
    pub host_tokens: usize,
    /// Prompt tokens (of `cached_tokens`) restored from the SSD tier.
    pub ssd_tokens: usize,
    /// Generated tokens replayed from an interrupted run of the same request.
    pub resumed_tokens: usize,
}

impl std::ops::Add for TierUsage {
    type Output = TierUsage;
    fn add(self, o: TierUsage) -> TierUsage {
        TierUsage {
            host_tokens: self.host_tokens + o.host_tokens,
            ssd_tokens: self.ssd_tokens + o.ssd_tokens,
            resumed_tokens: self.resumed_tokens + o.resumed_tokens,
        }
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Finished {
    pub reason: FinishReason,
    /// The stop string or token that ended the choice.
    pub stop_string: Option<String>,
    pub stop_token: Option<u32>,
    pub error: Option<String>,
    pub usage: Usage,
}

impl Finished {
    /// An end by `error`, with the usage so far.
    pub fn error(error: String, usage: Usage) -> Self {
        Finished { reason: FinishReason::Error, stop_string: None, stop_token: None, error: Some(error), usage }
    }
}

/// One streamed piece of one choice: new token ids, their text, and (last) how it ended.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Output {
    pub choice: usize,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finished: Option<Finished>,
    /// Prompt tokens whose KV came from the prefix cache (known from the first output on,
    /// so a stream can report the prompt's split before the end).
    pub cached_tokens: usize,
    /// The prompt's embedding, in the one output of an embedding request.
    #[serde(default)]
    pub embedding: Option<Vec<f32>>,
}

impl Output {
    /// A choice's last output that carries no new token, only how it ended.
    pub fn end(choice: usize, finished: Finished, cached_tokens: usize) -> Self {
        Output {
            choice,
            token_ids: Vec::new(),
            text: String::new(),
            logprobs: Vec::new(),
            finished: Some(finished),
            cached_tokens,
            embedding: None,
        }
    }
}
