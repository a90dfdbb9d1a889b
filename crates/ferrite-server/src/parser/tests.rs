//! The parsers on each family's output, fed whole, one character at a time and split at
//! every point (tags cut across deltas): the result must not depend on how text arrives.

use serde_json::{json, Map, Value};

use super::family::{OutputFormat, ReasoningTags, ToolSupport, ToolSyntax, THINK};
use super::*;

/// What a parser made of a reply: content, reasoning, and (name, arguments) per call.
#[derive(Debug, Default, PartialEq)]
struct Reply {
    content: String,
    reasoning: String,
    calls: Vec<(String, Value)>,
    /// The text of a call the end of the generation cut short (`Finished::cut`).
    cut: Option<String>,
}

fn tools() -> Vec<Value> {
    ["get_weather", "f", "a", "b"]
        .iter()
        .map(|n| json!({"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}))
        .collect()
}

fn parser(syntax: Option<ToolSyntax>, reasoning: Option<ReasoningTags>, opened: bool) -> Box<dyn OutputParser> {
    make_parser(syntax, reasoning, opened, false)
}

fn make_parser(
    syntax: Option<ToolSyntax>,
    reasoning: Option<ReasoningTags>,
    opened: bool,
    forced: bool,
) -> Box<dyn OutputParser> {
    let tools = match syntax {
        Some(s) => ToolSupport::Template(s),
        None => ToolSupport::Unknown,
    };
    let format = OutputFormat { tools, reasoning };
    let offered = tools_list(syntax.is_some());
    let kwargs = Map::new();
    let ctx =
        ParseContext { tools: &offered, template_kwargs: &kwargs, format: &format, reasoning_open: opened, forced };
    TemplateParsers.parser(&ctx)
}

fn tools_list(on: bool) -> Vec<Value> {
    if on {
        tools()
    } else {
        vec![]
    }
}

/// Merge deltas and what the parser gave at the end, checking each call starts with its id
/// and name, in index order.
fn merge_finished(deltas: Vec<Delta>, end: Finished) -> Reply {
    let mut all = deltas;
    all.extend(end.deltas);
    let mut r = merge(all);
    r.cut = end.cut;
    r
}

/// Merge deltas, checking each call starts with its id and name, in index order.
fn merge(deltas: Vec<Delta>) -> Reply {
    let mut r = Reply::default();
    let mut args: Vec<String> = Vec::new();
    for d in deltas {
        match d {
            Delta::Content(t) => r.content.push_str(&t),
            Delta::Reasoning(t) => r.reasoning.push_str(&t),
            Delta::ToolCall(c) => {
                if c.index == r.calls.len() {
                    assert!(c.id.as_deref().is_some_and(|id| id.starts_with("call_")), "first piece has the id");
                    r.calls.push((c.name.clone().expect("first piece has the name"), Value::Null));
                    args.push(String::new());
                } else {
                    assert_eq!(c.index + 1, r.calls.len(), "pieces of the latest call");
                    assert!(c.id.is_none() && c.name.is_none());
                }
                args[c.index].push_str(&c.arguments);
            }
        }
    }
    for (call, text) in r.calls.iter_mut().zip(args) {
        call.1 = serde_json::from_str(&text).unwrap_or_else(|e| panic!("arguments {text:?} are not JSON: {e}"));
    }
    r
}

fn feed(mut p: Box<dyn OutputParser>, pieces: &[&str]) -> Reply {
    let mut deltas = Vec::new();
    for piece in pieces {
        deltas.extend(p.push(piece));
    }
    let end = p.finish();
    merge_finished(deltas, end)
}

/// Parse `text` whole, char by char and split in two at every char boundary; all must agree.
fn parse_every_way(make: &dyn Fn() -> Box<dyn OutputParser>, text: &str) -> Reply {
    let whole = feed(make(), &[text]);
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let by_char = feed(make(), &chars.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(by_char, whole, "char by char: {text:?}");
    for (at, _) in text.char_indices().skip(1) {
        let split = feed(make(), &[&text[..at], &text[at..]]);
        assert_eq!(split, whole, "split at {at}: {:?} | {:?}", &text[..at], &text[at..]);
    }
    whole
}

fn reply(content: &str, reasoning: &str, calls: &[(&str, Value)]) -> Reply {
    Reply {
        content: content.into(),
        reasoning: reasoning.into(),
        calls: calls.iter().map(|(n, a)| (n.to_string(), a.clone())).collect(),
        cut: None,
    }
}

/// A streamed reply whose last call was cut short: `calls` end with that call, closed.
fn cut_reply(content: &str, calls: &[(&str, Value)], cut: &str) -> Reply {
    Reply { cut: Some(cut.into()), ..reply(content, "", calls) }
}

/// `text` as a whole reply (`parse_whole`), and whether it was cut.
fn whole(syntax: ToolSyntax, text: &str) -> (Reply, bool) {
    let (deltas, cut) = parse_whole(with(syntax)().as_mut(), text);
    (merge(deltas), cut)
}

fn with(syntax: ToolSyntax) -> impl Fn() -> Box<dyn OutputParser> {
    move || parser(Some(syntax), None, false)
}

#[test]
fn hermes_calls_between_text() {
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"n\": [1, 2.5]}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n";
    let got = parse_every_way(&with(ToolSyntax::Hermes), text);
    let want =
        reply("Let me check.", "", &[("get_weather", json!({"city": "Paris", "n": [1, 2.5]})), ("f", json!({}))]);
    assert_eq!(got, want);
}

#[test]
fn hermes_malformed_json_is_content() {
    for text in [
        "<tool_call>\nnot json\n</tool_call>",
        "<tool_call>{\"name\": 42}</tool_call> done",
        "<tool_call>{\"nam",
        "a <tool_call",
    ] {
        assert_eq!(parse_every_way(&with(ToolSyntax::Hermes), text), reply(text, "", &[]), "{text}");
    }
}

#[test]
fn hermes_calls_cut_short_are_closed() {
    let cut = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"ab\\\"c";
    let got = parse_every_way(&with(ToolSyntax::Hermes), cut);
    assert_eq!(got, cut_reply("", &[("f", json!({"q": "ab\"c"}))], cut));
    let broken = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1, \"b\"</tool_call>After.";
    assert_eq!(parse_every_way(&with(ToolSyntax::Hermes), broken), reply("After.", "", &[("f", json!({"a": 1}))]));
    // Arguments that are not an object: the call gets `{}` and the rest of its block goes.
    let list = "<tool_call>{\"name\": \"f\", \"arguments\": [{}]}\n</tool_call>\nDone.";
    assert_eq!(parse_every_way(&with(ToolSyntax::Hermes), list), reply("Done.", "", &[("f", json!({}))]));
    let unclosed = "<tool_call>{\"name\": \"f\", \"arguments\": 7, junk";
    assert_eq!(parse_every_way(&with(ToolSyntax::Hermes), unclosed), reply("", "", &[("f", json!({}))]));
    // String-encoded arguments are decoded.
    let encoded = "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>";
    assert_eq!(parse_every_way(&with(ToolSyntax::Hermes), encoded), reply("", "", &[("f", json!({"a": 1}))]));
}

#[test]
fn calls_cut_short_are_text_in_whole_replies() {
    // The hostile probe's case: the stream closes the call, a whole reply shows its text.
    let cut = "Let me look.\n<tool_call>\n{\"name\": \"f\", \"argu";
    assert_eq!(
        parse_every_way(&with(ToolSyntax::Hermes), cut),
        cut_reply("Let me look.", &[("f", json!({}))], &cut[13..])
    );
    assert_eq!(whole(ToolSyntax::Hermes, cut), (reply(&format!("Let me look.{}", &cut[13..]), "", &[]), true));
    // Calls before the cut one stay calls; a cut string argument is text, not `{}`.
    let done = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>";
    let text = format!("{done}\n<tool_call>{{\"name\": \"b\", \"arguments\": \"{{\\\"x");
    let (got, was_cut) = whole(ToolSyntax::Hermes, &text);
    assert!(was_cut);
    assert_eq!(got, reply(&text[done.len() + 1..], "", &[("a", json!({}))]));
    let mistral = "[TOOL_CALLS]f[ARGS]{\"a\": [1, 2";
    assert_eq!(whole(ToolSyntax::MistralArgs, mistral), (reply(mistral, "", &[]), true));
    // A complete reply is not cut.
    assert_eq!(whole(ToolSyntax::Hermes, done), (reply("", "", &[("a", json!({}))]), false));
}

#[test]
fn hermes_bare_call_objects() {
    // Qwen2.5-Coder leaves the tags out.
    let bare = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}";
    let got = parse_every_way(&with(ToolSyntax::Hermes), bare);
    assert_eq!(got, reply("", "", &[("get_weather", json!({"city": "Paris"}))]));
    // Bare calls may follow one another; one cut after its name is closed, before it is content.
    let more = format!("{bare}\n{bare}\n{{\"name\": \"get_weather\", \"");
    let got = parse_every_way(&with(ToolSyntax::Hermes), &more);
    let call = ("get_weather", json!({"city": "Paris"}));
    let third = "{\"name\": \"get_weather\", \"";
    assert_eq!(got, cut_reply("", &[call.clone(), call.clone(), ("get_weather", json!({}))], third));
    let cut = format!("{bare}\n{{\"name\": \"get_w");
    assert_eq!(
        parse_every_way(&with(ToolSyntax::Hermes), &cut),
        reply("{\"name\": \"get_w", "", std::slice::from_ref(&call))
    );
    // Qwen2.5-Coder's fenced form: one block or several, text after them is content.
    let fenced = format!("```json\n{bare}\n```");
    assert_eq!(parse_every_way(&with(ToolSyntax::Hermes), &fenced), reply("", "", std::slice::from_ref(&call)));
    let two = format!("```\n{bare}\n```\n\n```json\n  {bare}\n```\nDone.");
    assert_eq!(parse_every_way(&with(ToolSyntax::Hermes), &two), reply("Done.", "", &[call.clone(), call.clone()]));
    for text in [
        "{\"name\": \"Bob\", \"arguments\": {}}",
        "{\"answer\": 42}",
        "```json\n{\"answer\": 42}\n```",
        "```python\nprint({})\n```",
        "```json\n[1, 2]\n```",
        "``",
        "Run:\n```json\n{\"name\": \"get_weather\", \"arguments\": {}}\n```",
    ] {
        assert_eq!(parse_every_way(&with(ToolSyntax::Hermes), text), reply(text, "", &[]), "{text}");
    }
}

#[test]
fn plain_text_passes_through_exactly() {
    let text = "Hello <b>world</b> {\"name\": \"x\"}  \n\n";
    assert_eq!(parse_every_way(&with(ToolSyntax::Hermes), text), reply(text, "", &[]));
    assert_eq!(parse_every_way(&|| parser(None, Some(THINK), false), text), reply(text, "", &[]));
}

#[test]
fn llama_json_calls() {
    let one = " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
    let got = parse_every_way(&with(ToolSyntax::Llama3Json), one);
    assert_eq!(got, reply("", "", &[("get_weather", json!({"city": "Paris"}))]));
    let two = "{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {}}";
    let got = parse_every_way(&with(ToolSyntax::Llama3Json), two);
    assert_eq!(got, reply("", "", &[("a", json!({"x": 1})), ("b", json!({}))]));
    let tagged = "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"y\": true}}";
    assert_eq!(parse_every_way(&with(ToolSyntax::Llama3Json), tagged), reply("", "", &[("f", json!({"y": true}))]));
    // JSON that names no offered tool, or comes after text, is content.
    for text in ["{\"name\": \"Bob\", \"age\": 3}", "Sure: {\"name\": \"f\", \"parameters\": {}}", "{oops"] {
        assert_eq!(parse_every_way(&with(ToolSyntax::Llama3Json), text), reply(text, "", &[]), "{text}");
    }
}

#[test]
fn mistral_list_calls() {
    let text = "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {}}]";
    let got = parse_every_way(&with(ToolSyntax::MistralList), text);
    assert_eq!(got, reply("", "", &[("a", json!({"x": 1})), ("b", json!({}))]));
    let lone = "[TOOL_CALLS]{\"name\": \"a\", \"arguments\": {\"x\": 2}}";
    assert_eq!(parse_every_way(&with(ToolSyntax::MistralList), lone), reply("", "", &[("a", json!({"x": 2}))]));
    let bad = "[TOOL_CALLS] oops";
    assert_eq!(parse_every_way(&with(ToolSyntax::MistralList), bad), reply(bad, "", &[]));
}

#[test]
fn mistral_args_calls() {
    let text = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]f[CALL_ID]abc123XYZ[ARGS]{}";
    let got = parse_every_way(&with(ToolSyntax::MistralArgs), text);
    assert_eq!(got, reply("", "", &[("get_weather", json!({"city": "Paris"})), ("f", json!({}))]));
    let bad = "[TOOL_CALLS]not a name[ARGS]{}";
    assert_eq!(parse_every_way(&with(ToolSyntax::MistralArgs), bad), reply(bad, "", &[]));
    let cut = "[TOOL_CALLS]f[ARGS]{\"a\": [1, 2";
    let got = parse_every_way(&with(ToolSyntax::MistralArgs), cut);
    assert_eq!(got, cut_reply("", &[("f", json!({"a": [1, 2]}))], cut));
}

#[test]
fn gemma_calls() {
    let text = "Checking.<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:2}<tool_call|>";
    let got = parse_every_way(&with(ToolSyntax::Gemma4), text);
    assert_eq!(got, reply("Checking.", "", &[("get_weather", json!({"city": "Paris", "days": 2}))]));
    let bad = "<|tool_call>get_weather(city=Paris)<tool_call|>";
    assert_eq!(parse_every_way(&with(ToolSyntax::Gemma4), bad), reply(bad, "", &[]));
}

#[test]
fn reasoning_is_split_out() {
    let think = || parser(None, Some(THINK), false);
    let got = parse_every_way(&think, "<think>\nThe user greets.\n</think>\n\nHello!");
    assert_eq!(got, reply("Hello!", "The user greets.", &[]));
    // The prompt opened the block; a block never closed is reasoning to the end.
    let opened = || parser(None, Some(THINK), true);
    assert_eq!(parse_every_way(&opened, "\nHmm.\n</think>\nHi"), reply("Hi", "Hmm.", &[]));
    assert_eq!(parse_every_way(&think, "<think>still going"), reply("", "still going", &[]));
    // An empty block (thinking turned off) leaves no reasoning.
    assert_eq!(parse_every_way(&think, "<think>\n\n</think>\n\nOK"), reply("OK", "", &[]));
    let mistral = ReasoningTags { open: "[THINK]", close: "[/THINK]" };
    assert_eq!(parse_every_way(&|| parser(None, Some(mistral), false), "[THINK]x[/THINK]y"), reply("y", "x", &[]));
}

#[test]
fn reasoning_then_a_tool_call() {
    let make = || parser(Some(ToolSyntax::Hermes), Some(THINK), false);
    let text = "<think>Need weather.</think>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
    let got = parse_every_way(&make, text);
    assert_eq!(got, reply("", "Need weather.", &[("get_weather", json!({"city": "Oslo"}))]));
}

#[test]
fn forced_openings_announce_the_call_first() {
    for syntax in [
        ToolSyntax::Hermes,
        ToolSyntax::Llama3Json,
        ToolSyntax::MistralList,
        ToolSyntax::MistralArgs,
        ToolSyntax::Gemma4,
    ] {
        let format = OutputFormat { tools: ToolSupport::Template(syntax), reasoning: None };
        let opening = format.tool_call_opening(Some("get_weather")).expect("opening");
        let rest = match syntax {
            ToolSyntax::Gemma4 => "city:<|\"|>Rome<|\"|>}<tool_call|>",
            ToolSyntax::MistralArgs => "{\"city\": \"Rome\"}",
            ToolSyntax::MistralList => "{\"city\": \"Rome\"}}]",
            ToolSyntax::Hermes => "{\"city\": \"Rome\"}}\n</tool_call>",
            ToolSyntax::Llama3Json => "{\"city\": \"Rome\"}}",
        };
        let mut p = Primed::new(make_parser(Some(syntax), None, false, true), &opening);
        let first = p.push("");
        if syntax != ToolSyntax::Gemma4 {
            assert!(
                matches!(&first[..], [Delta::ToolCall(c)] if c.name.as_deref() == Some("get_weather")),
                "{syntax:?}: {first:?}"
            );
        }
        let mut deltas = first;
        deltas.extend(p.push(rest));
        let end = p.finish();
        assert_eq!(
            merge_finished(deltas, end),
            reply("", "", &[("get_weather", json!({"city": "Rome"}))]),
            "{syntax:?}"
        );
        // Any function: the model writes the name.
        let opening = format.tool_call_opening(None).expect("opening");
        let rest = match syntax {
            ToolSyntax::Gemma4 => "f{}<tool_call|>",
            ToolSyntax::MistralArgs => "f[ARGS]{}",
            ToolSyntax::MistralList => "f\", \"arguments\": {}}]",
            _ => "f\", \"arguments\": {}}",
        };
        let forced = || Box::new(Primed::new(make_parser(Some(syntax), None, false, true), &opening));
        assert_eq!(feed(forced(), &[rest]), reply("", "", &[("f", json!({}))]), "{syntax:?}");
        // A forced call counts even when it names no offered tool.
        let got = feed(forced(), &[&rest.replacen('f', "nope", 1)]);
        assert_eq!(got.calls.first().map(|c| c.0.as_str()), Some("nope"), "{syntax:?}");
    }
}
