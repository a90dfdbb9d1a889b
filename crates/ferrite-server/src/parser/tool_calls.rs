//! `ToolCallParser`: tool calls out of generated text, in one family's syntax, as they are
//! generated. Text outside calls is content (whitespace next to a call is dropped); a call
//! is announced (id and name) as soon as its name is complete and its arguments stream up
//! to JSON safe points (`json`), so what a client receives is always valid JSON once the
//! call ends — a call cut short or broken after its name is closed at its last safe point
//! (and the rest of a broken Hermes block is dropped). A call the generation's end cut
//! short is also reported (`Finished::cut`, with the model's text of it), so that the reply
//! says it was truncated.
//!
//! A reply that is a bare call object (Llama's form; Qwen2.5-Coder does it in Hermes
//! templates too, bare or in a Markdown JSON code fence) is a call when it names an offered
//! tool. Text that starts like a call but
//! is not one (bad JSON before the name, a bare object naming no offered tool) falls back
//! to content.

use super::family::ToolSyntax;
use super::gemma;
use super::json::{ArgsStream, CallEvent, CallReader, Step};
use super::scan::{find, Found};
use super::{Delta, Finished, OutputParser, ToolCallDelta};
use crate::state::random_id;

/// The text of one call in the making.
enum Body {
    /// One `{"name", "arguments"}` object (Hermes, Llama).
    Object(Box<CallReader>),
    /// Mistral's `[{…}, {…}]` (or a lone `{…}`): `opened` once its `[` was read.
    List { reader: Option<Box<CallReader>>, opened: bool },
    /// Mistral's `NAME[CALL_ID]ID[ARGS]{…}`: the name until `[ARGS]`, then the arguments.
    Named { name: String, in_call_id: bool, args: Option<Box<ArgsStream>> },
    /// Gemma 4: everything up to the end tag.
    Gemma(String),
}

enum State {
    /// Before the reply's first non-blank character (a `{` there opens a bare call).
    Start,
    Text,
    Call(Body),
    /// The rest of a Hermes call block whose JSON broke after the name: dropped up to the
    /// end tag.
    Discard,
    /// After a call: its end tag (Hermes), separators, blanks.
    After {
        end_tag_seen: bool,
    },
}

/// What one character did inside a call.
enum Outcome {
    More,
    /// A call ended; `body` when nothing more of this block follows.
    CallDone {
        body: bool,
    },
    /// As `CallDone { body: true }`, but the character is not part of the call.
    CallDoneBefore,
    /// A list closed.
    ListDone,
    Bad,
}

/// Whether the character that ended a call's handling belongs to it.
enum Fed {
    More,
    Ended,
    EndedBefore,
}

const HERMES_END: &str = "</tool_call>";
const GEMMA_END: &str = "<tool_call|>";
const ARGS_TAG: &str = "[ARGS]";
const CALL_ID_TAG: &str = "[CALL_ID]";

pub struct ToolCallParser {
    syntax: ToolSyntax,
    /// Names of the offered tools, which a bare call must name (`None`: any name counts).
    tool_names: Option<Vec<String>>,
    buf: String,
    state: State,
    /// Calls announced so far (the next call's index).
    calls: usize,
    /// The call in progress has been announced.
    committed: bool,
    /// The call in progress came without a tag (it must name an offered tool).
    bare: bool,
    /// The call in progress opened with a Markdown code fence, whose closing fence follows it.
    fenced: bool,
    /// Text read since the call's start (or the last announced call): content again if it
    /// turns out not to be a call.
    raw: String,
    /// The text of the announced call in progress up to its announcement (its tag
    /// included); with `raw`, the model's whole text of the call.
    call_text: String,
    /// Trailing blanks of the content, held back: dropped before a call, sent before text.
    held_ws: String,
    out: Vec<Delta>,
}

impl ToolCallParser {
    pub fn new(syntax: ToolSyntax, tool_names: Option<Vec<String>>) -> ToolCallParser {
        let bare_calls = matches!(syntax, ToolSyntax::Llama3Json | ToolSyntax::Hermes);
        let state = if bare_calls { State::Start } else { State::Text };
        ToolCallParser {
            syntax,
            tool_names,
            buf: String::new(),
            state,
            calls: 0,
            committed: false,
            bare: false,
            fenced: false,
            raw: String::new(),
            call_text: String::new(),
            held_ws: String::new(),
            out: Vec::new(),
        }
    }

    fn start_tag(&self) -> &'static str {
        match self.syntax {
            ToolSyntax::Hermes => "<tool_call>",
            ToolSyntax::Llama3Json => "<|python_tag|>",
            ToolSyntax::MistralList | ToolSyntax::MistralArgs => "[TOOL_CALLS]",
            ToolSyntax::Gemma4 => "<|tool_call>",
        }
    }

    fn new_body(&self) -> Body {
        match self.syntax {
            ToolSyntax::Hermes | ToolSyntax::Llama3Json => Body::Object(Box::default()),
            ToolSyntax::MistralList => Body::List { reader: None, opened: false },
            ToolSyntax::MistralArgs => Body::Named { name: String::new(), in_call_id: false, args: None },
            ToolSyntax::Gemma4 => Body::Gemma(String::new()),
        }
    }

    fn content(&mut self, text: &str) {
        let s = std::mem::take(&mut self.held_ws) + text;
        let keep = s.trim_end().len();
        if keep > 0 {
            self.out.push(Delta::Content(s[..keep].to_string()));
        }
        self.held_ws = s[keep..].to_string();
    }

    fn announce(&mut self, name: String) {
        let index = self.calls;
        self.calls += 1;
        self.committed = true;
        self.call_text = std::mem::take(&mut self.raw);
        let id = Some(random_id("call_"));
        self.out.push(Delta::ToolCall(ToolCallDelta { index, id, name: Some(name), arguments: String::new() }));
    }

    fn arguments(&mut self, text: String) {
        if text.is_empty() || !self.committed {
            return;
        }
        let index = self.calls - 1;
        match self.out.last_mut() {
            Some(Delta::ToolCall(last)) if last.index == index => last.arguments.push_str(&text),
            _ => self.out.push(Delta::ToolCall(ToolCallDelta { index, id: None, name: None, arguments: text })),
        }
    }

    /// Handle what a call object reported; `false` when it is not a call after all.
    fn events(&mut self, events: Vec<CallEvent>) -> bool {
        for e in events {
            match e {
                CallEvent::Name(name) => {
                    let offered = self.tool_names.as_ref().is_none_or(|names| names.contains(&name));
                    if (self.bare || self.syntax == ToolSyntax::Llama3Json) && !offered {
                        return false;
                    }
                    self.announce(name);
                }
                CallEvent::Args(text) => self.arguments(text),
            }
        }
        true
    }

    /// The text since the call's start was not a call: it is content.
    fn not_a_call(&mut self) {
        let raw = std::mem::take(&mut self.raw);
        self.content(&raw);
        self.committed = false;
        self.state = State::Text;
    }

    /// End the announced call in progress, closing its arguments.
    fn close_call(&mut self) {
        let rest = match &mut self.state {
            State::Call(Body::Object(r)) | State::Call(Body::List { reader: Some(r), .. }) => r.close(),
            State::Call(Body::Named { args: Some(a), .. }) => a.close(),
            _ => String::new(),
        };
        self.arguments(rest);
        self.committed = false;
        self.raw.clear();
        self.state = State::After { end_tag_seen: false };
    }

    /// The announced call in progress broke: close it, and drop the rest of its block.
    fn broken_call(&mut self) {
        self.close_call();
        if self.syntax == ToolSyntax::Hermes {
            self.state = State::Discard;
        }
    }

    fn run(&mut self) {
        while match self.state {
            State::Start => self.start(),
            State::Text => self.text(),
            State::Call(Body::Gemma(_)) => self.gemma(),
            State::Call(Body::Named { args: None, .. }) => self.mistral_name(),
            State::Call(_) => self.call(),
            State::Discard => self.discard(),
            State::After { .. } => self.after(),
        } {}
    }

    fn start(&mut self) -> bool {
        let blank = self.buf.len() - self.buf.trim_start().len();
        if blank == self.buf.len() {
            return false;
        }
        match bare_opening(&self.buf[blank..]) {
            Opening::Call { fence } => {
                self.raw = self.buf.drain(..blank + fence).collect();
                self.bare = true;
                self.fenced = fence > 0;
                self.state = State::Call(Body::Object(Box::default()));
            }
            Opening::Undecided => return false,
            Opening::No => self.state = State::Text,
        }
        true
    }

    fn text(&mut self) -> bool {
        let tag = self.start_tag();
        match find(&self.buf, &[tag]) {
            Found::Tag { at, .. } => {
                let before: String = self.buf.drain(..at).collect();
                self.content(&before);
                self.held_ws.clear();
                self.raw = self.buf.drain(..tag.len()).collect();
                self.bare = false;
                self.state = State::Call(self.new_body());
                true
            }
            Found::Partial { at } => {
                let before: String = self.buf.drain(..at).collect();
                self.content(&before);
                false
            }
            Found::Nothing => {
                let all = std::mem::take(&mut self.buf);
                self.content(&all);
                false
            }
        }
    }

    fn gemma(&mut self) -> bool {
        let State::Call(Body::Gemma(body)) = &mut self.state else { return false };
        match find(&self.buf, &[GEMMA_END]) {
            Found::Tag { at, .. } => {
                body.extend(self.buf.drain(..at));
                self.buf.drain(..GEMMA_END.len());
                let body = std::mem::take(body);
                match gemma::parse_call(&body) {
                    Some((name, args)) => {
                        self.announce(name);
                        self.arguments(args);
                        self.committed = false;
                        self.state = State::After { end_tag_seen: true };
                    }
                    None => {
                        self.raw = format!("{}{body}{GEMMA_END}", self.raw);
                        self.not_a_call();
                    }
                }
                true
            }
            Found::Partial { at } => {
                body.extend(self.buf.drain(..at));
                false
            }
            Found::Nothing => {
                body.push_str(&std::mem::take(&mut self.buf));
                false
            }
        }
    }

    fn mistral_name(&mut self) -> bool {
        let State::Call(Body::Named { name, in_call_id, args }) = &mut self.state else { return false };
        let found = find(&self.buf, &[ARGS_TAG, CALL_ID_TAG]);
        let upto = match found {
            Found::Tag { at, .. } | Found::Partial { at } => at,
            Found::Nothing => self.buf.len(),
        };
        let piece: String = self.buf.drain(..upto).collect();
        self.raw.push_str(&piece);
        if !*in_call_id {
            name.push_str(&piece);
        }
        if name.contains(char::is_whitespace) || name.len() > 256 {
            self.not_a_call();
            return true;
        }
        match found {
            Found::Tag { tag: 0, .. } if !name.is_empty() => {
                let name = std::mem::take(name);
                *args = Some(Box::default());
                self.raw.extend(self.buf.drain(..ARGS_TAG.len()));
                self.announce(name);
                true
            }
            Found::Tag { tag: 1, .. } if !*in_call_id && !name.is_empty() => {
                *in_call_id = true;
                self.raw.extend(self.buf.drain(..CALL_ID_TAG.len()));
                true
            }
            Found::Tag { .. } => {
                self.not_a_call();
                true
            }
            _ => false,
        }
    }

    fn call(&mut self) -> bool {
        let buf = std::mem::take(&mut self.buf);
        let mut used = 0;
        let mut progressed = false;
        for c in buf.chars() {
            match self.feed_body(c) {
                Fed::More => used += c.len_utf8(),
                Fed::Ended => {
                    used += c.len_utf8();
                    progressed = true;
                    break;
                }
                Fed::EndedBefore => {
                    progressed = true;
                    break;
                }
            }
        }
        self.buf = buf[used..].to_string();
        progressed
    }

    fn feed_body(&mut self, c: char) -> Fed {
        let mut events = Vec::new();
        let outcome = match &mut self.state {
            State::Call(Body::Object(reader)) => match reader.feed(c, &mut events) {
                Ok(true) => Outcome::CallDone { body: true },
                Ok(false) => Outcome::More,
                Err(_) => Outcome::Bad,
            },
            State::Call(Body::List { reader: Some(reader), opened }) => match reader.feed(c, &mut events) {
                Ok(true) => Outcome::CallDone { body: !*opened },
                Ok(false) => Outcome::More,
                Err(_) => Outcome::Bad,
            },
            State::Call(Body::List { reader, opened }) => match c {
                c if c.is_whitespace() || (c == ',' && *opened) => Outcome::More,
                '[' if !*opened => {
                    *opened = true;
                    Outcome::More
                }
                ']' if *opened => Outcome::ListDone,
                '{' => {
                    let mut r = Box::<CallReader>::default();
                    let _ = r.feed(c, &mut events);
                    *reader = Some(r);
                    Outcome::More
                }
                _ => Outcome::Bad,
            },
            State::Call(Body::Named { args: Some(args), .. }) => {
                let step = args.feed(c);
                events.push(CallEvent::Args(args.take_ready()));
                match step {
                    Step::More => Outcome::More,
                    Step::Done => Outcome::CallDone { body: true },
                    Step::EndedBefore => Outcome::CallDoneBefore,
                    Step::Invalid => Outcome::Bad,
                }
            }
            _ => return Fed::EndedBefore,
        };
        if matches!(outcome, Outcome::Bad) {
            if self.committed {
                self.broken_call();
            } else {
                self.not_a_call();
            }
            return Fed::EndedBefore;
        }
        if !matches!(outcome, Outcome::CallDoneBefore) {
            self.raw.push(c);
        }
        if !self.events(events) {
            self.not_a_call();
            return Fed::Ended;
        }
        match outcome {
            Outcome::More => Fed::More,
            Outcome::CallDone { body: false } => {
                if let State::Call(Body::List { reader, .. }) = &mut self.state {
                    *reader = None;
                }
                self.committed = false;
                self.raw.clear();
                Fed::More
            }
            Outcome::ListDone | Outcome::CallDone { body: true } | Outcome::CallDoneBefore => {
                self.committed = false;
                self.raw.clear();
                self.state = State::After { end_tag_seen: false };
                if matches!(outcome, Outcome::CallDoneBefore) {
                    Fed::EndedBefore
                } else {
                    Fed::Ended
                }
            }
            Outcome::Bad => Fed::EndedBefore,
        }
    }

    fn discard(&mut self) -> bool {
        match find(&self.buf, &[HERMES_END]) {
            Found::Tag { at, .. } => {
                self.buf.drain(..at + HERMES_END.len());
                self.state = State::After { end_tag_seen: true };
                true
            }
            Found::Partial { at } => {
                self.buf.drain(..at);
                false
            }
            Found::Nothing => {
                self.buf.clear();
                false
            }
        }
    }

    fn after(&mut self) -> bool {
        let llama = self.syntax == ToolSyntax::Llama3Json;
        let rest = self.buf.trim_start_matches(|c: char| c.is_whitespace() || (llama && c == ';'));
        let skipped = self.buf.len() - rest.len();
        self.buf.drain(..skipped);
        if self.buf.is_empty() {
            return false;
        }
        let State::After { end_tag_seen } = &mut self.state else { return false };
        if self.syntax == ToolSyntax::Hermes && !*end_tag_seen {
            if self.buf.starts_with(HERMES_END) {
                self.buf.drain(..HERMES_END.len());
                *end_tag_seen = true;
                return true;
            }
            if HERMES_END.starts_with(self.buf.as_str()) {
                return false;
            }
        }
        if self.fenced {
            if self.buf.starts_with(FENCE) {
                self.buf.drain(..FENCE.len());
                self.fenced = false;
                return true;
            }
            if FENCE.starts_with(self.buf.as_str()) {
                return false;
            }
        }
        if llama || self.bare {
            match bare_opening(&self.buf) {
                Opening::Call { fence } => {
                    self.raw = self.buf.drain(..fence).collect();
                    self.fenced = fence > 0;
                    self.state = State::Call(self.new_body());
                    return true;
                }
                Opening::Undecided => return false,
                Opening::No => {}
            }
        }
        self.state = State::Text;
        true
    }
}

const FENCE: &str = "```";

/// How a bare call may open at the start of some text.
enum Opening {
    /// It does, at `{` after `fence` bytes of a Markdown code fence (0: no fence).
    Call {
        fence: usize,
    },
    /// More text decides.
    Undecided,
    No,
}

/// A bare call opens with `{`, or with a code fence (```` ``` ```` or ```` ```json ````, its line
/// ended) and then `{`: Qwen2.5-Coder fences its calls as a Markdown JSON block.
fn bare_opening(s: &str) -> Opening {
    if s.starts_with('{') {
        return Opening::Call { fence: 0 };
    }
    let Some(rest) = s.strip_prefix(FENCE) else {
        return if FENCE.starts_with(s) { Opening::Undecided } else { Opening::No };
    };
    let Some(eol) = rest.find('\n') else {
        return if "json".starts_with(rest.trim_end()) { Opening::Undecided } else { Opening::No };
    };
    if !matches!(rest[..eol].trim(), "" | "json") {
        return Opening::No;
    }
    let body = &rest[eol + 1..];
    let blank = body.len() - body.trim_start().len();
    match body[blank..].chars().next() {
        None => Opening::Undecided,
        Some('{') => Opening::Call { fence: FENCE.len() + eol + 1 + blank },
        Some(_) => Opening::No,
    }
}

impl OutputParser for ToolCallParser {
    fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        self.run();
        std::mem::take(&mut self.out)
    }

    fn finish(&mut self) -> Finished {
        self.run();
        let rest = std::mem::take(&mut self.buf);
        let mut cut = None;
        match std::mem::replace(&mut self.state, State::Text) {
            State::Start | State::Text => self.content(&rest),
            State::Call(Body::Gemma(body)) => match gemma::parse_call(&format!("{body}{rest}")) {
                Some((name, args)) => {
                    self.announce(name);
                    self.arguments(args);
                }
                None => self.content(&format!("{}{body}{rest}", self.raw)),
            },
            State::Call(body) if self.committed => {
                let text = format!("{}{}{rest}", self.call_text, self.raw);
                self.state = State::Call(body);
                self.close_call();
                cut = Some(text);
            }
            State::Call(_) => self.content(&format!("{}{rest}", self.raw)),
            State::Discard => {}
            State::After { .. } => {
                if !HERMES_END.starts_with(rest.trim()) {
                    self.content(&rest);
                }
            }
        }
        if self.calls == 0 {
            let held = std::mem::take(&mut self.held_ws);
            if !held.is_empty() {
                self.out.push(Delta::Content(held));
            }
        }
        self.held_ws.clear();
        Finished { deltas: std::mem::take(&mut self.out), cut }
    }
}
