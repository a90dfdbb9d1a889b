//! The output-parser hook: generated text goes through an `OutputParser` that splits it into
//! content, reasoning (`<think>…</think>`) and tool calls, incrementally, so the same parser
//! serves streaming and whole responses. The API layers render `Delta`s in their own shapes
//! (OpenAI `content` / `reasoning_content` / `tool_calls`; Anthropic text, thinking and
//! tool_use blocks).
//!
//! A `ParserFactory` picks a parser per request (from the chat template family, the tools
//! offered, the template kwargs). `PlainTextParsers`, the default, passes all text through as
//! content; tool-call and reasoning parsers plug in here.

use serde_json::{Map, Value};

/// A piece of parsed output.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Content(String),
    Reasoning(String),
    ToolCall(ToolCallDelta),
}

/// A piece of one tool call: the first piece of a call carries its `id` and `name`; later
/// pieces extend its JSON `arguments` text.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallDelta {
    /// Which call of this choice (0, 1, ...).
    pub index: usize,
    pub id: Option<String>,
    pub name: Option<String>,
    pub arguments: String,
}

/// Turns one choice's text deltas into parsed deltas.
pub trait OutputParser: Send {
    /// Feed newly generated text; returns what can be decided now (text that may be the start
    /// of markup is held back).
    fn push(&mut self, text: &str) -> Vec<Delta>;
    /// The generation ended: flush what was held back.
    fn finish(&mut self) -> Vec<Delta>;
}

/// What a factory may look at to choose a parser.
#[derive(Debug, Clone, Copy)]
pub struct ParseContext<'a> {
    /// The tools offered to the model (empty when none).
    pub tools: &'a [Value],
    /// The `chat_template_kwargs` of the request (e.g. `enable_thinking`).
    pub template_kwargs: &'a Map<String, Value>,
}

pub trait ParserFactory: Send + Sync {
    /// A fresh parser for one choice.
    fn parser(&self, ctx: &ParseContext<'_>) -> Box<dyn OutputParser>;
}

/// All text is content.
pub struct PlainText;

impl OutputParser for PlainText {
    fn push(&mut self, text: &str) -> Vec<Delta> {
        if text.is_empty() {
            Vec::new()
        } else {
            vec![Delta::Content(text.to_string())]
        }
    }

    fn finish(&mut self) -> Vec<Delta> {
        Vec::new()
    }
}

/// The default factory: `PlainText` for every request.
pub struct PlainTextParsers;

impl ParserFactory for PlainTextParsers {
    fn parser(&self, _ctx: &ParseContext<'_>) -> Box<dyn OutputParser> {
        Box::new(PlainText)
    }
}
