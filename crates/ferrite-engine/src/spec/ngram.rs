//! Prompt lookup: propose the tokens that followed the most recent earlier occurrence of the
//! sequence's last n tokens (longest n first) in its own prompt and output. Costs no model
//! call; pays off when the answer repeats the prompt (code edits, quoting, JSON echoes).

/// Lookup window: n-grams from `max_n` down to `min_n` tokens are tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramParams {
    pub min_n: usize,
    pub max_n: usize,
}

impl NgramParams {
    /// Speculation: short matches are worth a guess.
    pub const SPEC: NgramParams = NgramParams { min_n: 2, max_n: 4 };
    /// Echo fill: only spans that clearly continue a quoted passage.
    pub const ECHO: NgramParams = NgramParams { min_n: 3, max_n: 6 };
}

/// Up to `k` tokens continuing `tokens`, copied from after the latest earlier match of its
/// longest matching suffix n-gram; empty when nothing matches.
pub fn lookup(tokens: &[u32], k: usize, p: NgramParams) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 {
        return Vec::new();
    }
    for n in (p.min_n.max(1)..=p.max_n).rev() {
        if n >= len {
            continue;
        }
        let suffix = &tokens[len - n..];
        // Latest match first: recent context predicts best. A match must be followed by at
        // least one token, so it ends before the suffix itself.
        if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
            let from = start + n;
            return tokens[from..(from + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_latest_match_wins() {
        let p = NgramParams { min_n: 1, max_n: 3 };
        // "1 2 3" occurs at 0; the tail is "1 2 3" again → continue with 4 5.
        assert_eq!(lookup(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2, p), [4, 5]);
        // Only a 1-gram matches; the latest occurrence of 7 is followed by 8.
        assert_eq!(lookup(&[7, 1, 7, 8, 0, 7], 3, p), [8, 0, 7]);
        // The continuation is cut at the end of the sequence.
        assert_eq!(lookup(&[5, 6, 5, 6], 4, NgramParams { min_n: 2, max_n: 2 }), [5, 6]);
        assert!(lookup(&[1, 2, 3], 4, NgramParams::ECHO).is_empty());
        assert!(lookup(&[1, 1], 0, p).is_empty());
    }
}
