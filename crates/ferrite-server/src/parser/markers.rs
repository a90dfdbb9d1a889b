//! Special tokens the parsers read. The engine decodes with special tokens skipped, but some
//! families mark tool calls and reasoning with them (`[TOOL_CALLS]`, `<|python_tag|>`,
//! Gemma's `<|tool_call>`, …): `SpecialMarkers` knows which generated ids are such markers
//! and puts their text back into an output before it reaches a parser.
//!
//! The engine sends one token per output, so a marker's text goes after the output's text
//! (which is what earlier tokens completed, when anything was held back).

use std::collections::HashMap;

use ferrite_engine::Output;
use ferrite_models::tokenizer::Tokenizer;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialMarkers(HashMap<u32, String>);

impl SpecialMarkers {
    /// The marker texts of `texts` that are single special tokens of `tokenizer`; `None`
    /// when there are none.
    pub fn find(tokenizer: &Tokenizer, texts: &[&str]) -> Option<SpecialMarkers> {
        let map: HashMap<u32, String> = texts
            .iter()
            .filter_map(|t| {
                tokenizer.token_to_id(t).filter(|&id| tokenizer.is_special(id)).map(|id| (id, t.to_string()))
            })
            .collect();
        (!map.is_empty()).then_some(SpecialMarkers(map))
    }

    /// The token of marker `text`, when it is one of these.
    pub fn id_of(&self, text: &str) -> Option<u32> {
        self.0.iter().find_map(|(&id, t)| (t == text).then_some(id))
    }

    /// Put the text of `out`'s marker tokens back into its text.
    pub fn restore(&self, out: &mut Output) {
        for id in &out.token_ids {
            if let Some(text) = self.0.get(id) {
                out.text.push_str(text);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_follow_the_text_of_their_output() {
        let markers = SpecialMarkers(HashMap::from([(7, "[TOOL_CALLS]".to_string())]));
        let mut out = Output {
            choice: 0,
            token_ids: vec![7],
            text: "held".into(),
            logprobs: vec![],
            finished: None,
            cached_tokens: 0,
            embedding: None,
        };
        markers.restore(&mut out);
        assert_eq!(out.text, "held[TOOL_CALLS]");
        let mut plain = Output {
            choice: 0,
            token_ids: vec![8],
            text: "x".into(),
            logprobs: vec![],
            finished: None,
            cached_tokens: 0,
            embedding: None,
        };
        markers.restore(&mut plain);
        assert_eq!(plain.text, "x");
    }
}
