//! Template families: what a chat template's source says about the model's output syntax —
//! how it writes tool calls (Hermes/Qwen `<tool_call>` JSON, Llama 3.x bare JSON, Mistral
//! `[TOOL_CALLS]` in its list or `[ARGS]` form, Gemma 4 `<|tool_call>call:…`), and how it
//! marks reasoning (`<think>`, Mistral's `[THINK]`, Gemma 4's thought channel).
//!
//! A template that never mentions tools gets them described by the server instead
//! (`ToolSupport::Described`, Hermes syntax). A template that handles tools some other way
//! (`Unknown`) gets its tools, but its output is not parsed for calls and a call cannot be
//! forced.

/// How a family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>` (Hermes, Qwen 2.5/3, Granite).
    Hermes,
    /// `{"name": …, "parameters": …}` as the whole reply, or after `<|python_tag|>` (Llama 3.x).
    Llama3Json,
    /// `[TOOL_CALLS][{"name": …, "arguments": …}, …]` (Mistral Nemo and older).
    MistralList,
    /// `[TOOL_CALLS]NAME[ARGS]{…}` (Mistral Small 3.2, Devstral, Ministral 3).
    MistralArgs,
    /// `<|tool_call>call:NAME{…}<tool_call|>` (Gemma 4).
    Gemma4,
}

/// Where tools come from in the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSupport {
    /// The template describes tools and asks for calls in this syntax.
    Template(ToolSyntax),
    /// The template ignores tools: the server describes them and asks for Hermes calls.
    Described,
    /// The template handles tools in a syntax this server does not parse.
    Unknown,
}

/// The marks around a reasoning block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReasoningTags {
    pub open: &'static str,
    pub close: &'static str,
}

pub const THINK: ReasoningTags = ReasoningTags { open: "<think>", close: "</think>" };
const MISTRAL_THINK: ReasoningTags = ReasoningTags { open: "[THINK]", close: "[/THINK]" };
const GEMMA_THOUGHT: ReasoningTags = ReasoningTags { open: "<|channel>thought", close: "<channel|>" };

/// A template's output syntax.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputFormat {
    pub tools: ToolSupport,
    pub reasoning: Option<ReasoningTags>,
}

impl OutputFormat {
    /// The format a chat template's source implies.
    pub fn detect(source: &str) -> OutputFormat {
        let has = |s: &str| source.contains(s);
        let tools = if has("<|tool_call>call:") {
            ToolSupport::Template(ToolSyntax::Gemma4)
        } else if has("[TOOL_CALLS]") && has("[ARGS]") {
            ToolSupport::Template(ToolSyntax::MistralArgs)
        } else if has("[TOOL_CALLS]") {
            ToolSupport::Template(ToolSyntax::MistralList)
        } else if has("<tool_call>")
            && (has("{\"name\"") || has("{\\\"name\\\""))
            && !has("<function=")
            && !has("<arg_key>")
        {
            ToolSupport::Template(ToolSyntax::Hermes)
        } else if has("<|start_header_id|>") && has("\"parameters\"") {
            ToolSupport::Template(ToolSyntax::Llama3Json)
        } else if !has("tool") {
            ToolSupport::Described
        } else {
            ToolSupport::Unknown
        };
        let reasoning = if has("<|channel>") {
            Some(GEMMA_THOUGHT)
        } else if has("[THINK]") {
            Some(MISTRAL_THINK)
        } else if has("<think>") {
            Some(THINK)
        } else {
            None
        };
        OutputFormat { tools, reasoning }
    }

    /// The syntax tool calls are parsed in, when known.
    pub fn tool_syntax(&self) -> Option<ToolSyntax> {
        match self.tools {
            ToolSupport::Template(s) => Some(s),
            ToolSupport::Described => Some(ToolSyntax::Hermes),
            ToolSupport::Unknown => None,
        }
    }

    /// The text that makes the model's reply a tool call — of the function `name` when
    /// given (its arguments come next), of a function it picks otherwise. `None` when this
    /// family's syntax is unknown.
    pub fn tool_call_opening(&self, name: Option<&str>) -> Option<String> {
        let syntax = self.tool_syntax()?;
        let quoted = name.map(|n| serde_json::Value::from(n).to_string());
        Some(match (syntax, name, quoted) {
            (ToolSyntax::Hermes, _, None) => "<tool_call>\n{\"name\": \"".to_string(),
            (ToolSyntax::Hermes, _, Some(q)) => format!("<tool_call>\n{{\"name\": {q}, \"arguments\": "),
            (ToolSyntax::Llama3Json, _, None) => "{\"name\": \"".to_string(),
            (ToolSyntax::Llama3Json, _, Some(q)) => format!("{{\"name\": {q}, \"parameters\": "),
            (ToolSyntax::MistralList, _, None) => "[TOOL_CALLS][{\"name\": \"".to_string(),
            (ToolSyntax::MistralList, _, Some(q)) => format!("[TOOL_CALLS][{{\"name\": {q}, \"arguments\": "),
            (ToolSyntax::MistralArgs, None, _) => "[TOOL_CALLS]".to_string(),
            (ToolSyntax::MistralArgs, Some(n), _) => format!("[TOOL_CALLS]{n}[ARGS]"),
            (ToolSyntax::Gemma4, None, _) => "<|tool_call>call:".to_string(),
            (ToolSyntax::Gemma4, Some(n), _) => format!("<|tool_call>call:{n}{{"),
        })
    }

    /// The text that ends a call, where the syntax has one (a forced call stops there).
    pub fn tool_call_end(&self) -> Option<&'static str> {
        match self.tool_syntax()? {
            ToolSyntax::Hermes => Some("</tool_call>"),
            ToolSyntax::Gemma4 => Some("<tool_call|>"),
            ToolSyntax::Llama3Json | ToolSyntax::MistralList | ToolSyntax::MistralArgs => None,
        }
    }

    /// The marker texts the parsers read: the tool-call syntax's (when tools are parsed) and
    /// the reasoning tags. Those that are special tokens must be put back into the text,
    /// which decoding leaves them out of.
    pub fn markers(&self, tools: bool) -> Vec<&'static str> {
        let mut out: Vec<&'static str> = match self.tool_syntax().filter(|_| tools) {
            None => vec![],
            Some(ToolSyntax::Hermes) => vec!["<tool_call>", "</tool_call>"],
            Some(ToolSyntax::Llama3Json) => vec!["<|python_tag|>"],
            Some(ToolSyntax::MistralList) => vec!["[TOOL_CALLS]"],
            Some(ToolSyntax::MistralArgs) => vec!["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"],
            Some(ToolSyntax::Gemma4) => vec!["<|tool_call>", "<tool_call|>", super::gemma::QUOTE],
        };
        if let Some(tags) = self.reasoning {
            // Gemma's open tag is a special token and a word: the token is the marker.
            out.push(tags.open.strip_suffix("thought").unwrap_or(tags.open));
            out.push(tags.close);
        }
        out
    }

    /// Whether `prompt` ends inside a reasoning block the template opened (the model's
    /// reply then starts as reasoning).
    pub fn prompt_opens_reasoning(&self, prompt: &str) -> bool {
        self.reasoning.is_some_and(|tags| prompt.rfind(tags.open).is_some_and(|at| !prompt[at..].contains(tags.close)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detect_file(name: &str) -> Option<OutputFormat> {
        let dir = ferrite_models::paths::test_assets_dir().join("llama.cpp-models/templates");
        std::fs::read_to_string(dir.join(name)).ok().map(|s| OutputFormat::detect(&s))
    }

    #[test]
    fn families_of_known_templates() {
        use ToolSupport::*;
        use ToolSyntax::*;
        let cases = [
            ("Qwen-Qwen2.5-7B-Instruct.jinja", Template(Hermes), None),
            ("Qwen-Qwen3-0.6B.jinja", Template(Hermes), Some(THINK)),
            ("Qwen-QwQ-32B.jinja", Template(Hermes), Some(THINK)),
            ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", Template(Hermes), None),
            ("ibm-granite-granite-4.0.jinja", Template(Hermes), None),
            ("meta-llama-Llama-3.1-8B-Instruct.jinja", Template(Llama3Json), None),
            ("meta-llama-Llama-3.2-3B-Instruct.jinja", Template(Llama3Json), None),
            ("meta-llama-Llama-3.3-70B-Instruct.jinja", Template(Llama3Json), None),
            ("mistralai-Mistral-Nemo-Instruct-2407.jinja", Template(MistralList), None),
            ("Mistral-Small-3.2-24B-Instruct-2506.jinja", Template(MistralArgs), None),
            ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", Template(MistralArgs), Some(MISTRAL_THINK)),
            ("google-gemma-4-31B-it.jinja", Template(Gemma4), Some(GEMMA_THOUGHT)),
            ("google-gemma-2-2b-it.jinja", Described, None),
            ("Qwen3-Coder.jinja", Unknown, None),
            ("GLM-4.6.jinja", Unknown, Some(THINK)),
            ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", Unknown, Some(THINK)),
        ];
        let mut seen = 0;
        for (file, tools, reasoning) in cases {
            let Some(format) = detect_file(file) else { continue };
            seen += 1;
            assert_eq!(format, OutputFormat { tools, reasoning }, "{file}");
        }
        if seen == 0 {
            eprintln!("test assets missing (scripts/fetch_test_assets.sh): template families not checked");
        }
    }

    #[test]
    fn openings_and_open_reasoning() {
        let hermes = OutputFormat { tools: ToolSupport::Described, reasoning: Some(THINK) };
        assert_eq!(
            hermes.tool_call_opening(Some("get \"w\"")).as_deref(),
            Some("<tool_call>\n{\"name\": \"get \\\"w\\\"\", \"arguments\": ")
        );
        let unknown = OutputFormat { tools: ToolSupport::Unknown, reasoning: None };
        assert_eq!(unknown.tool_call_opening(None), None);
        assert!(hermes.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!hermes.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!hermes.prompt_opens_reasoning("<|im_start|>assistant\n"));
        assert_eq!(hermes.markers(false), vec!["<think>", "</think>"]);
        let gemma = OutputFormat { tools: ToolSupport::Template(ToolSyntax::Gemma4), reasoning: Some(GEMMA_THOUGHT) };
        assert_eq!(gemma.markers(true), vec!["<|tool_call>", "<tool_call|>", "<|\"|>", "<|channel>", "<channel|>"]);
        assert!(!gemma.prompt_opens_reasoning("<|turn>model\n<|channel>thought\n<channel|>"));
    }
}
