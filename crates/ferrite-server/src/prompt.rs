//! Chat-template rendering and tokenization: OpenAI-style messages (already checked by the
//! API layer) are rendered with the model's chat template — with the tools, the generation
//! prompt and the `chat_template_kwargs` — and chat prompts are tokenized without adding
//! special tokens (the template writes BOS and the turn markers itself). Conversations
//! (`conversation`), which every chat-shaped API builds, render through here.

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

    /// Tokenize `text` (a tokenizer failure is a 500; no tokenizer is a 400).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ApiError> {
        self.tokenizer()?.encode(text, add_special_tokens).map_err(|e| ApiError::internal(e.to_string()))
    }

    /// Detokenize `ids`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ApiError> {
        self.tokenizer()?.decode(ids, skip_special_tokens).map_err(|e| ApiError::internal(e.to_string()))
    }
}
