//! Building a tokenizer from a GGUF file's vocab metadata (`tokenizer.ggml.*`).
//!
//! The GGUF stores the pieces, their types and either BPE merges (`gpt2`: byte-level BPE, the
//! pre-tokenizer named by `tokenizer.ggml.pre`) or SentencePiece scores (`llama`: BPE over
//! `▁`-escaped text with `<0xNN>` byte fallback). We assemble the equivalent Hugging Face
//! tokenizer (model, normalizer, pre-tokenizer, decoder, added tokens) so that encoding and
//! decoding go through the same code as a `tokenizer.json`.

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::pretokenize::{spec_for, PreTokenizerSpec};
use super::spm::merges_from_scores;
use super::{SpecialTokens, Tokenizer};
use crate::error::{LoadError, Result};
use crate::gguf::{GgufFile, GgufValue};

/// GGUF token types (`tokenizer.ggml.token_type`), as llama.cpp and gguf-py define them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_gguf(v: i64) -> TokenType {
        match v {
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Normal,
        }
    }
}

/// The vocab metadata of one GGUF file.
struct GgufVocab<'a> {
    g: &'a GgufFile,
    tokens: Vec<String>,
    types: Vec<TokenType>,
}

impl<'a> GgufVocab<'a> {
    fn read(g: &'a GgufFile) -> Result<Self> {
        let tokens = string_array(g, "tokenizer.ggml.tokens")?
            .ok_or_else(|| LoadError::format(g.path(), "metadata key tokenizer.ggml.tokens is missing"))?;
        if tokens.is_empty() || tokens.len() > u32::MAX as usize {
            return Err(LoadError::format(g.path(), format!("tokenizer.ggml.tokens has {} entries", tokens.len())));
        }
        let types = match g.get("tokenizer.ggml.token_type") {
            None => vec![TokenType::Normal; tokens.len()],
            Some(v) => {
                let arr = array(g, "tokenizer.ggml.token_type", v, tokens.len())?;
                arr.iter()
                    .map(|t| t.as_i64().map(TokenType::from_gguf))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| LoadError::format(g.path(), "tokenizer.ggml.token_type holds a non-integer"))?
            }
        };
        Ok(GgufVocab { g, tokens, types })
    }

    /// A token id from metadata, if present and inside the vocab.
    fn id(&self, key: &str) -> Option<u32> {
        self.g.get_u64(key).filter(|&id| (id as usize) < self.tokens.len()).map(|id| id as u32)
    }

    fn flag(&self, key: &str) -> Option<bool> {
        self.g.get(key).and_then(|v| v.as_bool())
    }

    fn vocab_map(&self) -> Vocab {
        // Later duplicates win, as in llama.cpp's `token_to_id`.
        self.tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect()
    }

    /// Control, unknown and user-defined pieces, matched in the text before the model runs.
    fn added_tokens(&self) -> Vec<AddedToken> {
        self.tokens
            .iter()
            .zip(&self.types)
            .filter_map(|(t, ty)| match ty {
                TokenType::Control | TokenType::Unknown => Some(AddedToken::from(t.clone(), true).normalized(false)),
                TokenType::UserDefined => Some(AddedToken::from(t.clone(), false).normalized(false)),
                _ => None,
            })
            .collect()
    }

    fn special_ids(&self) -> Vec<u32> {
        (0..self.tokens.len())
            .filter(|&i| matches!(self.types[i], TokenType::Control | TokenType::Unknown))
            .map(|i| i as u32)
            .collect()
    }
}

fn array<'v>(g: &GgufFile, key: &str, v: &'v GgufValue, len: usize) -> Result<&'v [GgufValue]> {
    let arr = v.as_array().ok_or_else(|| LoadError::format(g.path(), format!("{key} is not an array")))?;
    if arr.len() != len {
        return Err(LoadError::format(
            g.path(),
            format!("{key} has {} entries but tokenizer.ggml.tokens has {len}", arr.len()),
        ));
    }
    Ok(arr)
}

fn string_array(g: &GgufFile, key: &str) -> Result<Option<Vec<String>>> {
    let Some(v) = g.get(key) else { return Ok(None) };
    let arr = v.as_array().ok_or_else(|| LoadError::format(g.path(), format!("{key} is not an array")))?;
    arr.iter()
        .map(|s| s.as_str().map(str::to_string))
        .collect::<Option<Vec<_>>>()
        .map(Some)
        .ok_or_else(|| LoadError::format(g.path(), format!("{key} holds a non-string")))
}

fn hf_err(g: &GgufFile, what: &str, e: impl std::fmt::Display) -> LoadError {
    LoadError::format(g.path(), format!("building the tokenizer ({what}): {e}"))
}

/// Parse `"left right"` merges, keeping only those whose parts and result are in the vocab.
fn parse_merges(raw: &[String], vocab: &Vocab) -> Vec<(String, String)> {
    raw.iter()
        .filter_map(|m| {
            // The left part may itself start with a space-like piece; split at the first
            // space after the first character, as llama.cpp does.
            let first_len = m.chars().next()?.len_utf8();
            let pos = m[first_len..].find(' ')? + first_len;
            let (l, r) = (&m[..pos], &m[pos + 1..]);
            let merged = format!("{l}{r}");
            (vocab.contains_key(l) && vocab.contains_key(r) && vocab.contains_key(&merged))
                .then(|| (l.to_string(), r.to_string()))
        })
        .collect()
}

/// Build the tokenizer for a GGUF file's vocab.
pub(super) fn from_gguf(g: &GgufFile) -> Result<Tokenizer> {
    let model = g
        .get_str("tokenizer.ggml.model")
        .ok_or_else(|| LoadError::format(g.path(), "metadata key tokenizer.ggml.model is missing"))?;
    let vocab = GgufVocab::read(g)?;
    let (inner, default_add_bos) = match model {
        "gpt2" => {
            let spec = spec_for(g.get_str("tokenizer.ggml.pre")).map_err(|e| LoadError::format(g.path(), e))?;
            (byte_level_bpe(&vocab, &spec)?, spec.default_add_bos)
        }
        "llama" => (sentencepiece_bpe(&vocab)?, true),
        "gemma4" => (gemma4_bpe(&vocab)?, true),
        other => {
            return Err(LoadError::format(
                g.path(),
                format!("tokenizer.ggml.model = {other:?} is not supported (gpt2, llama and gemma4 are)"),
            ))
        }
    };
    let bos = vocab.id("tokenizer.ggml.bos_token_id");
    let eos = vocab.id("tokenizer.ggml.eos_token_id");
    let mut add_bos = vocab.flag("tokenizer.ggml.add_bos_token").unwrap_or(default_add_bos);
    if model == "gemma4" {
        add_bos = true; // as llama.cpp: Gemma 4 GGUFs say false but the model needs BOS
    }
    let add_eos = vocab.flag("tokenizer.ggml.add_eos_token").unwrap_or(false);
    let mut end_ids: Vec<u32> =
        ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"].iter().filter_map(|k| vocab.id(k)).collect();
    end_ids.extend(vocab.special_ids().into_iter().filter(|&id| super::is_end_of_turn(&vocab.tokens[id as usize])));
    let special = SpecialTokens {
        bos: bos.map(|id| (id, vocab.tokens[id as usize].clone())),
        eos: eos.map(|id| (id, vocab.tokens[id as usize].clone())),
        add_bos,
        add_eos,
        special_ids: vocab.special_ids(),
        end_ids,
    };
    Tokenizer::assemble(inner, special, vocab.tokens.len())
        .map_err(|e| LoadError::format(g.path(), format!("building the tokenizer: {e}")))
}

fn split(g: &GgufFile, re: &str) -> Result<PreTokenizerWrapper> {
    Split::new(SplitPattern::Regex(re.to_string()), SplitDelimiterBehavior::Isolated, false)
        .map(PreTokenizerWrapper::Split)
        .map_err(|e| hf_err(g, "split regex", e))
}

fn with_added_tokens(mut t: tokenizers::Tokenizer, vocab: &GgufVocab) -> tokenizers::Tokenizer {
    t.add_tokens(&vocab.added_tokens());
    t
}

/// GPT-2-style byte-level BPE with merges (`tokenizer.ggml.model = gpt2`).
fn byte_level_bpe(vocab: &GgufVocab, spec: &PreTokenizerSpec) -> Result<tokenizers::Tokenizer> {
    let g = vocab.g;
    let map = vocab.vocab_map();
    let raw_merges = string_array(g, "tokenizer.ggml.merges")?
        .ok_or_else(|| LoadError::format(g.path(), "metadata key tokenizer.ggml.merges is missing"))?;
    let merges = parse_merges(&raw_merges, &map);
    let bpe = BPE::builder()
        .vocab_and_merges(map, merges)
        .ignore_merges(spec.ignore_merges)
        .build()
        .map_err(|e| hf_err(g, "BPE model", e))?;
    let mut pre = spec.regexes.iter().map(|re| split(g, re)).collect::<Result<Vec<_>>>()?;
    pre.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)));
    let mut t = tokenizers::Tokenizer::new(bpe);
    if spec.nfc {
        t.with_normalizer(Some(NormalizerWrapper::NFC(NFC)));
    }
    t.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(PreTokenizerSequence::new(pre))));
    t.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::new(false, false, false))));
    Ok(with_added_tokens(t, vocab))
}

fn unk_token(vocab: &GgufVocab) -> Option<String> {
    vocab
        .id("tokenizer.ggml.unknown_token_id")
        .map(|id| id as usize)
        .or_else(|| vocab.types.iter().position(|t| *t == TokenType::Unknown))
        .map(|id| vocab.tokens[id].clone())
}

fn replace(g: &GgufFile, from: &str, to: &str) -> Result<Replace> {
    Replace::new(from, to).map_err(|e| hf_err(g, "replace", e))
}

/// The SentencePiece decoder: `▁` back to space, `<0xNN>` pieces to bytes, and (when the
/// encoder prepends a space) the first leading space dropped.
fn spm_decoder(g: &GgufFile, strip_prefix: bool) -> Result<DecoderWrapper> {
    let mut decoders = vec![
        DecoderWrapper::Replace(replace(g, "▁", " ")?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if strip_prefix {
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    Ok(DecoderWrapper::Sequence(DecoderSequence::new(decoders)))
}

/// SentencePiece BPE (`tokenizer.ggml.model = llama`): merges derived from the scores.
fn sentencepiece_bpe(vocab: &GgufVocab) -> Result<tokenizers::Tokenizer> {
    let g = vocab.g;
    let scores: Vec<f32> = match g.get("tokenizer.ggml.scores") {
        None => vec![0.0; vocab.tokens.len()],
        Some(v) => array(g, "tokenizer.ggml.scores", v, vocab.tokens.len())?
            .iter()
            .map(|s| s.as_f64().map(|f| f as f32))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| LoadError::format(g.path(), "tokenizer.ggml.scores holds a non-number"))?,
    };
    let merges = merges_from_scores(&vocab.tokens, &scores, |i| vocab.types[i] == TokenType::Normal);
    let add_space_prefix = vocab.flag("tokenizer.ggml.add_space_prefix").unwrap_or(true);
    let mut builder = BPE::builder().vocab_and_merges(vocab.vocab_map(), merges).fuse_unk(true).byte_fallback(true);
    if let Some(unk) = unk_token(vocab) {
        builder = builder.unk_token(unk);
    }
    let bpe = builder.build().map_err(|e| hf_err(g, "BPE model", e))?;
    let mut t = tokenizers::Tokenizer::new(bpe);
    let space = NormalizerWrapper::Replace(replace(g, " ", "▁")?);
    let normalizer = if add_space_prefix {
        NormalizerWrapper::Sequence(NormalizerSequence::new(vec![
            NormalizerWrapper::Prepend(Prepend::new("▁".to_string())),
            space,
        ]))
    } else {
        space
    };
    t.with_normalizer(Some(normalizer));
    t.with_decoder(Some(spm_decoder(g, add_space_prefix)?));
    Ok(with_added_tokens(t, vocab))
}

/// Gemma 4 (`tokenizer.ggml.model = gemma4`): BPE with merges over `▁`-escaped raw UTF-8,
/// split only at newline runs, with `<0xNN>` byte fallback and no space prefix.
fn gemma4_bpe(vocab: &GgufVocab) -> Result<tokenizers::Tokenizer> {
    let g = vocab.g;
    let map = vocab.vocab_map();
    let raw_merges = string_array(g, "tokenizer.ggml.merges")?
        .ok_or_else(|| LoadError::format(g.path(), "metadata key tokenizer.ggml.merges is missing"))?;
    let merges = parse_merges(&raw_merges, &map);
    let mut builder = BPE::builder().vocab_and_merges(map, merges).fuse_unk(true).byte_fallback(true);
    if let Some(unk) = unk_token(vocab) {
        builder = builder.unk_token(unk);
    }
    let bpe = builder.build().map_err(|e| hf_err(g, "BPE model", e))?;
    let mut t = tokenizers::Tokenizer::new(bpe);
    t.with_normalizer(Some(NormalizerWrapper::Replace(replace(g, " ", "▁")?)));
    t.with_pre_tokenizer(Some(split(g, r"[^\n]+|[\n]+")?));
    t.with_decoder(Some(spm_decoder(g, false)?));
    Ok(with_added_tokens(t, vocab))
}
