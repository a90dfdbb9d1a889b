//! The tokenizer as llguidance sees it: a token trie over every token's bytes, and
//! tokenization of forced text through our own tokenizer.

use std::sync::Arc;

use ferrite_models::tokenizer::Tokenizer;
use toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv, INVALID_TOKEN};

pub(crate) struct TokenEnv {
    tokenizer: Arc<Tokenizer>,
    trie: TokTrie,
}

impl TokenEnv {
    /// A trie over `vocab_size` ids (the model's logits; ids the tokenizer lacks match
    /// nothing), ending generation at `eos`.
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize, eos: &[u32]) -> TokenEnv {
        let mut words = tokenizer.token_bytes();
        words.resize(vocab_size.max(words.len()), Vec::new());
        let eos: Vec<u32> = eos.iter().copied().filter(|&t| (t as usize) < words.len()).collect();
        let mut info = TokRxInfo::new(words.len() as u32, eos.first().copied().unwrap_or(INVALID_TOKEN));
        info.tok_bos = tokenizer.bos_token_id();
        let trie = TokTrie::from(&info, &words);
        let trie = if eos.is_empty() { trie } else { trie.with_eos_tokens(&eos) };
        TokenEnv { tokenizer, trie }
    }
}

impl TokenizerEnv for TokenEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer.encode(text, false).unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
        })
    }
}
