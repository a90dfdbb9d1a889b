//! Typed errors of the engine: bad requests (the caller's fault) and model failures.

use crate::sampling::SamplingError;
use crate::structured::GuideError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens but the context holds {context}")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("{prompt} prompt tokens + max_tokens {max_tokens} exceed the context of {context}")]
    MaxTokensTooLarge { prompt: usize, max_tokens: usize, context: usize },
    #[error("the request needs {need} KV positions but the cache holds {capacity}")]
    KvTooSmall { need: usize, capacity: usize },
    #[error("n must be between 1 and {max}, got {n}")]
    BadN { n: usize, max: usize },
    #[error("top_logprobs must be at most {0}")]
    TooManyLogprobs(usize),
    #[error("stop strings need a tokenizer, and this model has none")]
    StopWithoutTokenizer,
    #[error("min_tokens {min_tokens} exceeds max_tokens {max_tokens}")]
    MinTokens { min_tokens: usize, max_tokens: usize },
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Guide(#[from] GuideError),
    #[error("the LoRA adapter '{0}' is not loaded")]
    UnknownAdapter(String),
    #[error("the LoRA adapter '{name}' is in use by {sequences} sequence(s); unload it when they are done")]
    AdapterInUse { name: String, sequences: usize },
    #[error("LoRA adapter: {0}")]
    Adapter(String),
    #[error("this model does not make embeddings")]
    CannotEmbed,
    #[error("this model only makes embeddings: it attends both ways and cannot generate")]
    CannotGenerate,
    #[error("the input has {input} tokens but this model embeds at most {max} at once")]
    EmbedInputTooLong { input: usize, max: usize },
    #[error("an embedding request makes one embedding (n = 1, no max_tokens)")]
    EmbedParams,
    /// A `kv_cache_dtype` or `quantized_kv_start` (`param`) the cache cannot serve; the
    /// message names what it can.
    #[error("{message}")]
    KvPrecision { param: &'static str, message: String },
    #[error("engine configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Disk(#[from] crate::kv::disk::DiskError),
    #[error("the engine has stopped")]
    Stopped,
    /// The message includes the runtime error's; it is not also its `source`, so a chain
    /// printed whole (`{:#}`) says it once.
    #[error("model: {0}")]
    Model(ferrite_runtime::RuntimeError),
}

impl From<ferrite_runtime::RuntimeError> for EngineError {
    fn from(e: ferrite_runtime::RuntimeError) -> EngineError {
        EngineError::Model(e)
    }
}
