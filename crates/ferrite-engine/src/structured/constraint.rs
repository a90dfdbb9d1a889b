//! `Constraint`: what a request's output must match, and its llguidance grammar.

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

/// The shape a request's output must take.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Constraint {
    /// JSON valid under this JSON Schema.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Text in the language of this Lark grammar (llguidance's dialect, `start` rule).
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// One of these sequences of pieces (fixed text, special tokens, JSON values under a
    /// schema): say, the rest of a forced tool call — a name, then arguments its schema allows.
    Sequences(Vec<Vec<Piece>>),
}

/// One part of a `Constraint::Sequences` alternative.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Piece {
    /// This text, exactly.
    Text(String),
    /// This token (a special token, which no text spells).
    Token(u32),
    /// JSON valid under this JSON Schema, laid out as `Constraint::JsonSchema` lays it out.
    Json(Value),
}

/// JSON laid out the way `json.dumps` writes it — `", "` and `": "`, no free whitespace — so a
/// model cannot wander into endless blank lines. A schema's own `x-guidance` options win.
fn layout() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// The most bytes a constraint's text may take (a grammar, a regex, a schema as JSON, the
/// choices together): checked before anything is compiled.
pub const MAX_CONSTRAINT_BYTES: usize = 256 << 10;

/// The most entries a choice list may hold.
pub const MAX_CHOICES: usize = 1024;

/// The most positions a regex may spell out once its counted repetitions are expanded
/// (`(a{1000}){1000}` is a million): the lexer builds states for them step by step, so such a
/// regex compiles and then fails mid-generation.
pub const MAX_REGEX_EXPANSION: u64 = 100_000;

/// The positions `hir` spells out with every counted repetition expanded (an open-ended one
/// counts its minimum, at least once).
fn expansion(hir: &regex_syntax::hir::Hir) -> u64 {
    use regex_syntax::hir::HirKind;
    match hir.kind() {
        HirKind::Empty | HirKind::Look(_) => 0,
        HirKind::Literal(lit) => lit.0.len() as u64,
        HirKind::Class(_) => 1,
        HirKind::Repetition(r) => expansion(&r.sub).saturating_mul(u64::from(r.max.unwrap_or(r.min).max(1))),
        HirKind::Capture(c) => expansion(&c.sub),
        HirKind::Concat(subs) | HirKind::Alternation(subs) => subs.iter().map(expansion).fold(0, u64::saturating_add),
    }
}

impl Constraint {
    /// Refuse a constraint too large to compile in bounded time, before compiling it.
    pub(crate) fn check_size(&self) -> Result<(), String> {
        let json_len = |v: &Value| serde_json::to_vec(v).map_or(usize::MAX, |b| b.len());
        let bytes = match self {
            Constraint::JsonSchema(schema) => json_len(schema),
            Constraint::JsonObject => 0,
            Constraint::Regex(text) => {
                // An invalid regex is left to the compiler, which says what is wrong.
                let expanded = regex_syntax::parse(text).map_or(0, |hir| expansion(&hir));
                if expanded > MAX_REGEX_EXPANSION {
                    return Err(format!(
                        "the regex expands to {expanded} positions; at most {MAX_REGEX_EXPANSION} are allowed"
                    ));
                }
                text.len()
            }
            Constraint::Lark(text) => text.len(),
            Constraint::Choice(choices) => {
                if choices.len() > MAX_CHOICES {
                    return Err(format!("at most {MAX_CHOICES} choices are allowed, got {}", choices.len()));
                }
                choices.iter().map(String::len).sum()
            }
            Constraint::Sequences(alternatives) => alternatives
                .iter()
                .flatten()
                .map(|p| match p {
                    Piece::Text(t) => t.len(),
                    Piece::Token(_) => 8,
                    Piece::Json(schema) => json_len(schema),
                })
                .sum(),
        };
        if bytes > MAX_CONSTRAINT_BYTES {
            return Err(format!("the constraint is {bytes} bytes; at most {MAX_CONSTRAINT_BYTES} are allowed"));
        }
        Ok(())
    }

    pub(crate) fn grammar(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            Constraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(laid_out(schema)),
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(json!({"type": "object", "x-guidance": layout()}))
            }
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
            Constraint::Choice(choices) => {
                if choices.is_empty() {
                    return Err("the choice list is empty".into());
                }
                if choices.iter().any(String::is_empty) {
                    return Err("a choice is the empty string".into());
                }
                // Lark string literals are JSON strings.
                let alts: Vec<String> = choices.iter().map(|c| Value::from(c.as_str()).to_string()).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
            Constraint::Sequences(alternatives) => TopLevelGrammar::from_lark(sequences_lark(alternatives)?),
        })
    }
}

/// `schema`, closed (`close_objects`) and with the `json.dumps` layout unless it says otherwise.
fn laid_out(schema: &Value) -> Value {
    let mut schema = schema.clone();
    close_objects(&mut schema);
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(layout);
    }
    schema
}

/// A Lark grammar for `Constraint::Sequences`: `start` picks an alternative; each JSON piece
/// is a rule of its own holding the schema (`%json`), text is a string literal, a token is
/// `<[id]>`.
fn sequences_lark(alternatives: &[Vec<Piece>]) -> Result<String, String> {
    if alternatives.is_empty() || alternatives.iter().any(Vec::is_empty) {
        return Err("a sequence constraint needs alternatives, none of them empty".into());
    }
    let mut rules = Vec::new();
    let mut alts = Vec::new();
    for (i, pieces) in alternatives.iter().enumerate() {
        let mut items = Vec::new();
        for (j, piece) in pieces.iter().enumerate() {
            items.push(match piece {
                // Lark string literals are JSON strings.
                Piece::Text(text) => Value::from(text.as_str()).to_string(),
                Piece::Token(id) => format!("<[{id}]>"),
                Piece::Json(schema) => {
                    rules.push(format!("json_{i}_{j}: %json {}", laid_out(schema)));
                    format!("json_{i}_{j}")
                }
            });
        }
        alts.push(items.join(" "));
    }
    Ok(format!("start: {}\n{}", alts.join(" | "), rules.join("\n")))
}

/// Give every object schema that lists `properties` and says nothing about other keys
/// `additionalProperties: false` — xgrammar's strict mode, and what OpenAI's strict schemas
/// spell out — so a model is not led into inventing keys. Output valid under the closed schema
/// is valid under the original. `allOf` is left alone: its branches merge, and closing one
/// would forbid the keys of the others.
fn close_objects(schema: &mut Value) {
    let Some(obj) = schema.as_object_mut() else { return };
    let open = ["additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref"];
    if obj.contains_key("properties") && !open.iter().any(|k| obj.contains_key(*k)) {
        obj.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (key, child) in obj.iter_mut() {
        match key.as_str() {
            "properties" | "$defs" | "definitions" | "patternProperties" => {
                child.as_object_mut().into_iter().flat_map(|m| m.values_mut()).for_each(close_objects)
            }
            "prefixItems" | "anyOf" | "oneOf" => child.as_array_mut().into_iter().flatten().for_each(close_objects),
            "items" | "additionalProperties" => match child {
                Value::Array(items) => items.iter_mut().for_each(close_objects),
                other => close_objects(other),
            },
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_bounds() {
        assert!(Constraint::Choice(vec!["a".into(); MAX_CHOICES]).check_size().is_ok());
        assert!(Constraint::Choice(vec!["a".into(); MAX_CHOICES + 1]).check_size().is_err());
        assert!(Constraint::Lark("x".repeat(MAX_CONSTRAINT_BYTES + 1)).check_size().is_err());
        let big = json!({"enum": vec!["x".repeat(1000); 300]});
        assert!(Constraint::JsonSchema(big).check_size().is_err());
        assert!(Constraint::Regex("a{1000}".into()).check_size().is_ok());
        assert!(Constraint::Regex("(a{1000}){1000}".into()).check_size().is_err(), "a million positions");
        assert!(Constraint::Regex(r"\d{3}-\d{4}|[a-z]+@[a-z]+\.com".into()).check_size().is_ok());
    }

    #[test]
    fn sequences_as_lark() {
        let call = |name: &str| {
            vec![Piece::Text(format!("{name}\", ")), Piece::Json(json!({"type": "object"})), Piece::Token(7)]
        };
        let lark = sequences_lark(&[call("a"), call("b")]).expect("lark");
        let want = r#"start: "a\", " json_0_1 <[7]> | "b\", " json_1_1 <[7]>"#;
        assert_eq!(lark.lines().next(), Some(want), "{lark}");
        assert!(lark.contains("json_1_1: %json {"), "{lark}");
        assert!(sequences_lark(&[]).is_err());
        assert!(sequences_lark(&[vec![]]).is_err());
    }

    #[test]
    fn closes_objects_that_do_not_say() {
        let mut s = json!({
            "type": "object",
            "properties": {"a": {"type": "object", "properties": {"b": {}}}, "m": {"type": "object"}},
            "$defs": {"d": {"properties": {"x": {}}, "additionalProperties": true}},
            "anyOf": [{"properties": {"y": {}}}],
            "items": [{"properties": {"z": {}}}],
        });
        close_objects(&mut s);
        assert_eq!(s["additionalProperties"], json!(false));
        assert_eq!(s["properties"]["a"]["additionalProperties"], json!(false));
        assert_eq!(s["properties"]["m"].get("additionalProperties"), None, "no properties: any object");
        assert_eq!(s["$defs"]["d"]["additionalProperties"], json!(true), "said: kept");
        assert_eq!(s["anyOf"][0]["additionalProperties"], json!(false));
        assert_eq!(s["items"][0]["additionalProperties"], json!(false));
        let mut merged = json!({"allOf": [{"properties": {"a": {}}}], "properties": {"b": {}}});
        close_objects(&mut merged);
        assert_eq!(merged.get("additionalProperties"), None);
        assert_eq!(merged["allOf"][0].get("additionalProperties"), None);
    }
}
