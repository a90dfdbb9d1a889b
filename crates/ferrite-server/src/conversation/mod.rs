//! A chat-shaped request as every API surface hands it over — OpenAI-shaped messages and
//! function tools, a `ToolChoice`, template kwargs — made into a prompt and the parsers of
//! its reply. Each surface (OpenAI chat, Anthropic messages, Responses, `/tokenize`)
//! translates its own request into a `Conversation` and renders the parsed reply its own way.
//!
//! Tool choice: `none` hides the tools; `required` and a named function force a call by
//! appending the template family's tool-call opening (with the name, for a named function,
//! or for `required` with a single tool) to the prompt, and prime the parsers with it; the
//! reply is then constrained to the rest of one valid call (`forced`), so its arguments
//! validate against the tool's schema. A template that ignores tools gets them described by
//! the server (`described`). `single_tool_call` (chat and Responses
//! `parallel_tool_calls: false`, Anthropic `disable_parallel_tool_use`) ends the reply where
//! its first call ends and drops any later call. System messages past the start are rendered
//! where they stand, or merged into the leading one for a template that refuses them
//! (`system`).

mod described;
mod forced;
mod system;

use ferrite_engine::RequestParams;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::parser::family::{OutputFormat, ToolSupport};
use crate::parser::markers::SpecialMarkers;
use crate::parser::{tool_names, FirstCallOnly, OutputParser, ParseContext, ParserFactory, Primed};
use crate::prompt::ChatPrompt;
use crate::state::ModelInfo;

/// Which tool the reply must call.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// The model decides.
    #[default]
    Auto,
    /// No tools: they are not shown to the model.
    None,
    /// Some tool.
    Required,
    /// This function.
    Function(String),
}

/// A conversation to answer.
#[derive(Debug, Clone, Default)]
pub struct Conversation {
    /// OpenAI-shaped messages (roles system/user/assistant/tool, `tool_calls`, …), checked.
    pub messages: Vec<Value>,
    /// OpenAI-shaped function tools (`{"type": "function", "function": {...}}`), checked.
    pub tools: Vec<Value>,
    pub tool_choice: ToolChoice,
    /// Template kwargs (`enable_thinking`, `reasoning_effort`, …).
    pub kwargs: Map<String, Value>,
    pub add_generation_prompt: bool,
    /// At most one tool call in the reply (parallel tool calls turned off).
    pub single_tool_call: bool,
}

/// The text of a message's content (a string, or text parts joined by newlines).
fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => {
            parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join("\n")
        }
        _ => String::new(),
    }
}

/// What stands in a tool result for media the model cannot read (`kind`: image, document,
/// file): a short note, so the conversation goes on and the model knows something was there.
pub fn media_placeholder(kind: &str) -> String {
    format!("[{kind} omitted: this server cannot show {kind}s to the model]")
}

/// A conversation rendered through the chat template.
#[derive(Debug, Clone)]
pub struct RenderedChat {
    /// The prompt text, ending with the forced opening when there is one.
    pub text: String,
    /// Text appended to force a tool call (the parsers read it first).
    forced: Option<String>,
    /// The function a forced call names in its opening (`None`: the model picks one).
    forced_name: Option<String>,
    format: OutputFormat,
    reasoning_open: bool,
    /// The tools the reply is parsed for (none when hidden).
    tools: Vec<Value>,
    kwargs: Map<String, Value>,
    /// At most one tool call: the reply ends where the first ends.
    single_call: bool,
}

/// A rendered conversation with its prompt ids, ready to generate.
#[derive(Debug, Clone)]
pub struct PreparedChat {
    pub rendered: RenderedChat,
    pub prompt_ids: Vec<u32>,
    /// Special tokens the parsers read.
    pub markers: Option<SpecialMarkers>,
}

impl ModelInfo {
    /// The chat template's output format (every template has one; no template, no chat).
    fn output_format(&self) -> OutputFormat {
        self.chat_template
            .as_ref()
            .map_or(OutputFormat { tools: ToolSupport::Unknown, reasoning: None }, |t| OutputFormat::detect(t.source()))
    }

    /// Render `conv`: check its tool choice, describe tools for templates that ignore them,
    /// and append a forced tool-call opening.
    pub fn render_conversation(&self, conv: &Conversation) -> Result<RenderedChat, ApiError> {
        let format = self.output_format();
        let tools: Vec<Value> = if conv.tool_choice == ToolChoice::None { Vec::new() } else { conv.tools.clone() };
        let names = tool_names(&tools);
        match &conv.tool_choice {
            ToolChoice::Required if tools.is_empty() => {
                return Err(ApiError::invalid_param("tool_choice", "tool_choice 'required' needs at least one tool"));
            }
            ToolChoice::Function(name) if !names.contains(name) => {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    format!("tool_choice names the function '{name}', which is not among the tools"),
                ));
            }
            _ => {}
        }
        let mut text = match self.render_messages(conv, &conv.messages, &tools, &format) {
            Ok(text) => text,
            Err(e) => match system::merge_late_system(&conv.messages) {
                Some(merged) => self.render_messages(conv, &merged, &tools, &format).map_err(|_| e)?,
                None => return Err(e),
            },
        };
        let reasoning_open = format.prompt_opens_reasoning(&text);
        let forced = match &conv.tool_choice {
            // With one tool, "some tool" is that one.
            ToolChoice::Required if names.len() == 1 => Some(names.first().map(String::as_str)),
            ToolChoice::Required => Some(None),
            ToolChoice::Function(name) => Some(Some(name.as_str())),
            ToolChoice::Auto | ToolChoice::None => None,
        };
        let forced_name = forced.flatten().map(str::to_string);
        let forced = match forced {
            None => None,
            Some(name) => {
                let opening = format.tool_call_opening(name).ok_or_else(|| {
                    ApiError::invalid_param(
                        "tool_choice",
                        "this model's chat template writes tool calls in a format this server cannot force; \
                         use tool_choice 'auto'",
                    )
                })?;
                let close = format.reasoning.filter(|_| reasoning_open).map(|t| format!("{}\n\n", t.close));
                Some(close.unwrap_or_default() + &opening)
            }
        };
        text.push_str(forced.as_deref().unwrap_or(""));
        let single_call = conv.single_tool_call && !tools.is_empty();
        Ok(RenderedChat {
            text,
            forced,
            forced_name,
            format,
            reasoning_open,
            tools,
            kwargs: conv.kwargs.clone(),
            single_call,
        })
    }

    /// The prompt text of `conv` with `messages` in place of its own.
    fn render_messages(
        &self,
        conv: &Conversation,
        messages: &[Value],
        tools: &[Value],
        format: &OutputFormat,
    ) -> Result<String, ApiError> {
        if format.tools == ToolSupport::Described {
            return described::render(self, messages, conv, tools);
        }
        self.render_chat(&ChatPrompt {
            messages,
            tools: (!tools.is_empty()).then_some(tools),
            add_generation_prompt: conv.add_generation_prompt,
            kwargs: conv.kwargs.clone(),
        })
    }

    /// Render and tokenize `conv` (the template writes the special tokens itself).
    pub fn prepare_chat(&self, conv: &Conversation) -> Result<PreparedChat, ApiError> {
        let rendered = self.render_conversation(conv)?;
        let prompt_ids = self.encode(&rendered.text, false)?;
        let wanted = rendered.format.markers(!rendered.tools.is_empty());
        let markers = self.tokenizer.as_deref().and_then(|t| SpecialMarkers::find(t, &wanted));
        Ok(PreparedChat { rendered, prompt_ids, markers })
    }
}

impl PreparedChat {
    /// `params` for this conversation: a forced call, or the first call of a reply allowed
    /// only one, ends the reply where the call ends (a stop token when the end marker is a
    /// special token, else a stop string), and a forced call's output is constrained to one
    /// valid call (which takes the place of any `response_format`: a forced call's reply has
    /// no other content).
    pub fn request_params(&self, mut params: RequestParams) -> RequestParams {
        let forced = self.rendered.forced.is_some();
        if !forced && !self.rendered.single_call {
            return params;
        }
        let format = &self.rendered.format;
        if let Some(end) = format.tool_call_end() {
            match self.markers.as_ref().and_then(|m| m.id_of(end)) {
                Some(id) => params.stop_token_ids.push(id),
                None => params.stop.push(end.to_string()),
            }
        }
        if !forced {
            return params;
        }
        let args_token = self.markers.as_ref().and_then(|m| m.id_of("[ARGS]"));
        let call = format.tool_syntax().and_then(|syntax| {
            forced::call_constraint(syntax, &self.rendered.tools, self.rendered.forced_name.as_deref(), args_token)
        });
        if call.is_some() {
            params.constraint = call;
        }
        params
    }
}

impl RenderedChat {
    /// A parser for one choice, primed with the forced opening.
    pub fn parser(&self, factory: &dyn ParserFactory) -> Box<dyn OutputParser> {
        let ctx = ParseContext {
            tools: &self.tools,
            template_kwargs: &self.kwargs,
            format: &self.format,
            reasoning_open: self.reasoning_open,
            forced: self.forced.is_some(),
        };
        let mut parser = factory.parser(&ctx);
        if self.single_call {
            parser = Box::new(FirstCallOnly::new(parser));
        }
        match &self.forced {
            Some(prefix) => Box::new(Primed::new(parser, prefix)),
            None => parser,
        }
    }

    /// A parser for each of `n` choices.
    pub fn parsers(&self, factory: &dyn ParserFactory, n: usize) -> Vec<Box<dyn OutputParser>> {
        (0..n).map(|_| self.parser(factory)).collect()
    }
}
