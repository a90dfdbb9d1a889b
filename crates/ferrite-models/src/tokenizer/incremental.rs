//! Streaming detokenization: generated ids in, text deltas out.
//!
//! A token's text depends on its neighbours: a SentencePiece `▁word` piece decodes to
//! `" word"` mid-text but `"word"` at the start (the decoder drops the leading space), and a
//! character split over byte-fallback or byte-level tokens is invalid UTF-8 until its last
//! byte arrives. So, as Hugging Face TGI and vLLM do, we decode a short window of recent ids
//! twice — without and with the new ones — and emit the difference, holding it back while
//! the window's text ends in U+FFFD (an incomplete character).
//!
//! A stream that continues a prompt ([`IncrementalDecoder::with_prompt`]) starts with the
//! prompt's last ids as its window, so the first generated token is decoded in context (a
//! `▁word` keeps its space). Then `decode(prompt) + every push and finish` equals
//! `decode(prompt + generated)` whenever that text is valid (holds no U+FFFD). A prompt that
//! ends inside a character (a token-id prompt cut mid-way) has no text for that character;
//! the stream then starts with the whole character, after the prompt's text without it: for
//! byte-level vocabs `decode(prompt)` without its trailing U+FFFD, for byte-fallback
//! (SentencePiece) vocabs the decode of the prompt without the character's byte pieces
//! (whose decoder turns a whole run of byte pieces into U+FFFD when its end is cut). For
//! byte-level (GPT-2-style) vocabs all this holds for any id sequence; a SentencePiece byte
//! run that is invalid UTF-8 may stream out differently than the batch decode (which
//! replaces the whole run), never as a panic.
//!
//! A byte-level vocab's decode is the concatenation of its ids' bytes read as UTF-8
//! (`Tokenizer::piece_bytes`), so there no window is decoded at all: a push appends its id's
//! bytes and emits the complete characters (two window decodes a token were most of the
//! engine's own time per step at 256 rows).

use super::token_bytes::fallback_byte;
use super::{Tokenizer, TokenizerError};

const REPLACEMENT: char = '\u{FFFD}';

/// How many text-bearing prompt ids seed the window (`with_prompt`), as in vLLM.
const PROMPT_CONTEXT: usize = 5;

/// How many of the prompt's last pieces a byte-level stream looks back over for bytes after
/// its last character (`with_prompt`).
const PROMPT_BYTE_PIECES: usize = 16;

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
    /// The context is the prompt's tail, whose text may end in an incomplete character
    /// that the stream has not emitted (its U+FFFD is not part of the output).
    prompt_context: bool,
    skip_special_tokens: bool,
    /// A byte-level vocab's stream, which uses no window.
    bytes: ByteStream,
}

impl IncrementalDecoder {
    /// A decoder for a stream that starts at the beginning of the text.
    pub fn new(skip_special_tokens: bool) -> Self {
        IncrementalDecoder {
            ids: Vec::new(),
            read: 0,
            prompt_context: false,
            skip_special_tokens,
            bytes: ByteStream::default(),
        }
    }

    /// A decoder for ids generated after `prompt_ids`. The prompt's last ids — the last
    /// `PROMPT_CONTEXT` that decode to text (with any skipped special tokens among and after
    /// them), from the first byte of the character they start in — give the first generated
    /// token its context, and are never emitted.
    pub fn with_prompt(tok: &Tokenizer, prompt_ids: &[u32], skip_special_tokens: bool) -> Self {
        if tok.piece_bytes(0).is_some() {
            // Byte-level: the context is only the bytes after the prompt's last character.
            let texts = prompt_ids.iter().rev().filter(|&&id| !(skip_special_tokens && tok.is_special(id)));
            let mut tail: Vec<&[u8]> = texts
                .filter_map(|&id| tok.piece_bytes(id))
                .filter(|b| !b.is_empty())
                .take(PROMPT_BYTE_PIECES)
                .collect();
            tail.reverse();
            let tail = tail.concat();
            let mut dec = IncrementalDecoder::new(skip_special_tokens);
            dec.bytes = ByteStream::after_prompt(&tail[tail.len() - textless_tail(&tail)..]);
            return dec;
        }
        let mut start = prompt_ids.len();
        let mut texts = 0;
        while start > 0 && texts < PROMPT_CONTEXT {
            start -= 1;
            if !(skip_special_tokens && tok.is_special(prompt_ids[start])) {
                texts += 1;
            }
        }
        let tail = prompt_ids[char_start(tok, prompt_ids, start)..].to_vec();
        // The byte pieces of a character the prompt ends inside are not context: they stream
        // out with the rest of the character.
        let read = tail.len() - open_byte_pieces(tok, &tail);
        IncrementalDecoder { read, ids: tail, prompt_context: true, skip_special_tokens, bytes: ByteStream::default() }
    }

    /// Feed one generated id; returns the text it completes (often empty while a character
    /// is incomplete, or when the id decodes to nothing).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        if let Some(bytes) = tok.piece_bytes(id) {
            let skipped = self.skip_special_tokens && tok.is_special(id);
            return Ok(self.bytes.push(if skipped { &[] } else { bytes }));
        }
        self.ids.push(id);
        let (done, full) = self.texts(tok)?;
        let many = self.ids.len() - self.read > MAX_PENDING;
        let added = self.added(&done, &full);
        if many && added == Some("") {
            self.ids.truncate(self.read);
            return Ok(String::new());
        }
        if added == Some("") || (full.ends_with(REPLACEMENT) && !many) {
            return Ok(String::new());
        }
        let delta = match added {
            Some(d) => d.to_string(),
            None if full.len() <= done.len() => return Ok(String::new()),
            None => self.pending_alone(tok)?,
        };
        self.advance(tok);
        Ok(delta)
    }

    /// The text still held back (an incomplete character at the end of the stream comes out
    /// as U+FFFD). The decoder stays usable: later pushes continue the same text.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        if tok.piece_bytes(0).is_some() {
            return Ok(self.bytes.finish());
        }
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let (done, full) = self.texts(tok)?;
        let delta = match self.added(&done, &full) {
            Some(d) => d.to_string(),
            None => self.pending_alone(tok)?,
        };
        self.advance(tok);
        Ok(delta)
    }

    /// What the pending ids add to the emitted text `done`: the rest of the window's text
    /// `full`. When the context is the prompt's, its trailing U+FFFD (an incomplete
    /// character) may have become a whole character in `full`, which is then added in full.
    /// `None` when `full` does not extend `done` (a SentencePiece byte run turned out
    /// invalid: the decoder then replaces the whole run, emitted bytes included).
    fn added<'a>(&self, done: &str, full: &'a str) -> Option<&'a str> {
        full.strip_prefix(done).or_else(|| {
            let complete = done.trim_end_matches(REPLACEMENT);
            (self.prompt_context && complete.len() < done.len()).then(|| full.strip_prefix(complete)).flatten()
        })
    }

    /// The pending ids decoded on their own (when the window's text does not extend the
    /// emitted part).
    fn pending_alone(&self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        tok.decode(&self.ids[self.read..], self.skip_special_tokens)
    }

    /// The window's text without and with the ids not yet emitted.
    fn texts(&self, tok: &Tokenizer) -> Result<(String, String), TokenizerError> {
        let done = tok.decode(&self.ids[..self.read], self.skip_special_tokens)?;
        let full = tok.decode(&self.ids, self.skip_special_tokens)?;
        Ok((done, full))
    }

    /// Everything up to the end has been emitted: the ids of this emission (from the start of
    /// the character its first id belongs to) become the context for the next one, earlier
    /// ids are dropped.
    fn advance(&mut self, tok: &Tokenizer) {
        self.ids.drain(..char_start(tok, &self.ids, self.read));
        self.read = self.ids.len();
        self.prompt_context = false;
    }
}

/// A byte-level vocab's stream: a push appends its id's bytes and emits the complete
/// characters.
#[derive(Debug, Clone, Default)]
struct ByteStream {
    /// Bytes of a character not complete yet.
    pending: Vec<u8>,
    /// After a prompt that ends in bytes of no complete character: how many of them are still
    /// pending, and the text the prompt's decode wrote for them (U+FFFDs). If they turn out
    /// invalid, that text is the prompt's (not emitted again); if they complete a character,
    /// it streams whole. What is emitted is held until they are resolved.
    prompt: Option<(usize, String)>,
    held: String,
}

impl ByteStream {
    fn after_prompt(tail: &[u8]) -> ByteStream {
        let prompt = (!tail.is_empty()).then(|| (tail.len(), String::from_utf8_lossy(tail).into_owned()));
        ByteStream { pending: tail.to_vec(), prompt, held: String::new() }
    }

    fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let before = self.pending.len();
        let text = self.complete_characters();
        self.resolve(text, before - self.pending.len())
    }

    /// The text still held back (an incomplete character comes out as U+FFFD).
    fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&std::mem::take(&mut self.pending)).into_owned();
        self.resolve(text, usize::MAX)
    }

    /// `text`, emitted after `taken` more pending bytes were decoded: held while prompt bytes
    /// are pending, then without the prompt's own text for them where it still stands.
    fn resolve(&mut self, text: String, taken: usize) -> String {
        let Some((left, _)) = self.prompt.as_mut() else { return text };
        self.held.push_str(&text);
        *left = left.saturating_sub(taken);
        if *left > 0 {
            return String::new();
        }
        let (_, prompt_text) = self.prompt.take().unwrap_or_default();
        let held = std::mem::take(&mut self.held);
        match held.strip_prefix(&prompt_text) {
            Some(rest) => rest.to_string(),
            None => held,
        }
    }

    /// The complete characters of the pending bytes, taken out as text (an invalid sequence
    /// as U+FFFD, as a decode writes it); an incomplete last character stays pending.
    fn complete_characters(&mut self) -> String {
        let mut out = String::new();
        let mut rest = &self.pending[..];
        loop {
            match std::str::from_utf8(rest) {
                Ok(text) => {
                    out.push_str(text);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, tail) = rest.split_at(e.valid_up_to());
                    out.push_str(&String::from_utf8_lossy(valid));
                    match e.error_len() {
                        Some(n) => {
                            out.push(REPLACEMENT);
                            rest = &tail[n..];
                        }
                        None => {
                            rest = tail;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        self.pending.drain(..self.pending.len() - keep);
        out
    }
}

/// How many bytes at the end of `bytes` come after its last complete character: an
/// incomplete one, and invalid bytes (0 when `bytes` ends with a character).
fn textless_tail(bytes: &[u8]) -> usize {
    let (mut rest, mut after_text) = (bytes, 0);
    loop {
        match std::str::from_utf8(rest) {
            Ok(text) => {
                if !text.is_empty() {
                    after_text = bytes.len();
                }
                return bytes.len() - after_text;
            }
            Err(e) => {
                let at = bytes.len() - rest.len();
                if e.valid_up_to() > 0 {
                    after_text = at + e.valid_up_to();
                }
                match e.error_len() {
                    Some(n) => rest = &rest[e.valid_up_to() + n..],
                    None => return bytes.len() - after_text,
                }
            }
        }
    }
}

/// `start`, or the index up to three ids before it where the character that `ids[start]`
/// continues begins: a UTF-8 continuation byte never starts a character, and SentencePiece's
/// byte fallback decodes a run of byte pieces as a whole, so a window must not cut a run
/// there (its decode would turn the run's valid characters into U+FFFD).
fn char_start(tok: &Tokenizer, ids: &[u32], mut start: usize) -> usize {
    for _ in 0..3 {
        if start == 0 || start >= ids.len() || !byte_piece(tok, ids[start]).is_some_and(is_continuation) {
            break;
        }
        start -= 1;
    }
    start
}

/// How many of the last ids of `ids` are the byte-fallback pieces of a character they begin
/// but do not complete (0 when `ids` does not end inside a character that way).
fn open_byte_pieces(tok: &Tokenizer, ids: &[u32]) -> usize {
    let last: Vec<u8> = ids.iter().rev().take(4).map_while(|&id| byte_piece(tok, id)).collect();
    let Some(lead) = last.iter().position(|&b| !is_continuation(b)) else { return 0 };
    let len = match last[lead] {
        0xC0..=0xDF => 2,
        0xE0..=0xEF => 3,
        0xF0..=0xF7 => 4,
        _ => 1,
    };
    if lead + 1 < len {
        lead + 1
    } else {
        0
    }
}

/// The byte a SentencePiece byte-fallback piece (`<0xNN>`) stands for.
fn byte_piece(tok: &Tokenizer, id: u32) -> Option<u8> {
    tok.id_to_token(id).and_then(|p| fallback_byte(&p))
}

fn is_continuation(b: u8) -> bool {
    b & 0xC0 == 0x80
}
