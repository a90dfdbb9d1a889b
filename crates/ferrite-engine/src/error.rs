//! Typed errors of the engine: bad requests (the caller's fault) and model failures.

use crate::sampling::SamplingError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens but the context holds {context}")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error("the KV cache is out of blocks ({0} needed)")]
    OutOfBlocks(usize),
    #[error("model: {0}")]
    Model(#[from] ferrite_runtime::RuntimeError),
}
