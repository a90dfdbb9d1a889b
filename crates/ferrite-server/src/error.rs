//! `ApiError`: every way a request can fail, as an HTTP status plus an OpenAI-style body
//! `{"error": {"message", "type", "param", "code"}}`.
//!
//! Handlers return `Result<_, ApiError>`; engine validation errors (`EngineError`) convert
//! into 400s that say what is wrong. An error response carries its `ApiError` as a response
//! extension, so a surface with another error shape (Anthropic's `{"type": "error",
//! "error": {...}}`, `anthropic_body`) can re-render any error on its routes — those of the
//! handlers and those of the shared layers (401, 404, 405, 413) alike.
//!
//! A prompt (or prompt + max_tokens) past the context is worded as each provider words it,
//! since clients parse it to recover (Claude Code compacts on Anthropic's `prompt is too
//! long: N tokens > M maximum`): OpenAI's `This model's maximum context length is M
//! tokens. However, …` with code `context_length_exceeded` on the OpenAI surfaces.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use ferrite_engine::sampling::SamplingError;
use ferrite_engine::{EngineError, GuideError};
use serde_json::json;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, `context_length_exceeded`, ...).
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (sent as `Retry-After`).
    pub retry_after: Option<u64>,
    /// The message on Anthropic's routes, where Anthropic words this error otherwise.
    pub anthropic_message: Option<String>,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
            anthropic_message: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    /// A 400 about one request field.
    pub fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::bad_request(message).with_param(param)
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    pub fn with_param(mut self, param: impl Into<String>) -> ApiError {
        self.param = Some(param.into());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn with_retry_after(mut self, seconds: u64) -> ApiError {
        self.retry_after = Some(seconds);
        self
    }

    /// The OpenAI error `type` for this status.
    pub fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// Anthropic's error `type` for this status (a full queue is `overloaded_error`).
    pub fn anthropic_kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::TOO_MANY_REQUESTS if self.code == Some("queue_full") => "overloaded_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            s if s.is_server_error() => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// The Anthropic-style body.
    pub fn anthropic_body(&self) -> serde_json::Value {
        let message = self.anthropic_message.as_ref().unwrap_or(&self.message);
        json!({"type": "error", "error": {"type": self.anthropic_kind(), "message": message}})
    }

    /// A prompt of `prompt` tokens (with room asked for `max_tokens` more, when that is what
    /// overflows) past a context of `context`, in each provider's words.
    pub fn context_overflow(prompt: usize, max_tokens: Option<usize>, context: usize) -> ApiError {
        let (openai, anthropic) = match max_tokens {
            None => (
                format!(
                    "This model's maximum context length is {context} tokens. However, your messages resulted in \
                     {prompt} tokens. Please reduce the length of the messages."
                ),
                format!("prompt is too long: {prompt} tokens > {context} maximum"),
            ),
            Some(m) => (
                format!(
                    "This model's maximum context length is {context} tokens. However, you requested {} tokens \
                     ({prompt} in the messages, {m} in the completion). Please reduce the length of the messages \
                     or completion.",
                    prompt.saturating_add(m)
                ),
                format!(
                    "input length and `max_tokens` exceed context limit: {prompt} + {m} > {context}, decrease input \
                     length or `max_tokens` and try again"
                ),
            ),
        };
        let mut e = ApiError::bad_request(openai).with_code("context_length_exceeded");
        e.anthropic_message = Some(anthropic);
        e
    }

    /// The OpenAI-style body.
    pub fn openai_body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind(), "param": self.param, "code": self.code}})
    }

    /// A response with `body` and this error's status and headers.
    pub fn response_with(&self, body: serde_json::Value) -> Response {
        let mut resp = (self.status, axum::Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = self.response_with(self.openai_body());
        resp.extensions_mut().insert(self);
        resp
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> ApiError {
        let message = e.to_string();
        let bad = |param: &str| ApiError::invalid_param(param, message.clone());
        match &e {
            EngineError::EmptyPrompt | EngineError::TokenOutOfRange { .. } => bad("prompt"),
            &EngineError::PromptTooLong { prompt, context } => ApiError::context_overflow(prompt, None, context),
            &EngineError::MaxTokensTooLarge { prompt, max_tokens, context } => {
                ApiError::context_overflow(prompt, Some(max_tokens), context)
            }
            EngineError::KvTooSmall { .. } => ApiError::bad_request(message).with_code("context_length_exceeded"),
            EngineError::ZeroMaxTokens => bad("max_tokens"),
            EngineError::BadN { .. } => bad("n"),
            EngineError::TooManyLogprobs(_) => bad("top_logprobs"),
            EngineError::StopWithoutTokenizer => bad("stop"),
            EngineError::MinTokens { .. } => bad("min_tokens"),
            EngineError::KvPrecision { param, .. } => bad(param),
            EngineError::Sampling(s) => bad(sampling_param(s)),
            EngineError::Guide(GuideError::Matcher(_)) => ApiError::internal(message),
            EngineError::Guide(_) => ApiError::bad_request(message).with_code("invalid_constraint"),
            EngineError::CannotEmbed | EngineError::CannotGenerate => bad("model"),
            EngineError::EmbedInputTooLong { .. } => bad("input").with_code("context_length_exceeded"),
            EngineError::Stopped => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message),
            EngineError::UnknownAdapter(_) => {
                ApiError::not_found(message).with_param("model").with_code("model_not_found")
            }
            EngineError::AdapterInUse { .. } => {
                ApiError::new(StatusCode::CONFLICT, message).with_code("adapter_in_use")
            }
            EngineError::Adapter(_) => ApiError::bad_request(message).with_code("invalid_adapter"),
            EngineError::EmbedParams | EngineError::Config(_) | EngineError::Disk(_) | EngineError::Model(_) => {
                ApiError::internal(message)
            }
        }
    }
}

fn sampling_param(e: &SamplingError) -> &'static str {
    match e {
        SamplingError::Temperature(_) => "temperature",
        SamplingError::TopP(_) => "top_p",
        SamplingError::MinP(_) => "min_p",
        SamplingError::RepetitionPenalty(_) => "repetition_penalty",
        SamplingError::Penalty { name, .. } => name,
        SamplingError::BiasToken { .. } | SamplingError::BiasValue => "logit_bias",
    }
}
