//! The minijinja environment configured like Hugging Face's Jinja2 sandbox: `trim_blocks`,
//! `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, HF's `tojson`, Python
//! string/dict/list methods, and Jinja2's own spellings where minijinja differs (`None`,
//! `True`, `{'a': 1}` when printed; `is sequence`, `|length` of undefined, `|join`).

use std::fmt::Write;

use chrono::NaiveDateTime;
use minijinja::value::{from_args, Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};

use super::pyfmt::{json_dumps, py_str, JsonOptions};

/// The name the compiled template is stored under in its environment.
pub(crate) const TEMPLATE_NAME: &str = "chat_template";

/// The error `raise_exception(msg)` produces, found again through the error's sources.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct RaisedException(pub String);

/// An environment with the Hugging Face extras (`strftime_now` reads the local time; see
/// `ChatTemplate::with_fixed_now`).
pub(crate) fn build_environment() -> Environment<'static> {
    let mut env = Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_unknown_method_callback(python_method);
    env.set_formatter(|out, _state, value| {
        match value.as_str() {
            Some(s) => out.write_str(s),
            None => out.write_str(&py_str(value)),
        }
        .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write template output"))
    });

    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", |format: &str| strftime_now(None, format));

    env.add_filter("tojson", tojson);
    env.add_filter("from_json", from_json);
    env.add_filter("string", |value: &Value| -> Value {
        if value.kind() == ValueKind::String {
            value.clone()
        } else {
            Value::from(py_str(value))
        }
    });
    env.add_filter("join", join);
    env.add_filter("indent", indent);
    env.add_filter("length", length);
    env.add_filter("count", length);

    // Jinja2's tests: a string and a dict are sequences; undefined is iterable (and empty).
    env.add_test("sequence", |v: &Value| {
        matches!(v.kind(), ValueKind::Seq | ValueKind::String | ValueKind::Map | ValueKind::Undefined)
    });
    env.add_test("iterable", |v: &Value| {
        matches!(
            v.kind(),
            ValueKind::Seq | ValueKind::String | ValueKind::Map | ValueKind::Iterable | ValueKind::Undefined
        )
    });
    env
}

fn raise_exception(message: Option<Value>) -> Result<Value, Error> {
    let message = message.map(|m| py_str(&m)).unwrap_or_default();
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedException(message)))
}

/// Python's `datetime.now().strftime(format)`, at `now` if given.
pub(crate) fn strftime_now(now: Option<NaiveDateTime>, format: &str) -> Result<Value, Error> {
    let now = now.unwrap_or_else(|| chrono::Local::now().naive_local());
    let mut out = String::new();
    write!(out, "{}", now.format(format))
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: unsupported format {format:?}")))?;
    Ok(Value::from(out))
}

/// Hugging Face's `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`: Python's `json.dumps`, no HTML escaping.
fn tojson(value: &Value, ensure_ascii: Option<Value>, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii = match ensure_ascii {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("ensure_ascii")?,
    };
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match (v.as_str(), v.as_i64()) {
            (Some(s), _) => s.to_string(),
            (None, Some(n)) => " ".repeat(n.max(0) as usize),
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or a string")),
        }),
    };
    let mut opts = JsonOptions::new(indent);
    opts.ensure_ascii = ensure_ascii.is_some_and(|v| v.is_true());
    opts.sort_keys = kwargs.get::<Option<Value>>("sort_keys")?.is_some_and(|v| v.is_true());
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")? {
        if !seps.is_none() {
            let parts: Vec<Value> = seps.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                    opts.item_separator = py_str(item);
                    opts.key_separator = py_str(key);
                }
                _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings")),
            }
        }
    }
    kwargs.assert_all_used()?;
    Ok(Value::from(json_dumps(value, &opts)?))
}

/// `text | from_json`: parses JSON (a llama.cpp extension some templates use).
fn from_json(text: &str) -> Result<Value, Error> {
    serde_json::from_str::<serde_json::Value>(text)
        .map(Value::from_serialize)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("from_json: {e}")))
}

/// Jinja2's `join(value, d='', attribute=None)`, items printed with Python's `str()`.
fn join(value: &Value, joiner: Option<&str>, kwargs: Kwargs) -> Result<Value, Error> {
    let attribute: Option<Value> = kwargs.get("attribute")?;
    kwargs.assert_all_used()?;
    if value.is_undefined() || value.is_none() {
        return Ok(Value::from(""));
    }
    if let Some(s) = value.as_str() {
        let chars: Vec<String> = s.chars().map(String::from).collect();
        return Ok(Value::from(chars.join(joiner.unwrap_or(""))));
    }
    let mut out = String::new();
    for (i, item) in value.try_iter()?.enumerate() {
        if i > 0 {
            out.push_str(joiner.unwrap_or(""));
        }
        let item = match &attribute {
            Some(attr) => get_path(&item, attr)?,
            None => item,
        };
        out.push_str(&py_str(&item));
    }
    Ok(Value::from(out))
}

/// Jinja2's attribute getter: `"a.b"` or an integer index.
fn get_path(item: &Value, attr: &Value) -> Result<Value, Error> {
    match attr.as_str() {
        Some(path) => {
            let mut cur = item.clone();
            for part in path.split('.') {
                cur = match part.parse::<i64>() {
                    Ok(i) => cur.get_item(&Value::from(i))?,
                    Err(_) => cur.get_attr(part)?,
                };
            }
            Ok(cur)
        }
        None => item.get_item(attr),
    }
}

/// Jinja2's `indent(s, width=4, first=False, blank=False)`, Python line splitting included.
fn indent(
    value: &Value,
    width: Option<Value>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let width = match width {
        Some(w) => Some(w),
        None => kwargs.get::<Option<Value>>("width")?,
    };
    let first = first.or(kwargs.get::<Option<bool>>("first")?).unwrap_or(false);
    let blank = blank.or(kwargs.get::<Option<bool>>("blank")?).unwrap_or(false);
    kwargs.assert_all_used()?;
    let unit = match width {
        None => "    ".to_string(),
        Some(w) => match (w.as_str(), w.as_i64()) {
            (Some(s), _) => s.to_string(),
            (None, Some(n)) => " ".repeat(n.max(0) as usize),
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "indent: width must be an int or a string")),
        },
    };
    let text = format!("{}\n", py_str(value));
    let lines = py_splitlines(&text);
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        if i > 0 {
            out.push('\n');
            if blank || !line.is_empty() {
                out.push_str(&unit);
            }
        }
        out.push_str(line);
    }
    if first {
        out.insert_str(0, &unit);
    }
    Ok(Value::from(out))
}

/// Python's `str.splitlines()` (line ends dropped).
fn py_splitlines(s: &str) -> Vec<&str> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if matches!(
            c,
            '\n' | '\r' | '\u{b}' | '\u{c}' | '\u{1c}' | '\u{1d}' | '\u{1e}' | '\u{85}' | '\u{2028}' | '\u{2029}'
        ) {
            lines.push(&s[start..i]);
            let mut end = i + c.len_utf8();
            if c == '\r' {
                if let Some(&(j, '\n')) = chars.peek() {
                    chars.next();
                    end = j + 1;
                }
            }
            start = end;
        }
    }
    if start < s.len() {
        lines.push(&s[start..]);
    }
    lines
}

/// Jinja2's `length`/`count`: `len(Undefined)` is 0.
fn length(value: &Value) -> Result<Value, Error> {
    if value.is_undefined() {
        return Ok(Value::from(0));
    }
    value.len().map(Value::from).ok_or_else(|| {
        Error::new(ErrorKind::InvalidOperation, format!("cannot calculate length of value of type {}", value.kind()))
    })
}

/// Python methods on values: minijinja-contrib's pycompat set, plus a few it lacks.
fn python_method(state: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    match minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args) {
        Err(e) if e.kind() == ErrorKind::UnknownMethod => {}
        other => return other,
    }
    match (value.kind(), method) {
        (ValueKind::String, _) => string_method(value.as_str().unwrap_or_default(), method, args),
        (ValueKind::Seq, "index") => {
            let (needle,): (&Value,) = from_args(args)?;
            match value.try_iter()?.position(|item| &item == needle) {
                Some(i) => Ok(Value::from(i)),
                None => Err(Error::new(ErrorKind::InvalidOperation, "list.index(x): x not in list")),
            }
        }
        (ValueKind::Map, "copy") => Ok(value.clone()),
        (ValueKind::Seq | ValueKind::Map, "append" | "pop" | "extend" | "insert" | "update" | "remove" | "clear") => {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("{method}(): template values are immutable (as in Hugging Face's sandbox)"),
            ))
        }
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

fn string_method(s: &str, method: &str, args: &[Value]) -> Result<Value, Error> {
    match method {
        "removeprefix" => {
            let (prefix,): (&str,) = from_args(args)?;
            Ok(Value::from(s.strip_prefix(prefix).unwrap_or(s)))
        }
        "removesuffix" => {
            let (suffix,): (&str,) = from_args(args)?;
            Ok(Value::from(s.strip_suffix(suffix).unwrap_or(s)))
        }
        "rsplit" => {
            let (sep, maxsplit): (Option<&str>, Option<i64>) = from_args(args)?;
            let maxsplit = maxsplit.filter(|&m| m >= 0).map(|m| m as usize);
            let mut parts: Vec<&str> = match (sep, maxsplit) {
                (Some(sep), Some(m)) => s.rsplitn(m + 1, sep).collect(),
                (Some(sep), None) => s.rsplit(sep).collect(),
                (None, Some(m)) => {
                    let trimmed = s.trim_end();
                    let mut out = Vec::new();
                    let mut rest = trimmed;
                    while out.len() < m {
                        match rest.rfind(char::is_whitespace) {
                            Some(i) => {
                                out.push(&rest[i + rest[i..].chars().next().map_or(1, char::len_utf8)..]);
                                rest = rest[..i].trim_end();
                            }
                            None => break,
                        }
                    }
                    if !rest.is_empty() {
                        out.push(rest);
                    }
                    out
                }
                (None, None) => s.split_whitespace().rev().collect(),
            };
            parts.reverse();
            Ok(Value::from_iter(parts.into_iter().map(Value::from)))
        }
        "partition" | "rpartition" => {
            let (sep,): (&str,) = from_args(args)?;
            let found = if method == "partition" { s.find(sep) } else { s.rfind(sep) };
            let parts = match found {
                Some(i) => [&s[..i], sep, &s[i + sep.len()..]],
                None if method == "partition" => [s, "", ""],
                None => ["", "", s],
            };
            Ok(Value::from_iter(parts.into_iter().map(Value::from)))
        }
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

/// Replaces HF's `{% generation %}` / `{% endgeneration %}` tags (its assistant-mask
/// extension; a no-op when rendering) by `{% if true %}` / `{% endif %}`, keeping the
/// whitespace-control markers so trimming is unchanged.
pub(crate) fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        // The close is searched after the open: in `{%}` the `%}` overlaps it.
        let Some(end) = tag[2..].find("%}").map(|e| e + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let body = inner.trim_start_matches(['-', '+']).trim_end_matches(['-', '+']).trim();
        let replacement = match body {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(word) => {
                let open = &inner[..inner.len() - inner.trim_start_matches(['-', '+']).len()];
                let close = &inner[inner.trim_end_matches(['-', '+']).len()..];
                let _ = write!(out, "{{%{open} {word} {close}%}}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}
