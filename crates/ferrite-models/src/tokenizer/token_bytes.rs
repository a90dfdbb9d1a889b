//! The raw bytes each token id stands for — what a grammar engine matches tokens against.
//!
//! A vocab piece is stored escaped: byte-level BPE maps every byte to a printable char (GPT-2's
//! table), SentencePiece writes spaces as `▁` and stray bytes as `<0xNN>`. This undoes the
//! escaping the tokenizer's decoder would undo. Special (control) tokens come out as
//! `0xFF` followed by their text — bytes no UTF-8 text contains, so text never matches them.

use serde_json::Value;

use super::Tokenizer;

/// The byte that starts a special token's bytes (llguidance's convention).
pub const SPECIAL_TOKEN_MARKER: u8 = 0xFF;

/// How vocab pieces encode their bytes, read from the tokenizer's decoder.
#[derive(Debug, Clone, Copy, PartialEq)]
enum PieceEncoding {
    /// GPT-2 byte-level: one printable char per byte.
    ByteLevel,
    /// SentencePiece: `space` stands for a space; `<0xNN>` pieces are single bytes.
    SentencePiece { space: char },
    /// Anything else: each piece is decoded alone.
    Decoded,
}

impl PieceEncoding {
    fn detect(decoder: &Value) -> PieceEncoding {
        let steps: Vec<&Value> = match decoder["type"].as_str() {
            Some("Sequence") => decoder["decoders"].as_array().map(|d| d.iter().collect()).unwrap_or_default(),
            _ => vec![decoder],
        };
        let kind = |t: &str| steps.iter().find(|d| d["type"].as_str() == Some(t));
        if kind("ByteLevel").is_some() {
            return PieceEncoding::ByteLevel;
        }
        let replaced_space = steps
            .iter()
            .filter(|d| d["type"].as_str() == Some("Replace") && d["content"].as_str() == Some(" "))
            .find_map(|d| single_char(d["pattern"]["String"].as_str()?));
        if let Some(space) = replaced_space.filter(|_| kind("ByteFallback").is_some()) {
            return PieceEncoding::SentencePiece { space };
        }
        if let Some(m) = kind("Metaspace") {
            let space = m["replacement"].as_str().and_then(single_char).unwrap_or('▁');
            return PieceEncoding::SentencePiece { space };
        }
        PieceEncoding::Decoded
    }
}

fn single_char(s: &str) -> Option<char> {
    let mut chars = s.chars();
    let c = chars.next()?;
    chars.next().is_none().then_some(c)
}

/// GPT-2's byte-level table inverted: the byte each printable char stands for (the chars
/// are below U+0144, so a flat array indexed by char serves).
struct ByteLevelChars([Option<u8>; 0x144]);

impl ByteLevelChars {
    fn new() -> ByteLevelChars {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let mut table = [None; 0x144];
        let mut next = 256;
        for b in 0..=255u8 {
            let c = if printable(b) {
                usize::from(b)
            } else {
                next += 1;
                next - 1
            };
            table[c] = Some(b);
        }
        ByteLevelChars(table)
    }

    fn byte(&self, c: char) -> Option<u8> {
        self.0.get(c as usize).copied().flatten()
    }

    /// The bytes of a piece whose every char is in the table.
    fn bytes(&self, piece: &str) -> Option<Vec<u8>> {
        piece.chars().map(|c| self.byte(c)).collect()
    }
}

/// `<0xNN>` → the byte NN.
pub(super) fn fallback_byte(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}

/// The bytes each id below `vocab_size` decodes to, when the tokenizer's decoder is GPT-2's
/// byte-level one alone: its decode of any ids is then the concatenation of their bytes
/// (special ones left out when asked), read as UTF-8 with invalid sequences replaced — so a
/// stream of ids decodes incrementally by appending bytes (`IncrementalDecoder`). A piece is
/// decoded as that decoder does: each char through GPT-2's table, or, if any char is not in
/// it (an added token's text), the piece's own UTF-8 bytes. `None` for other decoders.
pub(super) fn concatenating_pieces(inner: &tokenizers::Tokenizer, vocab_size: usize) -> Option<Vec<Box<[u8]>>> {
    let decoder = inner.get_decoder().and_then(|d| serde_json::to_value(d).ok())?;
    if decoder["type"].as_str() != Some("ByteLevel") {
        return None;
    }
    let table = ByteLevelChars::new();
    let piece = |id: u32| -> Box<[u8]> {
        let Some(token) = inner.id_to_token(id) else { return Box::default() };
        match table.bytes(&token) {
            Some(bytes) => bytes.into(),
            None => token.into_bytes().into(),
        }
    };
    Some((0..vocab_size as u32).map(piece).collect())
}

impl Tokenizer {
    /// The bytes of every id below `vocab_size()` (empty for ids no piece has).
    pub fn token_bytes(&self) -> Vec<Vec<u8>> {
        let decoder = self.inner.get_decoder().and_then(|d| serde_json::to_value(d).ok()).unwrap_or(Value::Null);
        let encoding = PieceEncoding::detect(&decoder);
        let table = ByteLevelChars::new();
        let mut out = vec![Vec::new(); self.vocab_size];
        for (piece, id) in self.inner.get_vocab(false) {
            let Some(slot) = out.get_mut(id as usize) else { continue };
            *slot = match encoding {
                PieceEncoding::ByteLevel => table.bytes(&piece).unwrap_or_default(),
                PieceEncoding::SentencePiece { space } => match fallback_byte(&piece) {
                    Some(b) => vec![b],
                    None => piece.replace(space, " ").into_bytes(),
                },
                PieceEncoding::Decoded => self.decode(&[id], false).map(String::into_bytes).unwrap_or_default(),
            };
        }
        // Added tokens are stored as plain text; special ones get the marker.
        for (&id, added) in self.inner.get_added_tokens_decoder().iter() {
            let Some(slot) = out.get_mut(id as usize) else { continue };
            let mut bytes = Vec::with_capacity(added.content.len() + 1);
            if self.is_special(id) {
                bytes.push(SPECIAL_TOKEN_MARKER);
            }
            bytes.extend_from_slice(added.content.as_bytes());
            *slot = bytes;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_piece_encodings() {
        let bl = serde_json::json!({"type": "ByteLevel"});
        assert_eq!(PieceEncoding::detect(&bl), PieceEncoding::ByteLevel);
        let spm = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]});
        assert_eq!(PieceEncoding::detect(&spm), PieceEncoding::SentencePiece { space: '▁' });
        assert_eq!(PieceEncoding::detect(&Value::Null), PieceEncoding::Decoded);
        assert_eq!(fallback_byte("<0x0A>"), Some(b'\n'));
        assert_eq!(fallback_byte("<0x0>"), None);
        let t = ByteLevelChars::new();
        assert_eq!(t.0.iter().flatten().count(), 256);
        assert_eq!(t.byte('Ġ'), Some(b' '));
        assert_eq!(t.byte('Ċ'), Some(b'\n'));
        assert_eq!(t.byte('a'), Some(b'a'));
        assert_eq!(t.byte('é'), Some(0xE9));
        assert_eq!(t.byte('\u{144}'), None);
    }
}
