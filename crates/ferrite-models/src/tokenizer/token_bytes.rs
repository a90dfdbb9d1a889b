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

/// GPT-2's byte-level table inverted: the byte each printable char stands for.
fn byte_level_table() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                let c = char::from_u32(next).expect("below the surrogate range");
                next += 1;
                (c, b)
            }
        })
        .collect()
}

/// `<0xNN>` → the byte NN.
pub(super) fn fallback_byte(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}

impl Tokenizer {
    /// The bytes of every id below `vocab_size()` (empty for ids no piece has).
    pub fn token_bytes(&self) -> Vec<Vec<u8>> {
        let decoder = self.inner.get_decoder().and_then(|d| serde_json::to_value(d).ok()).unwrap_or(Value::Null);
        let encoding = PieceEncoding::detect(&decoder);
        let table = byte_level_table();
        let mut out = vec![Vec::new(); self.vocab_size];
        for (piece, id) in self.inner.get_vocab(false) {
            let Some(slot) = out.get_mut(id as usize) else { continue };
            *slot = match encoding {
                PieceEncoding::ByteLevel => {
                    piece.chars().map(|c| table.get(&c).copied()).collect::<Option<Vec<u8>>>().unwrap_or_default()
                }
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
        let t = byte_level_table();
        assert_eq!(t.len(), 256);
        assert_eq!(t[&'Ġ'], b' ');
        assert_eq!(t[&'Ċ'], b'\n');
        assert_eq!(t[&'a'], b'a');
    }
}
