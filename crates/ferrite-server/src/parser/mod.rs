//! Output parsing: generated text goes through an `OutputParser` that splits it into
//! content, reasoning and tool calls, incrementally, so the same parser serves streaming and
//! whole responses. The API layers render `Delta`s in their own shapes (OpenAI `content` /
//! `reasoning_content` / `tool_calls`; Anthropic text, thinking and tool_use blocks;
//! Responses output items).
//!
//! A `ParserFactory` picks a parser per request. The default, `TemplateParsers`, follows
//! the chat template's family (`family`): a `ReasoningParser` for templates with reasoning
//! tags around a `ToolCallParser` in the family's syntax when tools are offered, else plain
//! content. `json`, `gemma` and `scan` are their incremental building blocks; `markers`
//! puts back the special tokens they read, which decoding leaves out.

pub mod family;
mod gemma;
mod json;
pub mod markers;
mod reasoning;
mod scan;
#[cfg(test)]
mod tests;
mod tool_calls;

use serde_json::{Map, Value};

use family::OutputFormat;
use reasoning::ReasoningParser;
use tool_calls::ToolCallParser;

/// A piece of parsed output.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Content(String),
    Reasoning(String),
    ToolCall(ToolCallDelta),
}

/// What a parser gives when the generation ends: the deltas it held back, and, when the end
/// fell inside the latest announced tool call, the model's text of that call (`cut`; the
/// call's pieces so far were closed into valid JSON, what a streaming client already holds).
#[derive(Debug, Default)]
pub struct Finished {
    pub deltas: Vec<Delta>,
    pub cut: Option<String>,
}

impl Finished {
    /// `before`, then what `then` gave at its end.
    fn after(mut before: Vec<Delta>, then: Finished) -> Finished {
        before.extend(then.deltas);
        Finished { deltas: before, cut: then.cut }
    }
}

/// A whole reply through `parser`: its deltas, and whether the generation's end cut a tool
/// call short — that call is then not a call: its pieces give way to its text, as content,
/// and the reply ends as truncated.
pub fn parse_whole(parser: &mut dyn OutputParser, text: &str) -> (Vec<Delta>, bool) {
    let end = Finished::after(parser.push(text), parser.finish());
    let Some(text) = end.cut else { return (end.deltas, false) };
    let cut_index = end
        .deltas
        .iter()
        .filter_map(|d| match d {
            Delta::ToolCall(c) => Some(c.index),
            _ => None,
        })
        .max();
    let mut out: Vec<Delta> =
        end.deltas.into_iter().filter(|d| !matches!(d, Delta::ToolCall(c) if Some(c.index) == cut_index)).collect();
    out.push(Delta::Content(text));
    (out, true)
}

/// One streamed piece of a reply through `parser` (`last` when the generation ended with
/// it): its deltas, and whether the end cut a tool call short — the client keeps that call's
/// pieces, closed into valid JSON, and the reply ends as truncated.
pub fn parse_streamed(parser: &mut dyn OutputParser, text: &str, last: bool) -> (Vec<Delta>, bool) {
    let deltas = parser.push(text);
    if !last {
        return (deltas, false);
    }
    let end = Finished::after(deltas, parser.finish());
    (end.deltas, end.cut.is_some())
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
    fn finish(&mut self) -> Finished;
}

/// What a factory may look at to choose a parser.
#[derive(Debug, Clone, Copy)]
pub struct ParseContext<'a> {
    /// The tools offered to the model (empty when none, or hidden by `tool_choice: none`).
    pub tools: &'a [Value],
    /// The `chat_template_kwargs` of the request (e.g. `enable_thinking`).
    pub template_kwargs: &'a Map<String, Value>,
    /// The chat template's output syntax.
    pub format: &'a OutputFormat,
    /// The prompt ends inside a reasoning block (the reply starts as reasoning).
    pub reasoning_open: bool,
    /// The reply starts with a forced tool-call opening (its calls need not name an offered
    /// tool to count).
    pub forced: bool,
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

    fn finish(&mut self) -> Finished {
        Finished::default()
    }
}

/// The default factory: reasoning and tool calls as the template's family writes them.
pub struct TemplateParsers;

impl ParserFactory for TemplateParsers {
    fn parser(&self, ctx: &ParseContext<'_>) -> Box<dyn OutputParser> {
        let calls: Box<dyn OutputParser> = match ctx.format.tool_syntax() {
            Some(syntax) if !ctx.tools.is_empty() => {
                let names = if ctx.forced { None } else { Some(tool_names(ctx.tools)) };
                Box::new(ToolCallParser::new(syntax, names))
            }
            _ => Box::new(PlainText),
        };
        match ctx.format.reasoning {
            Some(tags) => Box::new(ReasoningParser::new(tags, ctx.reasoning_open, calls)),
            None => calls,
        }
    }
}

/// The function names of OpenAI-shaped `tools`.
pub fn tool_names(tools: &[Value]) -> Vec<String> {
    tools
        .iter()
        .filter_map(|t| t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str))
        .map(str::to_string)
        .collect()
}

/// A parser that has already read `prefix` (text the server put at the start of the reply,
/// like a forced tool-call opening); what that produced comes out first.
pub struct Primed {
    inner: Box<dyn OutputParser>,
    pending: Vec<Delta>,
}

impl Primed {
    pub fn new(mut inner: Box<dyn OutputParser>, prefix: &str) -> Primed {
        let pending = inner.push(prefix);
        Primed { inner, pending }
    }
}

impl OutputParser for Primed {
    fn push(&mut self, text: &str) -> Vec<Delta> {
        let mut out = std::mem::take(&mut self.pending);
        out.extend(self.inner.push(text));
        out
    }

    fn finish(&mut self) -> Finished {
        Finished::after(std::mem::take(&mut self.pending), self.inner.finish())
    }
}

/// A parser that lets only a reply's first tool call through (parallel tool calls turned
/// off); everything else passes unchanged.
pub struct FirstCallOnly {
    inner: Box<dyn OutputParser>,
}

impl FirstCallOnly {
    pub fn new(inner: Box<dyn OutputParser>) -> FirstCallOnly {
        FirstCallOnly { inner }
    }

    fn keep(deltas: Vec<Delta>) -> Vec<Delta> {
        deltas.into_iter().filter(|d| !matches!(d, Delta::ToolCall(c) if c.index > 0)).collect()
    }
}

impl OutputParser for FirstCallOnly {
    fn push(&mut self, text: &str) -> Vec<Delta> {
        FirstCallOnly::keep(self.inner.push(text))
    }

    fn finish(&mut self) -> Finished {
        let end = self.inner.finish();
        Finished { deltas: FirstCallOnly::keep(end.deltas), cut: end.cut }
    }
}
