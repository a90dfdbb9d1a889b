//! Gemma 4's function-call syntax, as its chat template writes calls:
//! `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3,flag:true,list:[1,2],obj:{a:1}}<tool_call|>`
//! — keys bare (or quoted like strings), strings between `<|"|>` marks, other scalars bare.
//! `parse_call` turns the text between the call tags into the name and JSON arguments.

use serde_json::{Map, Value};

/// Gemma 4's string quote (a special token).
pub const QUOTE: &str = "<|\"|>";

/// `call:NAME{...}` → (NAME, arguments as JSON text); `None` when it is not that.
pub fn parse_call(body: &str) -> Option<(String, String)> {
    let rest = body.trim().strip_prefix("call:")?;
    let brace = rest.find('{')?;
    let name = rest[..brace].trim();
    if name.is_empty() || name.contains(char::is_whitespace) {
        return None;
    }
    let mut cursor = &rest[brace..];
    let args = value(&mut cursor)?;
    if !cursor.trim().is_empty() || !args.is_object() {
        return None;
    }
    Some((name.to_string(), args.to_string()))
}

fn skip_ws(s: &mut &str) {
    *s = s.trim_start();
}

fn eat(s: &mut &str, prefix: &str) -> bool {
    match s.strip_prefix(prefix) {
        Some(rest) => {
            *s = rest;
            true
        }
        None => false,
    }
}

fn quoted(s: &mut &str) -> Option<String> {
    if !eat(s, QUOTE) {
        return None;
    }
    let end = s.find(QUOTE)?;
    let text = s[..end].to_string();
    *s = &s[end + QUOTE.len()..];
    Some(text)
}

fn value(s: &mut &str) -> Option<Value> {
    skip_ws(s);
    if s.starts_with(QUOTE) {
        return quoted(s).map(Value::String);
    }
    if eat(s, "{") {
        let mut map = Map::new();
        skip_ws(s);
        if eat(s, "}") {
            return Some(Value::Object(map));
        }
        loop {
            skip_ws(s);
            let key = if s.starts_with(QUOTE) {
                quoted(s)?
            } else {
                let colon = s.find(':')?;
                let key = s[..colon].trim().to_string();
                *s = &s[colon..];
                key
            };
            skip_ws(s);
            if key.is_empty() || !eat(s, ":") {
                return None;
            }
            map.insert(key, value(s)?);
            skip_ws(s);
            if eat(s, "}") {
                return Some(Value::Object(map));
            }
            if !eat(s, ",") {
                return None;
            }
        }
    }
    if eat(s, "[") {
        let mut items = Vec::new();
        skip_ws(s);
        if eat(s, "]") {
            return Some(Value::Array(items));
        }
        loop {
            items.push(value(s)?);
            skip_ws(s);
            if eat(s, "]") {
                return Some(Value::Array(items));
            }
            if !eat(s, ",") {
                return None;
            }
        }
    }
    let end = s.find([',', '}', ']']).unwrap_or(s.len());
    let token = s[..end].trim();
    *s = &s[end..];
    if token.is_empty() {
        return None;
    }
    Some(serde_json::from_str::<Value>(token).ok().filter(|v| !v.is_string()).unwrap_or_else(|| token.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(body: &str) -> Option<(String, Value)> {
        parse_call(body).map(|(n, a)| (n, serde_json::from_str(&a).expect("json")))
    }

    #[test]
    fn parses_the_template_format() {
        let body =
            r#"call:get_weather{location:<|"|>Paris, FR<|"|>,days:3,metric:true,tags:[<|"|>a<|"|>,2],opt:{x:null}}"#;
        assert_eq!(
            args(body),
            Some((
                "get_weather".into(),
                json!({"location": "Paris, FR", "days": 3, "metric": true, "tags": ["a", 2], "opt": {"x": null}})
            ))
        );
        assert_eq!(args("call:ping{}"), Some(("ping".into(), json!({}))));
        assert_eq!(
            args(r#"call:f{<|"|>k<|"|>:1.5,s:bare words}"#),
            Some(("f".into(), json!({"k": 1.5, "s": "bare words"})))
        );
    }

    #[test]
    fn rejects_other_text() {
        for bad in [
            "get_weather{}",
            "call:{a:1}",
            "call:f{a:1",
            "call:f{a:1}}",
            "call:f{:1}",
            "call:f[1]",
            r#"call:f{a:<|"|>x}"#,
        ] {
            assert_eq!(parse_call(bad), None, "{bad}");
        }
    }
}
