//! BPE merges for a SentencePiece vocabulary that stores scores instead of merges.
//!
//! A SentencePiece BPE model merges, at each step, the adjacent pair whose concatenation is
//! the highest-scoring piece. A Hugging Face BPE model wants a ranked merge list instead; we
//! derive it as the `transformers` converter does (`generate_merges` with scores): every
//! split of every piece into two pieces of the vocab is a merge, ranked by the piece's score
//! (highest first), then the longer left part, then the longer right part, then vocab order.

use std::collections::HashMap;

/// Ranked merges for `tokens` with their `scores`. Only pieces `mergeable(id)` are merge
/// results (SentencePiece never merges into a control, byte or unused piece).
pub(super) fn merges_from_scores(
    tokens: &[String],
    scores: &[f32],
    mergeable: impl Fn(usize) -> bool,
) -> Vec<(String, String)> {
    // First id of each piece (a vocab with duplicates keeps the first, as SentencePiece does).
    let mut ids: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        ids.entry(t.as_str()).or_insert(i);
    }
    struct Candidate {
        left: usize,
        right: usize,
        left_len: usize,
        right_len: usize,
        score: f32,
        piece: usize,
    }
    let mut candidates = Vec::new();
    for (piece, text) in tokens.iter().enumerate() {
        if !mergeable(piece) || ids.get(text.as_str()) != Some(&piece) {
            continue;
        }
        let score = scores.get(piece).copied().unwrap_or(0.0);
        let start = candidates.len();
        for (split, _) in text.char_indices().skip(1) {
            let (l, r) = text.split_at(split);
            if let (Some(&left), Some(&right)) = (ids.get(l), ids.get(r)) {
                candidates.push(Candidate {
                    left,
                    right,
                    left_len: l.chars().count(),
                    right_len: r.chars().count(),
                    score,
                    piece,
                });
            }
        }
        candidates[start..].sort_by_key(|c| (c.left, c.right));
    }
    // Stable sort: ties keep the (piece id, left id, right id) order built above.
    candidates.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then(b.left_len.cmp(&a.left_len))
            .then(b.right_len.cmp(&a.right_len))
            .then(a.piece.cmp(&b.piece))
    });
    candidates.into_iter().map(|c| (tokens[c.left].clone(), tokens[c.right].clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_by_score_of_the_merged_piece() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc"].iter().map(|s| s.to_string()).collect();
        let scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0];
        let merges = merges_from_scores(&tokens, &scores, |_| true);
        let pairs: Vec<(&str, &str)> = merges.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        // "bc" (-1) before "ab" (-2) before the two ways to make "abc" (-3), longer left first.
        assert_eq!(pairs, vec![("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]);
    }
}
