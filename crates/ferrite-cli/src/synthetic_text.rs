//! The tokenizer and chat template a synthetic model borrows from its family, so that
//! `serve --synthetic NAME` answers text and `bench serve` can run against it.
//!
//! A synthetic model's weights are random, but its vocabulary size is its family's: the Llama
//! 3 shapes take the Llama 3 tokenizer, `qwen2.5-1.5b`, `qwen3-30b-a3b`, `qwen3-4b` and `qwen3.5-4b` Qwen2's
//! (Qwen3 kept it; Qwen3.5's own is not among the assets), `gemma-4-e4b` and `gemma-4-26b-a4b` Gemma 4's (the vocabulary-only GGUF files
//! `scripts/fetch_test_assets.sh` fetches into the test assets, with the family's chat
//! template from the same place), and `smollm2-135m` SmolLM2's own GGUF (the default model). `--tokenizer PATH` names another HF directory or GGUF file.
//! Without the files a synthetic model runs on token ids alone, as before, and says so.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ferrite_models::chat_template::ChatTemplate;
use ferrite_models::paths::{models_dir, test_assets_dir};
use ferrite_models::tokenizer::Tokenizer;
use ferrite_models::LoadedModel;
use std::sync::Arc;

/// Where the text of synthetic model `name` comes from by default: a model file and, when
/// the file carries no chat template, a template file.
fn default_sources(name: &str) -> Option<(PathBuf, Option<PathBuf>)> {
    let assets = test_assets_dir().join("llama.cpp-models");
    let vocab = |file: &str, template: &str| Some((assets.join(file), Some(assets.join("templates").join(template))));
    match name {
        "llama-3.1-8b" => vocab("ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
        "llama-3.2-1b" => vocab("ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.2-3B-Instruct.jinja"),
        // Qwen3 keeps Qwen2's vocabulary; Qwen3.5's larger one is not among the assets, and
        // Qwen2's ids fit inside it.
        "qwen2.5-1.5b" | "qwen3-30b-a3b" | "qwen3-4b" | "qwen3.5-4b" => {
            vocab("ggml-vocab-qwen2.gguf", "Qwen-Qwen2.5-7B-Instruct.jinja")
        }
        "gemma-4-e4b" | "gemma-4-26b-a4b" => vocab("ggml-vocab-gemma-4.gguf", "google-gemma-4-31B-it.jinja"),
        "smollm2-135m" => {
            let m = ferrite_models::registry::find("smollm2")?;
            Some((models_dir().join(m.name).join(m.file_name), None))
        }
        _ => None,
    }
}

/// A synthetic model's text: its tokenizer, its chat template and the file they came from.
struct SyntheticText {
    tokenizer: Arc<Tokenizer>,
    chat_template: Option<ChatTemplate>,
    from: PathBuf,
}

/// Give `loaded` (synthetic model `name`) a tokenizer and chat template: from `given`, or
/// from the family's files when they are here. A tokenizer with more ids than the model's
/// vocabulary is an error; missing default files are a note.
pub fn attach(loaded: &mut LoadedModel, name: &str, given: Option<&Path>) -> Result<()> {
    if let Some(text) = text_of(name, given, loaded.model.config().vocab_size)? {
        eprintln!("synthetic {name}: tokenizer and chat template of {}", text.from.display());
        loaded.tokenizer = Some(text.tokenizer);
        loaded.chat_template = text.chat_template;
    }
    Ok(())
}

fn text_of(name: &str, given: Option<&Path>, vocab: usize) -> Result<Option<SyntheticText>> {
    let (model_file, template_file) = match given {
        Some(p) => (p.to_path_buf(), None),
        None => match default_sources(name) {
            Some((m, t)) if m.is_file() && t.as_ref().is_none_or(|t| t.is_file()) => (m, t),
            Some((m, _)) => {
                eprintln!(
                    "note: synthetic {name} has no tokenizer ({} is not here; scripts/fetch_test_assets.sh \
                     fetches it): it takes token ids only",
                    m.display()
                );
                return Ok(None);
            }
            None => return Ok(None),
        },
    };
    let text = ferrite_models::load_text(&model_file)
        .with_context(|| format!("the tokenizer of synthetic {name} from {}", model_file.display()))?;
    let Some(tokenizer) = text.tokenizer else { bail!("{} holds no tokenizer", model_file.display()) };
    if tokenizer.vocab_size() > vocab {
        bail!(
            "the tokenizer in {} has {} ids, more than synthetic {name}'s vocabulary of {vocab}",
            model_file.display(),
            tokenizer.vocab_size()
        );
    }
    let chat_template = match template_file {
        Some(t) => {
            let src = std::fs::read_to_string(&t).with_context(|| format!("cannot read {}", t.display()))?;
            let bos = tokenizer.bos_token().map(String::from);
            let eos = tokenizer.eos_token().map(String::from);
            Some(ChatTemplate::new(&src, bos, eos).with_context(|| format!("chat template {}", t.display()))?)
        }
        None => text.chat_template,
    };
    Ok(Some(SyntheticText { tokenizer, chat_template, from: model_file }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrite_models::chat_template::ChatRenderRequest;
    use ferrite_models::gpu::{synthetic_config, SYNTHETIC_MODELS};

    /// Every synthetic shape whose family files are here gets a tokenizer that fits its
    /// vocabulary and a chat template that renders a conversation it can encode.
    #[test]
    fn every_synthetic_shape_takes_its_family_text() {
        for name in SYNTHETIC_MODELS {
            let vocab = synthetic_config(name).and_then(|c| c["vocab_size"].as_u64()).unwrap() as usize;
            let Some(text) = text_of(name, None, vocab).unwrap() else {
                eprintln!("skipping {name}: its tokenizer file is not here");
                continue;
            };
            let template = text.chat_template.unwrap_or_else(|| panic!("{name}: no chat template"));
            let messages = [serde_json::json!({"role": "user", "content": "What is the capital of France?"})];
            let prompt = template.render(&ChatRenderRequest::new(&messages)).unwrap();
            assert!(prompt.contains("What is the capital of France?"), "{name}: {prompt}");
            let ids = text.tokenizer.encode(&prompt, false).unwrap();
            assert!(ids.len() > 5 && ids.iter().all(|&i| (i as usize) < vocab), "{name}: {ids:?}");
            let words = text.tokenizer.encode(" capital of France", false).unwrap();
            assert!(words.len() <= 4, "{name}: a real vocabulary has whole words: {words:?}");
        }
    }

    #[test]
    fn a_tokenizer_larger_than_the_vocabulary_is_refused() {
        let Some((file, _)) = default_sources("llama-3.2-1b").filter(|(f, _)| f.is_file()) else { return };
        let err = text_of("llama-3.2-1b", Some(&file), 1000).err().unwrap().to_string();
        assert!(err.contains("more than synthetic llama-3.2-1b's vocabulary of 1000"), "{err}");
    }
}
