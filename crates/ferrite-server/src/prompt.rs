//! Chat-template rendering and tokenization: OpenAI-style messages (already checked by the
//! API layer) are rendered with the model's chat template — with the tools, the generation
//! prompt and the `chat_template_kwargs` — and chat prompts are tokenized without adding
//! special tokens (the template writes BOS and the turn markers itself). Conversations
//! (`conversation`), which every chat-shaped API builds, render through here. Text too long
//! for the context is refused before it is tokenized.

use ferrite_models::chat_template::{ChatRenderRequest, ChatTemplateError};
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::state::ModelInfo;

/// A conversation to render.
#[derive(Debug, Clone, Default)]
pub struct ChatPrompt<'a> {
    pub messages: &'a [Value],
    pub tools: Option<&'a [Value]>,
    pub add_generation_prompt: bool,
    pub kwargs: Map<String, Value>,
}

impl ModelInfo {
    /// The prompt text of `chat` through this model's template.
    pub fn render_chat(&self, chat: &ChatPrompt<'_>) -> Result<String, ApiError> {
        let template = self.chat_template.as_ref().ok_or_else(|| {
            ApiError::bad_request("this model has no chat template; use /v1/completions with a raw prompt")
        })?;
        let req = ChatRenderRequest {
            messages: chat.messages,
            tools: chat.tools,
            add_generation_prompt: chat.add_generation_prompt,
            extra: chat.kwargs.clone(),
        };
        template.render(&req).map_err(|e| match e {
            // The template refused this conversation, or could not render what was sent.
            ChatTemplateError::Raised(_) | ChatTemplateError::Render { .. } => {
                ApiError::invalid_param("messages", e.to_string())
            }
            other => ApiError::internal(other.to_string()),
        })
    }

    /// Tokenize `text` (a tokenizer failure is a 500; no tokenizer is a 400). Text longer
    /// than `max_text_bytes` is a 400 before any tokenizing: it cannot fit the context.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ApiError> {
        if text.len() > self.max_text_bytes {
            return Err(ApiError::bad_request(format!(
                "the prompt is {} bytes; no prompt over {} bytes fits this model's context",
                text.len(),
                self.max_text_bytes
            ))
            .with_code("context_length_exceeded"));
        }
        self.tokenizer()?.encode(text, add_special_tokens).map_err(|e| ApiError::internal(e.to_string()))
    }

    /// Tokenize `text` with the special tokens, cut to `max_tokens` as transformers truncates
    /// (an embedding input longer than its model's `max_seq_length`, as sentence-transformers
    /// does). No byte bound: the text is cut, never refused, so only the body limit bounds it.
    pub fn encode_truncated(&self, text: &str, max_tokens: usize) -> Result<Vec<u32>, ApiError> {
        self.tokenizer()?.encode_truncated(text, max_tokens).map_err(|e| ApiError::internal(e.to_string()))
    }

    /// The most bytes of text `context` tokens can spell: every token's piece is at most as
    /// long as its vocabulary entry (byte-level, SentencePiece and byte-fallback entries are
    /// never shorter than what they decode to), doubled for normalizers that drop characters.
    pub fn text_bound(&self, context: usize) -> usize {
        let Some(tok) = &self.tokenizer else { return usize::MAX };
        let longest = (0..tok.vocab_size() as u32).filter_map(|id| tok.id_to_token(id)).map(|t| t.len()).max();
        context.saturating_mul(longest.unwrap_or(1).max(1)).saturating_mul(2)
    }

    /// Detokenize `ids`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ApiError> {
        self.tokenizer()?.decode(ids, skip_special_tokens).map_err(|e| ApiError::internal(e.to_string()))
    }
}
