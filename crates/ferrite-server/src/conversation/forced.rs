//! The output constraint of a forced tool call (`tool_choice` required, a named function, or
//! Anthropic's `any` / `tool`): the prompt ends with the call's opening, and the reply must be
//! the rest of one call — the function's name when the model picks it, then arguments valid
//! under that tool's parameter schema, then the syntax's closing text — so the call always
//! parses and its arguments always validate. Gemma 4's call syntax is not JSON: its forced
//! calls stay unconstrained.

use ferrite_engine::{Constraint, Piece};
use serde_json::{json, Value};

use crate::parser::family::ToolSyntax;

/// What a syntax writes between a call's name and its arguments, and after them.
struct CallShape {
    /// Text after the name (the opening ends with a JSON string's open quote, where quoted).
    after_name: Piece,
    close: &'static str,
    /// Whether the name is a JSON string's content (escaped) or bare text.
    quoted: bool,
}

fn shape(syntax: ToolSyntax, args_token: Option<u32>) -> Option<CallShape> {
    let text = |s: &str| Piece::Text(s.to_string());
    Some(match syntax {
        ToolSyntax::Hermes => CallShape { after_name: text("\", \"arguments\": "), close: "}", quoted: true },
        ToolSyntax::Llama3Json => CallShape { after_name: text("\", \"parameters\": "), close: "}", quoted: true },
        ToolSyntax::MistralList => CallShape { after_name: text("\", \"arguments\": "), close: "}]", quoted: true },
        ToolSyntax::MistralArgs => {
            CallShape { after_name: args_token.map_or_else(|| text("[ARGS]"), Piece::Token), close: "", quoted: false }
        }
        ToolSyntax::Gemma4 => return None,
    })
}

/// The parameter schema of an OpenAI-shaped function tool (none, or not an object schema:
/// an empty object — a call's arguments are an object).
fn parameters(tool: &Value) -> Value {
    match tool.get("function").and_then(|f| f.get("parameters")) {
        Some(schema @ Value::Object(_)) => schema.clone(),
        _ => json!({"type": "object", "properties": {}}),
    }
}

fn tool_name(tool: &Value) -> Option<&str> {
    tool.get("function").and_then(|f| f.get("name")).and_then(Value::as_str)
}

/// The constraint on the reply after a forced opening in `syntax`: the call of `name` (whose
/// name the opening already holds) or of any of `tools`. `args_token` is the `[ARGS]` special
/// token where the tokenizer has one. `None` where the syntax has no JSON arguments.
pub fn call_constraint(
    syntax: ToolSyntax,
    tools: &[Value],
    name: Option<&str>,
    args_token: Option<u32>,
) -> Option<Constraint> {
    let shape = shape(syntax, args_token)?;
    let tail = |tool: &Value| {
        let mut pieces = vec![Piece::Json(parameters(tool))];
        if !shape.close.is_empty() {
            pieces.push(Piece::Text(shape.close.to_string()));
        }
        pieces
    };
    let alternatives: Vec<Vec<Piece>> = match name {
        Some(name) => vec![tail(tools.iter().find(|t| tool_name(t) == Some(name))?)],
        None => tools
            .iter()
            .filter_map(|t| {
                let name = tool_name(t)?;
                let written = if shape.quoted {
                    let q = Value::from(name).to_string();
                    q[1..q.len() - 1].to_string()
                } else {
                    name.to_string()
                };
                Some([vec![Piece::Text(written), shape.after_name.clone()], tail(t)].concat())
            })
            .collect(),
    };
    (!alternatives.is_empty()).then_some(Constraint::Sequences(alternatives))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, parameters: Option<Value>) -> Value {
        let mut f = json!({"name": name});
        if let Some(p) = parameters {
            f["parameters"] = p;
        }
        json!({"type": "function", "function": f})
    }

    #[test]
    fn named_and_picked_calls() {
        let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let tools = [tool("w", Some(schema.clone())), tool("q\"x", None)];
        let named = call_constraint(ToolSyntax::Hermes, &tools, Some("w"), None).expect("constraint");
        assert_eq!(named, Constraint::Sequences(vec![vec![Piece::Json(schema.clone()), Piece::Text("}".into())]]));
        let any = call_constraint(ToolSyntax::MistralList, &tools, None, None).expect("constraint");
        let Constraint::Sequences(alts) = any else { panic!("sequences") };
        assert_eq!(alts[0][0], Piece::Text("w".into()));
        assert_eq!(alts[1][0], Piece::Text("q\\\"x".into()), "the name is escaped inside its JSON string");
        assert_eq!(alts[1][2], Piece::Json(json!({"type": "object", "properties": {}})));
        assert_eq!(alts[1][3], Piece::Text("}]".into()));
        let args = call_constraint(ToolSyntax::MistralArgs, &tools, None, Some(9)).expect("constraint");
        let Constraint::Sequences(alts) = args else { panic!("sequences") };
        assert_eq!(alts[0], vec![Piece::Text("w".into()), Piece::Token(9), Piece::Json(schema)]);
        assert_eq!(call_constraint(ToolSyntax::Gemma4, &tools, Some("w"), None), None);
        assert_eq!(call_constraint(ToolSyntax::Hermes, &tools, Some("missing"), None), None);
    }
}
