//! Chat templates: a model's Jinja chat template rendered the way Hugging Face transformers
//! renders it, byte for byte.
//!
//! [`ChatTemplate`] compiles the template once (minijinja, with the Jinja2 sandbox settings
//! HF uses: `trim_blocks`, `lstrip_blocks`, loop controls) and renders OpenAI-style
//! messages with [`ChatTemplate::render`]. The template sees what `apply_chat_template`
//! gives it: `messages`, `tools` (`None` when absent), `documents` (`None`),
//! `add_generation_prompt`, `bos_token`/`eos_token` (when known), and every
//! `chat_template_kwargs` entry (`enable_thinking`, `reasoning_effort`, `date_string`, …) as
//! a top-level variable. HF's extras are there: `raise_exception(msg)` (a
//! [`ChatTemplateError::Raised`]), `strftime_now(fmt)`, and `tojson` with `indent`,
//! `separators`, `ensure_ascii`, `sort_keys` (Python's `json.dumps`, no HTML escaping);
//! Python's string/dict methods (`.strip()`, `.items()`, `.get()`, …) work, and values print
//! as Python prints them (`None`, `True`, `{'a': 1}`).
//!
//! Before rendering, messages are made ready (see `messages.rs`): a tool call's
//! `function.arguments` sent as a JSON string becomes a mapping (many templates iterate
//! `arguments.items()` or pipe it to `tojson`), and for templates that only print string
//! content, a list of content parts is joined into one string.
//!
//! **BOS**: many templates emit `bos_token` themselves (Llama 3, Gemma, Mistral,
//! DeepSeek, …). The rendered text then already starts with the BOS string, so the caller
//! must tokenize it *without* adding BOS again (a doubled BOS degrades output).
//! [`ChatTemplate::renders_bos`] says whether this template does so;
//! [`ChatTemplate::starts_with_bos`] checks one rendered prompt.
//!
//! Where the template comes from: a GGUF's `tokenizer.chat_template` string (read by the
//! caller and passed to [`ChatTemplate::new`]), or a model directory
//! ([`ModelChatTemplates::from_model_dir`]).

mod env;
mod messages;
mod model_dir;
mod pyfmt;

use std::path::{Path, PathBuf};

use chrono::NaiveDateTime;
use minijinja::value::Value as JinjaValue;
use minijinja::Environment;
use serde_json::{json, Value};

pub use model_dir::ModelChatTemplates;

use env::{build_environment, strip_generation_tags, RaisedException, TEMPLATE_NAME};
use messages::{has_string_arguments, prepare_messages};

/// What can go wrong compiling, finding or rendering a chat template (one-line messages).
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("chat template syntax error{}: {message}", at_line(*.line))]
    Syntax { line: Option<usize>, message: String },
    #[error("chat template render error{}: {message}", at_line(*.line))]
    Render { line: Option<usize>, message: String },
    /// The template called `raise_exception(message)`: it refuses this conversation.
    #[error("chat template raised an exception: {0}")]
    Raised(String),
    #[error("no chat template named {name:?} (available: {available})")]
    NotFound { name: String, available: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
}

fn at_line(line: Option<usize>) -> String {
    line.map(|l| format!(" at line {l}")).unwrap_or_default()
}

impl ChatTemplateError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        ChatTemplateError::Io { path: path.to_path_buf(), source }
    }
    pub(crate) fn config(path: &Path, message: impl Into<String>) -> Self {
        ChatTemplateError::Config { path: path.to_path_buf(), message: message.into() }
    }

    fn from_render(err: minijinja::Error) -> Self {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&err);
        while let Some(e) = cause {
            if let Some(raised) = e.downcast_ref::<RaisedException>() {
                return ChatTemplateError::Raised(one_line(&raised.0));
            }
            cause = e.source();
        }
        ChatTemplateError::Render { line: err.line(), message: describe(&err) }
    }

    fn from_compile(err: minijinja::Error) -> Self {
        ChatTemplateError::Syntax { line: err.line(), message: describe(&err) }
    }
}

fn describe(err: &minijinja::Error) -> String {
    one_line(&match err.detail() {
        Some(detail) => format!("{}: {detail}", err.kind()),
        None => err.kind().to_string(),
    })
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// One render: OpenAI-style `messages` (`role`, `content` as a string or a list of parts,
/// `tool_calls`, `tool_call_id`, `name`, `reasoning_content`, …), the function `tools`, and
/// `extra` = `chat_template_kwargs`, passed as top-level template variables (they may
/// override `bos_token`/`eos_token`/`documents`, not `messages`, `tools` or
/// `add_generation_prompt`).
#[derive(Debug, Clone, Default)]
pub struct ChatRenderRequest<'a> {
    pub messages: &'a [Value],
    pub tools: Option<&'a [Value]>,
    pub add_generation_prompt: bool,
    pub extra: serde_json::Map<String, Value>,
}

impl<'a> ChatRenderRequest<'a> {
    /// Messages only, with the generation prompt (the usual chat request).
    pub fn new(messages: &'a [Value]) -> Self {
        ChatRenderRequest { messages, tools: None, add_generation_prompt: true, extra: Default::default() }
    }
}

/// A compiled chat template with its special tokens. Cheap to share (`Send + Sync`).
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    content_parts: bool,
    renders_bos: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("content_parts", &self.content_parts)
            .field("renders_bos", &self.renders_bos)
            .finish()
    }
}

const PROBE_TEXT: &str = "ferrite-probe-7a1c";

impl ChatTemplate {
    /// Compiles `source`; a syntax error names the problem and its line.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self, ChatTemplateError> {
        let mut env = build_environment();
        env.add_template_owned(TEMPLATE_NAME, strip_generation_tags(source))
            .map_err(ChatTemplateError::from_compile)?;
        let mut template = ChatTemplate {
            env,
            source: source.to_string(),
            bos_token,
            eos_token,
            content_parts: false,
            renders_bos: false,
        };
        template.probe();
        Ok(template)
    }

    /// Fixes the time `strftime_now` sees (else the local time at each render): for
    /// reproducible prompts and tests.
    pub fn with_fixed_now(mut self, now: NaiveDateTime) -> Self {
        self.env.add_function("strftime_now", move |format: &str| env::strftime_now(Some(now), format));
        self
    }

    /// Renders one conversation. Tool-call arguments sent as JSON strings are given to the
    /// template as mappings; if that fails to render (a template that concatenates them as
    /// text), the render is retried with the strings as sent.
    pub fn render(&self, req: &ChatRenderRequest<'_>) -> Result<String, ChatTemplateError> {
        let flatten = !self.content_parts;
        let messages = prepare_messages(req.messages, flatten, true);
        match self.render_prepared(&messages, req.tools, req.add_generation_prompt, &req.extra) {
            Err(err @ ChatTemplateError::Render { .. }) if has_string_arguments(req.messages) => {
                let raw = prepare_messages(req.messages, flatten, false);
                self.render_prepared(&raw, req.tools, req.add_generation_prompt, &req.extra).map_err(|_| err)
            }
            other => other,
        }
    }

    fn render_prepared(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String, ChatTemplateError> {
        let mut ctx: Vec<(String, JinjaValue)> = Vec::with_capacity(extra.len() + 6);
        if let Some(bos) = &self.bos_token {
            ctx.push(("bos_token".into(), JinjaValue::from(bos.as_str())));
        }
        if let Some(eos) = &self.eos_token {
            ctx.push(("eos_token".into(), JinjaValue::from(eos.as_str())));
        }
        ctx.push(("documents".into(), JinjaValue::from(())));
        for (key, value) in extra {
            ctx.push((key.clone(), JinjaValue::from_serialize(value)));
        }
        ctx.push(("messages".into(), JinjaValue::from_serialize(messages)));
        ctx.push(("tools".into(), tools.map_or(JinjaValue::from(()), JinjaValue::from_serialize)));
        ctx.push(("add_generation_prompt".into(), JinjaValue::from(add_generation_prompt)));
        let template = self.env.get_template(TEMPLATE_NAME).map_err(ChatTemplateError::from_render)?;
        template.render(JinjaValue::from_iter(ctx)).map_err(ChatTemplateError::from_render)
    }

    /// Renders two probe conversations to learn whether the template iterates content
    /// parts, and whether it emits `bos_token` itself.
    fn probe(&mut self) {
        let none = serde_json::Map::new();
        let parts = [json!({"role": "user", "content": [{"type": "text", "text": PROBE_TEXT}]})];
        self.content_parts = self
            .render_prepared(&prepare_messages(&parts, false, true), None, true, &none)
            .is_ok_and(|out| out.contains(PROBE_TEXT) && !out.contains("'text'") && !out.contains("\"text\""));
        let plain = [json!({"role": "user", "content": PROBE_TEXT})];
        self.renders_bos = match self.bos_token.as_deref() {
            None | Some("") => false,
            Some(bos) => match self.render_prepared(&plain, None, true, &none) {
                Ok(out) => out.starts_with(bos),
                Err(_) => self.source.contains("bos_token"),
            },
        };
    }

    /// Whether rendered prompts start with `bos_token`: if so, tokenize them without adding
    /// BOS again.
    pub fn renders_bos(&self) -> bool {
        self.renders_bos
    }

    /// Whether this rendered prompt starts with `bos_token`.
    pub fn starts_with_bos(&self, rendered: &str) -> bool {
        self.bos_token.as_deref().is_some_and(|bos| !bos.is_empty() && rendered.starts_with(bos))
    }

    /// Whether the template iterates content parts itself (else list content is joined into
    /// a string before rendering).
    pub fn accepts_content_parts(&self) -> bool {
        self.content_parts
    }

    /// The template source as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }
}
