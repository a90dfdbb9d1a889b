//! Tokenizers: HF tokenizer.json or a GGUF vocab, and incremental detokenization.
//!
//! [`Tokenizer`] wraps a Hugging Face `tokenizers::Tokenizer`, loaded from a `tokenizer.json`
//! (with its sibling `tokenizer_config.json` / `generation_config.json`) or assembled from a
//! GGUF file's `tokenizer.ggml.*` metadata so that both paths encode and decode through the
//! same code. On top of it sit the model's special tokens: the BOS we add (once) on request,
//! and the set of ids that end generation.
//!
//! [`IncrementalDecoder`] turns a stream of generated ids into a stream of text deltas, and
//! [`Tokenizer::token_bytes`] gives the raw bytes of every token (for grammar-constrained
//! decoding).

mod config;
mod gguf_vocab;
mod incremental;
mod pretokenize;
mod spm;
mod token_bytes;

use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

pub use incremental::IncrementalDecoder;
pub use token_bytes::SPECIAL_TOKEN_MARKER;

use crate::error::LoadError;
use crate::gguf::GgufFile;
use config::{generation_eos_ids, template_tokens, TokenizerConfig};

/// A tokenizer failed on an input (load-time failures are [`LoadError`]s naming the file).
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer: {what} failed: {message}")]
    Failed { what: &'static str, message: String },
    #[error("tokenizer: {what} panicked inside the tokenizers library")]
    Panicked { what: &'static str },
}

impl From<TokenizerError> for LoadError {
    fn from(e: TokenizerError) -> Self {
        LoadError::Other(e.to_string())
    }
}

/// Texts of control tokens that end a turn (llama.cpp's end-of-generation list).
const END_OF_TURN: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
];

fn is_end_of_turn(text: &str) -> bool {
    END_OF_TURN.contains(&text)
}

/// The special-token facts a loader hands to [`Tokenizer::assemble`].
struct SpecialTokens {
    bos: Option<(u32, String)>,
    eos: Option<(u32, String)>,
    add_bos: bool,
    add_eos: bool,
    /// Ids skipped by `decode(.., skip_special_tokens = true)`.
    special_ids: Vec<u32>,
    /// End-of-generation ids besides EOS.
    end_ids: Vec<u32>,
}

/// A model's tokenizer: text to ids and back, plus its special tokens.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<(u32, String)>,
    eos: Option<(u32, String)>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    special: HashSet<u32>,
    vocab_size: usize,
    /// Each id's bytes when decoding concatenates them (`token_bytes::concatenating_pieces`).
    pieces: Option<Vec<Box<[u8]>>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .finish_non_exhaustive()
    }
}

/// Run a call into the tokenizers library, turning its errors and panics into ours.
fn guarded<T>(what: &'static str, f: impl FnOnce() -> tokenizers::Result<T>) -> Result<T, TokenizerError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(TokenizerError::Failed { what, message: e.to_string() }),
        Err(_) => Err(TokenizerError::Panicked { what }),
    }
}

impl Tokenizer {
    /// Load a `tokenizer.json`. A sibling `tokenizer_config.json` (if present) says whether
    /// to add BOS and names BOS/EOS; a sibling `generation_config.json` adds end ids.
    pub fn from_file(path: &Path) -> crate::Result<Tokenizer> {
        let bytes = std::fs::read(path).map_err(|e| LoadError::io(path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| LoadError::format(path, format!("not a valid tokenizer.json: {e}")))?;
        let dir = path.parent().unwrap_or_else(|| Path::new("."));
        let cfg = TokenizerConfig::read(dir)?;
        // What the post-processor puts around a sequence stands in for what the config leaves
        // unsaid (BERT's `[CLS] $A [SEP]` names neither BOS nor EOS), as transformers' fast
        // tokenizers add them.
        let template = inner
            .get_post_processor()
            .and_then(|pp| serde_json::to_value(pp).ok())
            .map(|v| template_tokens(&v))
            .unwrap_or_default();
        let bos_text = cfg.bos_token.clone().unwrap_or_else(|| template.leading.clone());
        let add_bos = cfg.add_bos_token.unwrap_or(template.leading.is_some() && template.leading == bos_text);
        let eos_text = cfg.eos_token.clone().unwrap_or_else(|| template.trailing.clone());
        let add_eos = cfg.add_eos_token.unwrap_or(template.trailing.is_some() && template.trailing == eos_text);
        let lookup = |t: Option<String>| t.and_then(|t| inner.token_to_id(&t).map(|id| (id, t)));
        let bos = lookup(bos_text);
        let eos = lookup(eos_text);
        let added = inner.get_added_tokens_decoder();
        let mut special_ids: Vec<u32> = added.iter().filter(|(_, t)| t.special).map(|(id, _)| *id).collect();
        special_ids.sort_unstable();
        let mut end_ids: Vec<u32> = special_ids
            .iter()
            .copied()
            .filter(|id| added.get(id).is_some_and(|t| is_end_of_turn(&t.content)))
            .collect();
        end_ids.extend(generation_eos_ids(dir)?);
        let vocab_size = added.keys().map(|&id| id as usize + 1).max().unwrap_or(0).max(inner.get_vocab_size(true));
        let special = SpecialTokens { bos, eos, add_bos, add_eos, special_ids, end_ids };
        Tokenizer::assemble(inner, special, vocab_size).map_err(|e| LoadError::format(path, e))
    }

    /// Build the tokenizer described by a GGUF file's vocab metadata.
    pub fn from_gguf(g: &GgufFile) -> crate::Result<Tokenizer> {
        gguf_vocab::from_gguf(g)
    }

    fn assemble(mut inner: tokenizers::Tokenizer, s: SpecialTokens, vocab_size: usize) -> Result<Tokenizer, String> {
        // A tokenizer.json may carry truncation or padding settings; a prompt must never be
        // cut or padded behind the caller's back.
        inner.with_truncation(None).map_err(|e| e.to_string())?;
        inner.with_padding(None);
        // gpt-oss (harmony): `<|end|>` closes a message but not the generation.
        let harmony = inner.token_to_id("<|return|>").is_some() && inner.token_to_id("<|call|>").is_some();
        let end_tag = if harmony { inner.token_to_id("<|end|>") } else { None };
        let mut eos_ids = Vec::new();
        for id in s.eos.iter().map(|(id, _)| *id).chain(s.end_ids) {
            if !eos_ids.contains(&id) && Some(id) != end_tag {
                eos_ids.push(id);
            }
        }
        let pieces = token_bytes::concatenating_pieces(&inner, vocab_size);
        Ok(Tokenizer {
            inner,
            pieces,
            add_bos: s.add_bos && s.bos.is_some(),
            add_eos: s.add_eos && s.eos.is_some(),
            bos: s.bos,
            eos: s.eos,
            eos_ids,
            special: s.special_ids.into_iter().collect(),
            vocab_size,
        })
    }

    /// Token ids for `text`. Special tokens written in the text (`<|im_start|>`) become their
    /// single ids. With `add_special_tokens`, BOS is put first when the model adds it (and the
    /// text does not already start with it), and EOS last when the model adds that.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let ids = guarded("encode", || self.inner.encode_fast(text, false))?.get_ids().to_vec();
        Ok(if add_special_tokens { self.with_special_tokens(ids) } else { ids })
    }

    /// `encode(text, true)` cut to at most `max_tokens` ids as transformers truncates: the
    /// text's tokens are cut so that they and the special tokens added around them fit.
    pub fn encode_truncated(&self, text: &str, max_tokens: usize) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = guarded("encode", || self.inner.encode_fast(text, false))?.get_ids().to_vec();
        let added = usize::from(self.add_bos) + usize::from(self.add_eos);
        ids.truncate(max_tokens.saturating_sub(added));
        Ok(self.with_special_tokens(ids))
    }

    /// BOS first when the model adds it (and `ids` do not already start with it), EOS last
    /// when it adds that.
    fn with_special_tokens(&self, mut ids: Vec<u32>) -> Vec<u32> {
        if let (true, Some((bos, _))) = (self.add_bos, &self.bos) {
            if ids.first() != Some(bos) {
                ids.insert(0, *bos);
            }
        }
        if let (true, Some((eos, _))) = (self.add_eos, &self.eos) {
            if ids.last() != Some(eos) {
                ids.push(*eos);
            }
        }
        ids
    }

    /// The text of `ids`. Ids outside the vocab are skipped; invalid UTF-8 (a byte sequence
    /// cut short) comes out as U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        guarded("decode", || self.inner.decode(ids, skip_special_tokens))
    }

    /// The id of a vocab piece, as stored (byte-level or `▁`-escaped), or of an added token.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The bytes `id` decodes to, when this tokenizer's decode of any ids is the
    /// concatenation of theirs (byte-level vocabs); `None` for other tokenizers. Ids outside
    /// the vocab have none.
    pub fn piece_bytes(&self, id: u32) -> Option<&[u8]> {
        self.pieces.as_ref().map(|p| p.get(id as usize).map_or(&[][..], |b| &b[..]))
    }

    /// The vocab piece of `id`, as stored (byte-level or `▁`-escaped).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// One past the largest id this tokenizer knows.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos.as_ref().map(|(id, _)| *id)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos.as_ref().map(|(_, t)| t.as_str())
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos.as_ref().map(|(id, _)| *id)
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos.as_ref().map(|(_, t)| t.as_str())
    }

    /// The ids that end generation: EOS first, then end-of-turn control tokens
    /// (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...) and any the caller added.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Add end-of-generation ids (say, from a model's `generation_config.json`).
    pub fn extend_eos_token_ids(&mut self, ids: impl IntoIterator<Item = u32>) {
        for id in ids {
            if !self.eos_ids.contains(&id) {
                self.eos_ids.push(id);
            }
        }
    }

    /// Whether `encode(.., add_special_tokens = true)` puts BOS first.
    pub fn add_bos_token(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special_tokens = true)` puts EOS last.
    pub fn add_eos_token(&self) -> bool {
        self.add_eos
    }

    /// A special (control) token: skipped by `decode(.., skip_special_tokens = true)`.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }

    /// The underlying Hugging Face tokenizer.
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
