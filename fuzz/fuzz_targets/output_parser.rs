//! The tool-call and reasoning parsers on arbitrary model output. The first byte picks the
//! syntax (every family the server parses, with or without reasoning tags, offered or forced
//! tools, a reply that opens in reasoning), the second how the text is cut into the pieces
//! it is pushed in (streamed decoding hands the parser arbitrary boundaries); the rest is the
//! text. Whatever comes out, a whole-text parse and a piecewise parse must agree.
#![no_main]

use ferrite_server::parser::family::{OutputFormat, ReasoningTags, ToolSupport, ToolSyntax, THINK};
use ferrite_server::parser::{Delta, OutputParser, ParseContext, ParserFactory, TemplateParsers};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map};

const SYNTAXES: [ToolSupport; 7] = [
    ToolSupport::Template(ToolSyntax::Hermes),
    ToolSupport::Template(ToolSyntax::Llama3Json),
    ToolSupport::Template(ToolSyntax::MistralList),
    ToolSupport::Template(ToolSyntax::MistralArgs),
    ToolSupport::Template(ToolSyntax::Gemma4),
    ToolSupport::Described,
    ToolSupport::Unknown,
];
const REASONING: [Option<ReasoningTags>; 3] =
    [None, Some(THINK), Some(ReasoningTags { open: "<|channel>thought", close: "<channel|>" })];

/// Every delta run through one parser, with adjacent text of one kind merged, a call's
/// argument pieces joined (the split of a stream into deltas is not part of the contract) and
/// call ids blanked (they are random).
fn parse(parser: &mut dyn OutputParser, pieces: &[&str]) -> Vec<Delta> {
    let mut out: Vec<Delta> = Vec::new();
    let deltas = pieces.iter().flat_map(|p| parser.push(p)).collect::<Vec<_>>();
    for d in deltas.into_iter().chain(parser.finish().deltas) {
        match (out.last_mut(), d) {
            (Some(Delta::Content(a)), Delta::Content(b)) | (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) => {
                a.push_str(&b)
            }
            (Some(Delta::ToolCall(a)), Delta::ToolCall(b)) if a.index == b.index && b.id.is_none() => {
                a.arguments.push_str(&b.arguments)
            }
            (_, Delta::ToolCall(mut c)) => {
                c.id = c.id.map(|_| String::new());
                out.push(Delta::ToolCall(c))
            }
            (_, d) => out.push(d),
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let [mode, cut, text @ ..] = data else { return };
    let Ok(text) = std::str::from_utf8(text) else { return };
    let format = OutputFormat {
        tools: SYNTAXES[*mode as usize % SYNTAXES.len()],
        reasoning: REASONING[(*mode as usize / SYNTAXES.len()) % REASONING.len()],
    };
    let tools = [json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}})];
    let kwargs = Map::new();
    let ctx = ParseContext {
        tools: &tools,
        template_kwargs: &kwargs,
        format: &format,
        reasoning_open: mode & 0x40 != 0,
        forced: mode & 0x80 != 0,
    };
    let whole = parse(TemplateParsers.parser(&ctx).as_mut(), &[text]);
    // Cut every `cut % 7 + 1` characters (on char boundaries).
    let step = *cut as usize % 7 + 1;
    let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).step_by(step).chain([text.len()]).collect();
    let pieces: Vec<&str> = bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect();
    let piecewise = parse(TemplateParsers.parser(&ctx).as_mut(), &pieces);
    assert_eq!(whole, piecewise, "format {format:?}, pieces {pieces:?}");
});
