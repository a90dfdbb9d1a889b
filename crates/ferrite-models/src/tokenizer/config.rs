//! What a `tokenizer.json` leaves to its siblings: BOS/EOS and whether to add BOS, from
//! `tokenizer_config.json`, extra end-of-generation ids from `generation_config.json`, and
//! the post-processor template as the fallback when no config says.

use std::path::Path;

use serde_json::Value;

use crate::error::{LoadError, Result};

/// The parts of `tokenizer_config.json` we use. Every field is optional.
#[derive(Debug, Default)]
pub(super) struct TokenizerConfig {
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    /// `Some(None)`: the config says there is no such token (`null`).
    pub bos_token: Option<Option<String>>,
    pub eos_token: Option<Option<String>>,
}

/// A token field: a string, an `AddedToken`-like object with `content`, or null.
fn token_field(v: &Value) -> Option<Option<String>> {
    match v {
        Value::Null => Some(None),
        Value::String(s) => Some(Some(s.clone())),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(|s| Some(s.to_string())),
        _ => None,
    }
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(LoadError::io(path, e)),
    };
    serde_json::from_str(&text).map(Some).map_err(|e| LoadError::format(path, format!("invalid JSON: {e}")))
}

impl TokenizerConfig {
    /// `dir/tokenizer_config.json`, or the default when the file does not exist.
    pub fn read(dir: &Path) -> Result<TokenizerConfig> {
        let path = dir.join("tokenizer_config.json");
        let Some(v) = read_json(&path)? else { return Ok(TokenizerConfig::default()) };
        Ok(TokenizerConfig {
            add_bos_token: v.get("add_bos_token").and_then(Value::as_bool),
            add_eos_token: v.get("add_eos_token").and_then(Value::as_bool),
            bos_token: v.get("bos_token").and_then(token_field),
            eos_token: v.get("eos_token").and_then(token_field),
        })
    }
}

/// `eos_token_id` (an id or a list of ids) from `dir/generation_config.json`, if any.
pub(super) fn generation_eos_ids(dir: &Path) -> Result<Vec<u32>> {
    let path = dir.join("generation_config.json");
    let Some(v) = read_json(&path)? else { return Ok(Vec::new()) };
    let ids = match v.get("eos_token_id") {
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).collect(),
        Some(v) => v.as_u64().into_iter().collect(),
        None => Vec::new(),
    };
    Ok(ids.into_iter().filter_map(|id| u32::try_from(id).ok()).collect())
}

/// The special tokens a post-processor puts before and after a single sequence: a
/// `TemplateProcessing`'s (`[BOS] $A`, `[CLS] $A [SEP]`), BERT's and RoBERTa's (`cls $A sep`),
/// looking inside a `Sequence` of post-processors too.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct TemplateTokens {
    pub leading: Option<String>,
    pub trailing: Option<String>,
}

pub(super) fn template_tokens(post_processor: &Value) -> TemplateTokens {
    let special =
        |item: Option<&Value>| -> Option<String> { item?.get("SpecialToken")?.get("id")?.as_str().map(str::to_string) };
    let pair_token =
        |key: &str| -> Option<String> { post_processor.get(key)?.as_array()?.first()?.as_str().map(str::to_string) };
    match post_processor.get("type").and_then(Value::as_str) {
        Some("TemplateProcessing") => {
            let single = post_processor.get("single").and_then(Value::as_array);
            let single = single.map(Vec::as_slice).unwrap_or_default();
            TemplateTokens { leading: special(single.first()), trailing: special(single.last()) }
        }
        Some("BertProcessing" | "RobertaProcessing") => {
            TemplateTokens { leading: pair_token("cls"), trailing: pair_token("sep") }
        }
        Some("Sequence") => {
            let list = post_processor.get("processors").and_then(Value::as_array);
            let found: Vec<TemplateTokens> = list.into_iter().flatten().map(template_tokens).collect();
            TemplateTokens {
                leading: found.iter().find_map(|t| t.leading.clone()),
                trailing: found.iter().find_map(|t| t.trailing.clone()),
            }
        }
        _ => TemplateTokens::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn template_tokens_of_each_post_processor() {
        let bert = json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "[SEP]", "type_id": 0}}]});
        let want = TemplateTokens { leading: Some("[CLS]".into()), trailing: Some("[SEP]".into()) };
        assert_eq!(template_tokens(&bert), want);
        let llama = json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]});
        assert_eq!(template_tokens(&llama), TemplateTokens { leading: Some("<s>".into()), trailing: None });
        let old = json!({"type": "BertProcessing", "sep": ["[SEP]", 102], "cls": ["[CLS]", 101]});
        assert_eq!(template_tokens(&old), want);
        let roberta = json!({"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0]});
        assert_eq!(template_tokens(&roberta).trailing.as_deref(), Some("</s>"));
        let seq = json!({"type": "Sequence", "processors": [{"type": "ByteLevel"}, bert]});
        assert_eq!(template_tokens(&seq), want);
        assert_eq!(template_tokens(&json!({"type": "ByteLevel"})), TemplateTokens::default());
    }
}
