//! Structured-output request fields as an engine `Constraint`: OpenAI's `response_format`
//! (`text`, `json_object`, `json_schema` — `strict` or not, the schema is enforced either way),
//! vLLM's `guided_json`, `guided_regex`, `guided_grammar` (llguidance's Lark) and
//! `guided_choice`, and the Responses API's `text.format` (the same formats, flattened). A
//! constraint that does not compile is a 400 from the engine, naming the problem.
//!
//! Anthropic's `output_config.format` (`{"type": "json_schema", "schema": ...}`) is the
//! Responses shape and goes through here too. Its `tool_choice` `any` / `tool`, like chat's
//! `required` / a named function, forces a call whose input is constrained to the tool's
//! schema (`conversation::forced`).

use ferrite_engine::Constraint;
use serde_json::Value;

use crate::error::ApiError;

/// The constraint of a `response_format` (chat shape: `json_schema: {name, schema, strict}`)
/// or a `text.format` (Responses shape: `{type, name, schema, strict}`); `param` names the
/// field in errors.
pub fn from_format(format: &Value, param: &str) -> Result<Option<Constraint>, ApiError> {
    if format.is_null() {
        return Ok(None);
    }
    let bad = |field: &str, msg: String| ApiError::invalid_param(format!("{param}{field}"), msg);
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let spec = format.get("json_schema").unwrap_or(format);
            match spec.get("schema") {
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => Ok(Some(Constraint::JsonSchema(schema.clone()))),
                Some(_) => Err(bad(".schema", format!("'{param}' json_schema.schema must be a JSON Schema object"))),
                None => Err(bad(".schema", format!("'{param}' of type json_schema needs a schema"))),
            }
        }
        Some(other) => {
            Err(bad(".type", format!("'{param}.type' must be 'text', 'json_object' or 'json_schema', got '{other}'")))
        }
        None => Err(bad(".type", format!("'{param}.type' must be a string"))),
    }
}

/// vLLM's guided-decoding fields, as sent.
#[derive(Debug, Default, Clone, Copy)]
pub struct GuidedFields<'a> {
    /// A JSON Schema, as an object or a JSON string.
    pub guided_json: Option<&'a Value>,
    pub guided_regex: Option<&'a str>,
    /// A Lark grammar (llguidance's dialect).
    pub guided_grammar: Option<&'a str>,
    pub guided_choice: Option<&'a [String]>,
}

impl GuidedFields<'_> {
    /// The constraint these fields ask for (at most one may be set).
    pub fn constraint(&self) -> Result<Option<(Constraint, &'static str)>, ApiError> {
        let mut found = Vec::new();
        if let Some(v) = self.guided_json.filter(|v| !v.is_null()) {
            let schema = match v {
                Value::String(s) => serde_json::from_str(s).map_err(|e| {
                    ApiError::invalid_param("guided_json", format!("guided_json is not valid JSON: {e}"))
                })?,
                other => other.clone(),
            };
            found.push((Constraint::JsonSchema(schema), "guided_json"));
        }
        if let Some(rx) = self.guided_regex {
            found.push((Constraint::Regex(rx.to_string()), "guided_regex"));
        }
        if let Some(g) = self.guided_grammar {
            found.push((Constraint::Lark(g.to_string()), "guided_grammar"));
        }
        if let Some(c) = self.guided_choice {
            found.push((Constraint::Choice(c.to_vec()), "guided_choice"));
        }
        if found.len() > 1 {
            let names: Vec<&str> = found.iter().map(|(_, n)| *n).collect();
            return Err(ApiError::invalid_param(
                names[1],
                format!("only one structured-output field may be set, got {}", names.join(" and ")),
            ));
        }
        Ok(found.pop())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn formats_in_both_shapes() {
        assert_eq!(from_format(&json!({"type": "text"}), "response_format").expect("ok"), None);
        assert_eq!(from_format(&json!({"type": "json_object"}), "x").expect("ok"), Some(Constraint::JsonObject));
        let schema = json!({"type": "object"});
        let chat = json!({"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": true}});
        let flat = json!({"type": "json_schema", "name": "a", "schema": schema, "strict": true});
        for f in [chat, flat] {
            assert_eq!(from_format(&f, "x").expect("ok"), Some(Constraint::JsonSchema(schema.clone())));
        }
        let err = from_format(&json!({"type": "json_schema", "json_schema": {"name": "a"}}), "response_format");
        assert_eq!(err.expect_err("400").param.as_deref(), Some("response_format.schema"));
        let err = from_format(&json!({"type": "yaml"}), "text.format").expect_err("400");
        assert_eq!(err.param.as_deref(), Some("text.format.type"));
    }

    #[test]
    fn guided_fields() {
        let schema = json!("{\"type\": \"integer\"}");
        let g = GuidedFields { guided_json: Some(&schema), ..Default::default() };
        assert_eq!(
            g.constraint().expect("ok"),
            Some((Constraint::JsonSchema(json!({"type": "integer"})), "guided_json"))
        );
        let choices = vec!["a".to_string()];
        let g = GuidedFields { guided_choice: Some(&choices), ..Default::default() };
        assert_eq!(g.constraint().expect("ok"), Some((Constraint::Choice(vec!["a".into()]), "guided_choice")));
        let two = GuidedFields { guided_regex: Some("a"), guided_grammar: Some("start: \"a\""), ..Default::default() };
        assert!(two.constraint().is_err());
        let not_json = json!("{not json");
        let bad = GuidedFields { guided_json: Some(&not_json), ..Default::default() };
        assert_eq!(bad.constraint().expect_err("400").param.as_deref(), Some("guided_json"));
    }
}
