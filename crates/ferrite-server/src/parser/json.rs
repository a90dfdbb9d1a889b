//! Incremental JSON for tool calls whose text arrives in pieces.
//!
//! `JsonScan` checks one JSON value character by character and knows, after each one,
//! whether the text so far can be closed into valid JSON by appending `closers()` — a *safe
//! point*. `ArgsStream` uses that to stream a call's `arguments` as they are generated while
//! guaranteeing the streamed text ends up valid JSON: it emits only up to safe points, and a
//! value cut short (a syntax error, the end of generation) is closed with the closers of the
//! last safe point. Arguments must be an object (or a string that holds one). `CallReader` reads a `{"name": …, "arguments": …}` object (`parameters`
//! is accepted for `arguments`), reporting the name as soon as it is complete.

/// What one character did to a `JsonScan`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The value goes on.
    More,
    /// This character completed the value.
    Done,
    /// The value had already ended (a number ends at the character after it): this
    /// character is not part of it.
    EndedBefore,
    /// The text is not JSON.
    Invalid,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frame {
    Object,
    Array,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Esc {
    No,
    Backslash,
    Unicode(u8),
}

/// Where a number is: after `-`, a leading `0`, digits, `.`, fraction digits, `e`, its
/// sign, exponent digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pos {
    Value,
    Key,
    Colon,
    Str { key: bool, esc: Esc },
    Number(Num),
    Literal { word: &'static str, matched: usize },
    After,
    End,
}

/// A checker for one JSON value.
#[derive(Debug, Clone)]
pub struct JsonScan {
    stack: Vec<Frame>,
    pos: Pos,
    /// Right after `{` or `[` (where `}` / `]` may close an empty container).
    opened: bool,
    /// The last character ended a number inside a container (the text before it was a
    /// safe point).
    number_ended: bool,
}

impl Default for JsonScan {
    fn default() -> Self {
        JsonScan { stack: Vec::new(), pos: Pos::Value, opened: false, number_ended: false }
    }
}

impl JsonScan {
    pub fn feed(&mut self, c: char) -> Step {
        self.number_ended = false;
        let ws = c.is_ascii_whitespace();
        match self.pos {
            Pos::End => Step::EndedBefore,
            Pos::Value | Pos::Key | Pos::Colon | Pos::After if ws => Step::More,
            Pos::Value => self.value_start(c),
            Pos::Key => match c {
                '"' => self.go(Pos::Str { key: true, esc: Esc::No }),
                '}' if self.opened => self.close(Frame::Object),
                _ => Step::Invalid,
            },
            Pos::Colon if c == ':' => self.go(Pos::Value),
            Pos::Colon => Step::Invalid,
            Pos::Str { key, esc } => self.string(key, esc, c),
            Pos::Number(n) => self.number(n, c),
            Pos::Literal { word, matched } => {
                if word[matched..].starts_with(c) {
                    if matched + 1 == word.len() {
                        self.value_done()
                    } else {
                        self.go(Pos::Literal { word, matched: matched + 1 })
                    }
                } else {
                    Step::Invalid
                }
            }
            Pos::After => match (c, self.stack.last()) {
                (',', Some(Frame::Object)) => self.go(Pos::Key),
                (',', Some(Frame::Array)) => self.go(Pos::Value),
                ('}', Some(Frame::Object)) => self.close(Frame::Object),
                (']', Some(Frame::Array)) => self.close(Frame::Array),
                _ => Step::Invalid,
            },
        }
    }

    /// Whether the text fed so far plus `closers()` is valid JSON.
    pub fn at_safe_point(&self) -> bool {
        match self.pos {
            Pos::End | Pos::After => true,
            Pos::Key | Pos::Value => self.opened,
            Pos::Str { key: false, esc: Esc::No } => true,
            _ => false,
        }
    }

    /// Whether the text before the last character was a safe point the character moved
    /// past (a number ended by a `,`).
    pub fn number_just_ended(&self) -> bool {
        self.number_ended
    }

    /// Whether the text fed so far ends with a number that is complete if nothing follows.
    pub fn ends_in_number(&self) -> bool {
        matches!(self.pos, Pos::Number(Num::Zero | Num::Int | Num::Frac | Num::Exp))
    }

    /// What closes the value at a safe point: an open string's quote, then each open
    /// container's bracket.
    pub fn closers(&self) -> String {
        let mut out = String::new();
        if matches!(self.pos, Pos::Str { .. }) {
            out.push('"');
        }
        out.extend(self.stack.iter().rev().map(|f| if *f == Frame::Object { '}' } else { ']' }));
        out
    }

    fn go(&mut self, pos: Pos) -> Step {
        self.pos = pos;
        self.opened = false;
        Step::More
    }

    fn value_start(&mut self, c: char) -> Step {
        let literal = |word| Pos::Literal { word, matched: 1 };
        match c {
            '{' | '[' => {
                let (frame, pos) = if c == '{' { (Frame::Object, Pos::Key) } else { (Frame::Array, Pos::Value) };
                self.stack.push(frame);
                self.pos = pos;
                self.opened = true;
                Step::More
            }
            ']' if self.opened => self.close(Frame::Array),
            '"' => self.go(Pos::Str { key: false, esc: Esc::No }),
            '-' => self.go(Pos::Number(Num::Minus)),
            '0' => self.go(Pos::Number(Num::Zero)),
            '1'..='9' => self.go(Pos::Number(Num::Int)),
            't' => self.go(literal("true")),
            'f' => self.go(literal("false")),
            'n' => self.go(literal("null")),
            _ => Step::Invalid,
        }
    }

    fn string(&mut self, key: bool, esc: Esc, c: char) -> Step {
        let next = match (esc, c) {
            (Esc::No, '"') if key => return self.go(Pos::Colon),
            (Esc::No, '"') => return self.value_done(),
            (Esc::No, '\\') => Esc::Backslash,
            (Esc::No, c) if (c as u32) < 0x20 => return Step::Invalid,
            (Esc::No, _) => Esc::No,
            (Esc::Backslash, '"' | '\\' | '/' | 'b' | 'f' | 'n' | 'r' | 't') => Esc::No,
            (Esc::Backslash, 'u') => Esc::Unicode(0),
            (Esc::Unicode(3), c) if c.is_ascii_hexdigit() => Esc::No,
            (Esc::Unicode(n), c) if c.is_ascii_hexdigit() => Esc::Unicode(n + 1),
            _ => return Step::Invalid,
        };
        self.go(Pos::Str { key, esc: next })
    }

    fn number(&mut self, n: Num, c: char) -> Step {
        let next = match (n, c) {
            (Num::Minus, '0') => Num::Zero,
            (Num::Minus, '1'..='9') => Num::Int,
            (Num::Int, '0'..='9') => Num::Int,
            (Num::Zero | Num::Int, '.') => Num::Dot,
            (Num::Dot | Num::Frac, '0'..='9') => Num::Frac,
            (Num::Zero | Num::Int | Num::Frac, 'e' | 'E') => Num::E,
            (Num::E, '+' | '-') => Num::ESign,
            (Num::E | Num::ESign | Num::Exp, '0'..='9') => Num::Exp,
            (Num::Zero | Num::Int | Num::Frac | Num::Exp, _) => {
                // The number ended before `c`: finish it, then read `c` after it.
                return match self.value_done() {
                    Step::Done => Step::EndedBefore,
                    _ => {
                        let step = self.feed(c);
                        self.number_ended = true;
                        step
                    }
                };
            }
            _ => return Step::Invalid,
        };
        self.go(Pos::Number(next))
    }

    fn close(&mut self, frame: Frame) -> Step {
        if self.stack.last() != Some(&frame) {
            return Step::Invalid;
        }
        self.stack.pop();
        self.value_done()
    }

    fn value_done(&mut self) -> Step {
        self.opened = false;
        if self.stack.is_empty() {
            self.pos = Pos::End;
            Step::Done
        } else {
            self.pos = Pos::After;
            Step::More
        }
    }
}

/// A call's `arguments` value, streamed up to safe points.
#[derive(Debug, Default)]
pub struct ArgsStream {
    scan: JsonScan,
    raw: String,
    /// Bytes of `raw` up to the last safe point, and what would close it there.
    safe: usize,
    closers: String,
    emitted: usize,
    complete: bool,
    /// A string value was decoded and handed out.
    string_taken: bool,
}

impl ArgsStream {
    /// Feed one character of the value (whitespace before it is skipped). Arguments are
    /// an object (or a string holding one): any other value is invalid.
    pub fn feed(&mut self, c: char) -> Step {
        if self.raw.is_empty() && c.is_ascii_whitespace() {
            return Step::More;
        }
        if self.raw.is_empty() && c != '{' && c != '"' {
            return Step::Invalid;
        }
        let before = self.raw.len();
        let step = self.scan.feed(c);
        if matches!(step, Step::More | Step::Done) {
            self.raw.push(c);
        }
        if self.scan.number_just_ended() {
            self.safe = before;
            self.closers = self.scan.closers();
        }
        if step == Step::Done || step == Step::EndedBefore {
            self.complete = true;
            self.safe = self.raw.len();
            self.closers.clear();
        } else if step == Step::More && self.scan.at_safe_point() {
            self.safe = self.raw.len();
            self.closers = self.scan.closers();
        }
        step
    }

    /// The value is a JSON string (some models send arguments as encoded JSON): it is
    /// decoded when complete instead of streamed.
    fn is_string(&self) -> bool {
        self.raw.starts_with('"')
    }

    pub fn started(&self) -> bool {
        !self.raw.is_empty()
    }

    /// Newly streamable text (nothing for a string value until it completes).
    pub fn take_ready(&mut self) -> String {
        if self.is_string() {
            if !self.complete || self.string_taken {
                return String::new();
            }
            self.string_taken = true;
            return match serde_json::from_str::<String>(&self.raw) {
                Ok(inner) if serde_json::from_str::<serde_json::Value>(&inner).is_ok_and(|v| v.is_object()) => inner,
                _ => "{}".to_string(),
            };
        }
        let out = self.raw[self.emitted..self.safe].to_string();
        self.emitted = self.safe;
        out
    }

    /// The rest of the value, closed into valid JSON: `{}` when nothing was streamed, else
    /// what is left up to the last safe point and its closers.
    pub fn close(&mut self) -> String {
        if self.raw.is_empty() || (self.is_string() && !self.complete) {
            return "{}".to_string();
        }
        if self.scan.ends_in_number() {
            self.safe = self.raw.len();
            self.closers = self.scan.closers();
        }
        let mut out = self.take_ready();
        out.push_str(&std::mem::take(&mut self.closers));
        out
    }
}

/// One member of a call object being read.
#[derive(Debug)]
enum Member {
    Name(JsonScan, String),
    Args,
    Other(JsonScan),
}

#[derive(Debug)]
enum CallPos {
    Open,
    Key,
    KeyStr(JsonScan, String),
    Colon(String),
    Value(Member),
    After,
    Done,
}

/// What reading a call object produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallEvent {
    Name(String),
    Args(String),
}

/// Why a call object is not one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

/// Reads `{"name": "...", "arguments": {...}}` one character at a time.
#[derive(Debug)]
pub struct CallReader {
    pos: CallPos,
    name: Option<String>,
    args: ArgsStream,
}

impl Default for CallReader {
    fn default() -> Self {
        CallReader { pos: CallPos::Open, name: None, args: ArgsStream::default() }
    }
}

impl CallReader {
    /// Feed one character; events go to `out`. `Ok(true)` once the object is complete.
    pub fn feed(&mut self, c: char, out: &mut Vec<CallEvent>) -> Result<bool, Malformed> {
        let ws = c.is_ascii_whitespace();
        match &mut self.pos {
            CallPos::Done => return Err(Malformed),
            CallPos::Open | CallPos::Key | CallPos::After if ws => {}
            CallPos::Open if c == '{' => self.pos = CallPos::Key,
            CallPos::Key if c == '"' => {
                let mut scan = JsonScan::default();
                scan.feed(c);
                self.pos = CallPos::KeyStr(scan, c.to_string());
            }
            CallPos::KeyStr(scan, raw) => {
                raw.push(c);
                match scan.feed(c) {
                    Step::More => {}
                    Step::Done => {
                        let key = serde_json::from_str::<String>(raw).map_err(|_| Malformed)?;
                        self.pos = CallPos::Colon(key);
                    }
                    _ => return Err(Malformed),
                }
            }
            CallPos::Colon(_) if ws => {}
            CallPos::Colon(key) if c == ':' => {
                let member = match key.as_str() {
                    "name" if self.name.is_none() => Member::Name(JsonScan::default(), String::new()),
                    "arguments" | "parameters" if !self.args.started() => Member::Args,
                    _ => Member::Other(JsonScan::default()),
                };
                self.pos = CallPos::Value(member);
            }
            CallPos::Value(member) => {
                let step = match member {
                    Member::Name(scan, raw) => {
                        let step = scan.feed(c);
                        if !ws || !raw.is_empty() {
                            raw.push(c);
                        }
                        step
                    }
                    Member::Args => self.args.feed(c),
                    Member::Other(scan) => scan.feed(c),
                };
                match step {
                    Step::More => {}
                    Step::Invalid => return Err(Malformed),
                    Step::Done | Step::EndedBefore => {
                        if let Member::Name(_, raw) = member {
                            let name = serde_json::from_str::<String>(raw).map_err(|_| Malformed)?;
                            out.push(CallEvent::Name(name.clone()));
                            self.name = Some(name);
                        }
                        self.pos = CallPos::After;
                        if step == Step::EndedBefore {
                            return self.feed(c, out);
                        }
                    }
                }
                self.flush_args(out);
            }
            CallPos::After if c == ',' => self.pos = CallPos::Key,
            CallPos::After if c == '}' => {
                if self.name.is_none() {
                    return Err(Malformed);
                }
                self.pos = CallPos::Done;
                let rest = self.args.close();
                if !rest.is_empty() {
                    out.push(CallEvent::Args(rest));
                }
                return Ok(true);
            }
            _ => return Err(Malformed),
        }
        Ok(false)
    }

    fn flush_args(&mut self, out: &mut Vec<CallEvent>) {
        if self.name.is_some() {
            let ready = self.args.take_ready();
            if !ready.is_empty() {
                out.push(CallEvent::Args(ready));
            }
        }
    }

    /// The call was cut short after its name: close its arguments into valid JSON.
    pub fn close(&mut self) -> String {
        self.pos = CallPos::Done;
        self.args.close()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_all(text: &str) -> Vec<Step> {
        let mut s = JsonScan::default();
        text.chars().map(|c| s.feed(c)).collect()
    }

    #[test]
    fn scans_valid_values() {
        for v in [r#"{"a": [1, -2.5e+3, true, null, "x\"\u00e9"], "b": {}}"#, "[]", "[[], {}]", r#""s""#, "false"] {
            let steps = scan_all(v);
            assert_eq!(steps.last(), Some(&Step::Done), "{v}: {steps:?}");
            assert!(steps[..steps.len() - 1].iter().all(|s| *s == Step::More), "{v}");
        }
        // A top-level number ends at the next character.
        assert_eq!(scan_all("12 "), vec![Step::More, Step::More, Step::EndedBefore]);
    }

    #[test]
    fn rejects_invalid_text_at_the_first_bad_character() {
        for (v, at) in [(r#"{"a" 1}"#, 5), ("{a}", 1), ("[1,]", 3), (r#"{"a": tru}"#, 9), ("[1 2]", 3), ("[01]", 2)] {
            let steps = scan_all(v);
            assert_eq!(steps.iter().position(|s| *s == Step::Invalid), Some(at), "{v}: {steps:?}");
        }
    }

    #[test]
    fn safe_points_close_into_valid_json() {
        let text = r#"{"city": "Par\nis", "n": [1, {"x": 2.5}], "ok": true}"#;
        let mut s = JsonScan::default();
        for (i, c) in text.char_indices() {
            s.feed(c);
            if s.at_safe_point() {
                let closed = format!("{}{}", &text[..i + c.len_utf8()], s.closers());
                assert!(serde_json::from_str::<serde_json::Value>(&closed).is_ok(), "{closed}");
            }
        }
    }

    fn read(text: &str) -> (Result<bool, Malformed>, Vec<CallEvent>) {
        let mut r = CallReader::default();
        let mut out = Vec::new();
        for c in text.chars() {
            match r.feed(c, &mut out) {
                Ok(false) => {}
                done => return (done, out),
            }
        }
        (Ok(false), out)
    }

    fn args(events: &[CallEvent]) -> String {
        events.iter().filter_map(|e| if let CallEvent::Args(a) = e { Some(a.as_str()) } else { None }).collect()
    }

    #[test]
    fn reads_call_objects() {
        let (done, ev) = read(r#"{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}"#);
        assert_eq!(done, Ok(true));
        assert_eq!(ev[0], CallEvent::Name("get_weather".into()));
        assert_eq!(args(&ev), r#"{"city": "Paris", "days": 3}"#);
        // Arguments first, `parameters`, string-encoded arguments, no arguments.
        let (_, ev) = read(r#"{"arguments": {"a": 1}, "name": "f"}"#);
        assert_eq!((ev[0].clone(), args(&ev)), (CallEvent::Name("f".into()), r#"{"a": 1}"#.into()));
        let (_, ev) = read(r#"{"name": "f", "parameters": {"a": [1]}}"#);
        assert_eq!(args(&ev), r#"{"a": [1]}"#);
        let (_, ev) = read(r#"{"name": "f", "arguments": "{\"a\": 1}"}"#);
        assert_eq!(args(&ev), r#"{"a": 1}"#);
        let (_, ev) = read(r#"{"name": "f"}"#);
        assert_eq!(args(&ev), "{}");
    }

    #[test]
    fn malformed_calls_fail_and_cut_calls_close() {
        assert_eq!(read("not json").0, Err(Malformed));
        assert_eq!(read(r#"{"result": 5}"#).0, Err(Malformed));
        assert_eq!(read(r#"{"name": 5}"#).0, Err(Malformed));
        let mut r = CallReader::default();
        let mut out = Vec::new();
        for c in r#"{"name": "f", "arguments": {"city": "Par"#.chars() {
            r.feed(c, &mut out).expect("valid so far");
        }
        assert_eq!(out.first(), Some(&CallEvent::Name("f".into())));
        let mut streamed = args(&out);
        streamed.push_str(&r.close());
        assert_eq!(streamed, r#"{"city": "Par"}"#);
        // Cut inside a key: the last safe point was after the opening brace.
        let mut r = CallReader::default();
        let mut out = Vec::new();
        for c in r#"{"name": "f", "arguments": {"ci"#.chars() {
            r.feed(c, &mut out).expect("valid so far");
        }
        let mut streamed = args(&out);
        streamed.push_str(&r.close());
        assert_eq!(streamed, "{}");
    }
}
