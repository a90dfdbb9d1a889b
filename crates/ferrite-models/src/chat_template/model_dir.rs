//! Finding a model directory's chat templates the way transformers does:
//! `chat_template.jinja` (the default), `additional_chat_templates/<name>.jinja`, the
//! `chat_template` field of `tokenizer_config.json` (a string, or a list of
//! `{name, template}`), and the processor's legacy `chat_template.json`; plus the
//! `bos_token`/`eos_token` strings of `tokenizer_config.json`.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::{ChatTemplate, ChatTemplateError};

/// The chat templates of one model directory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelChatTemplates {
    /// The template used when no name is asked for (transformers' `"default"`).
    pub default: Option<String>,
    /// The other named templates (`"tool_use"`, `"rag"`, …).
    pub named: BTreeMap<String, String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl ModelChatTemplates {
    /// Reads the templates of `dir`. A directory without any template gives an empty
    /// value (`default: None`), not an error; unreadable or malformed files are errors.
    pub fn from_model_dir(dir: &Path) -> Result<Self, ChatTemplateError> {
        let mut found = ModelChatTemplates::default();

        let legacy = dir.join("chat_template.json");
        if let Some(json) = read_json(&legacy)? {
            if let Some(t) = json.get("chat_template") {
                found.add_field(t, &legacy)?;
            }
        }
        let config_path = dir.join("tokenizer_config.json");
        if let Some(config) = read_json(&config_path)? {
            if let Some(t) = config.get("chat_template") {
                found.add_field(t, &config_path)?;
            }
            found.bos_token = special_token(config.get("bos_token"));
            found.eos_token = special_token(config.get("eos_token"));
        }
        if let Some(text) = read_text(&dir.join("chat_template.jinja"))? {
            found.default = Some(text);
        }
        let extra_dir = dir.join("additional_chat_templates");
        if extra_dir.is_dir() {
            let entries = std::fs::read_dir(&extra_dir).map_err(|e| ChatTemplateError::io(&extra_dir, e))?;
            for entry in entries {
                let path = entry.map_err(|e| ChatTemplateError::io(&extra_dir, e))?.path();
                if path.extension().is_some_and(|e| e == "jinja") {
                    let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
                    if let Some(text) = read_text(&path)? {
                        found.named.insert(name, text);
                    }
                }
            }
        }
        if let Some(default) = found.named.remove("default") {
            found.default.get_or_insert(default);
        }
        Ok(found)
    }

    /// The template named `name` (`None` or `"default"`: the default one).
    pub fn get(&self, name: Option<&str>) -> Option<&str> {
        match name {
            None | Some("default") => self.default.as_deref(),
            Some(name) => self.named.get(name).map(String::as_str),
        }
    }

    /// The names of all templates, `"default"` first when there is one.
    pub fn names(&self) -> Vec<&str> {
        self.default.iter().map(|_| "default").chain(self.named.keys().map(String::as_str)).collect()
    }

    /// Compiles the template named `name` with this directory's special tokens.
    pub fn compile(&self, name: Option<&str>) -> Result<ChatTemplate, ChatTemplateError> {
        let source = self.get(name).ok_or_else(|| ChatTemplateError::NotFound {
            name: name.unwrap_or("default").to_string(),
            available: self.names().join(", "),
        })?;
        ChatTemplate::new(source, self.bos_token.clone(), self.eos_token.clone())
    }

    /// A `chat_template` field: a string (the default) or a list of `{name, template}`.
    fn add_field(&mut self, field: &Value, path: &Path) -> Result<(), ChatTemplateError> {
        match field {
            Value::Null => {}
            Value::String(s) => self.default = Some(s.clone()),
            Value::Array(items) => {
                for item in items {
                    let (Some(name), Some(template)) =
                        (item.get("name").and_then(Value::as_str), item.get("template").and_then(Value::as_str))
                    else {
                        return Err(ChatTemplateError::config(
                            path,
                            "chat_template list entries need `name` and `template`",
                        ));
                    };
                    if name == "default" {
                        self.default = Some(template.to_string());
                    } else {
                        self.named.insert(name.to_string(), template.to_string());
                    }
                }
            }
            _ => return Err(ChatTemplateError::config(path, "chat_template must be a string or a list")),
        }
        Ok(())
    }
}

/// A special token written as a string or as an AddedToken `{"content": …}`.
fn special_token(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

fn read_text(path: &Path) -> Result<Option<String>, ChatTemplateError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ChatTemplateError::io(path, e)),
    }
}

fn read_json(path: &Path) -> Result<Option<Value>, ChatTemplateError> {
    match read_text(path)? {
        None => Ok(None),
        Some(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| ChatTemplateError::config(path, format!("invalid JSON: {e}"))),
    }
}
