//! Streaming detokenization: generated ids in, text deltas out.
//!
//! A token's text depends on its neighbours: a SentencePiece `▁word` piece decodes to
//! `" word"` mid-text but `"word"` at the start (the decoder drops the leading space), and a
//! character split over byte-fallback or byte-level tokens is invalid UTF-8 until its last
//! byte arrives. So, as Hugging Face TGI and vLLM do, we decode a short window of recent ids
//! twice — without and with the new ones — and emit the difference, holding it back while
//! the window's text ends in U+FFFD (an incomplete character).
//!
//! Concatenating every `push` result and `finish` gives `decode(all ids)` whenever that
//! text is valid (holds no U+FFFD). For byte-level (GPT-2-style) vocabs it holds for any id
//! sequence; a SentencePiece byte run that is invalid UTF-8 may stream out differently than
//! the batch decode (which replaces the whole run), never as a panic.

use super::{Tokenizer, TokenizerError};

const REPLACEMENT: char = '\u{FFFD}';

/// How many prompt ids seed the window (`with_prompt`), as in vLLM.
const PROMPT_CONTEXT: usize = 5;

/// Past this many pending ids, text ending in U+FFFD is emitted anyway (no character needs
/// more tokens; a run of invalid bytes must not make every push slower), and pending ids
/// that add no text at all (skipped special tokens) leave the window.
const MAX_PENDING: usize = 32;

/// Text deltas for a stream of generated token ids.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    /// The window decoded on every push: the ids of the last emission (context only), then
    /// the ids not yet emitted.
    ids: Vec<u32>,
    /// How many ids of the window have been emitted.
    read: usize,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    /// A decoder for a stream that starts at the beginning of the text.
    pub fn new(skip_special_tokens: bool) -> Self {
        IncrementalDecoder { ids: Vec::new(), read: 0, skip_special_tokens }
    }

    /// A decoder for ids generated after `prompt_ids`: the prompt's last few ids give the
    /// first generated token its context (its leading space), and are never emitted.
    pub fn with_prompt(prompt_ids: &[u32], skip_special_tokens: bool) -> Self {
        let tail = &prompt_ids[prompt_ids.len().saturating_sub(PROMPT_CONTEXT)..];
        IncrementalDecoder { ids: tail.to_vec(), read: tail.len(), skip_special_tokens }
    }

    /// Feed one generated id; returns the text it completes (often empty while a character
    /// is incomplete, or when the id decodes to nothing).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let (done, full) = self.texts(tok)?;
        let many = self.ids.len() - self.read > MAX_PENDING;
        if many && full == done {
            self.ids.truncate(self.read);
            return Ok(String::new());
        }
        if full.len() <= done.len() || (full.ends_with(REPLACEMENT) && !many) {
            return Ok(String::new());
        }
        let delta = self.delta(tok, &done, &full)?;
        self.advance();
        Ok(delta)
    }

    /// The text still held back (an incomplete character at the end of the stream comes out
    /// as U+FFFD). The decoder stays usable: later pushes continue the same text.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let (done, full) = self.texts(tok)?;
        let delta = self.delta(tok, &done, &full)?;
        self.advance();
        Ok(delta)
    }

    /// What the pending ids add to the text. The window's text normally extends the
    /// emitted part; it does not when a SentencePiece byte run turned out invalid (the
    /// decoder then replaces the whole run, emitted bytes included): the pending ids are
    /// decoded on their own instead.
    fn delta(&self, tok: &Tokenizer, done: &str, full: &str) -> Result<String, TokenizerError> {
        match delta(done, full) {
            Some(d) => Ok(d),
            None => tok.decode(&self.ids[self.read..], self.skip_special_tokens),
        }
    }

    /// The window's text without and with the ids not yet emitted.
    fn texts(&self, tok: &Tokenizer) -> Result<(String, String), TokenizerError> {
        let done = tok.decode(&self.ids[..self.read], self.skip_special_tokens)?;
        let full = tok.decode(&self.ids, self.skip_special_tokens)?;
        Ok((done, full))
    }

    /// Everything up to the end has been emitted: the ids of this emission become the
    /// context for the next one, earlier ids are dropped.
    fn advance(&mut self) {
        self.ids.drain(..self.read);
        self.read = self.ids.len();
    }
}

/// The text `full` adds after `done`, or `None` when `done` is not a prefix of `full`.
fn delta(done: &str, full: &str) -> Option<String> {
    full.strip_prefix(done).map(str::to_string)
}
