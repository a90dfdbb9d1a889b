//! `PrefixCache`: full KV blocks keyed by a hash chained over (parent hash, block tokens,
//! namespace). The namespace folds in the model fingerprint, the KV scheme and the adapter
//! set, so blocks are never shared across things that would compute different KV.
//!
//! Contract: `lookup` walks a token sequence block by block and returns the cached block ids
//! of its longest cached prefix; `insert` registers a full block; `remove` forgets an evicted
//! one. Entries keep their tokens, so a hash collision can never return a wrong block.

use std::collections::HashMap;

pub struct PrefixCache {
    namespace: u64,
    map: HashMap<u64, (u32, Vec<u32>)>,
    pub queried_tokens: u64,
    pub hit_tokens: u64,
}

/// FNV-1a over the parent hash, the namespace and the block's token ids.
pub fn chain_hash(parent: u64, namespace: u64, tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(parent);
    eat(namespace);
    for &t in tokens {
        eat(t as u64);
    }
    h
}

impl PrefixCache {
    pub fn new(namespace: u64) -> PrefixCache {
        PrefixCache { namespace, map: HashMap::new(), queried_tokens: 0, hit_tokens: 0 }
    }

    /// Hashes of the full blocks of `tokens`, chained.
    pub fn block_hashes(&self, tokens: &[u32], block_size: usize) -> Vec<u64> {
        let mut parent = 0;
        tokens
            .chunks_exact(block_size)
            .map(|b| {
                parent = chain_hash(parent, self.namespace, b);
                parent
            })
            .collect()
    }

    /// The cached blocks of the longest cached prefix among the first `max_blocks` blocks.
    pub fn lookup(&self, tokens: &[u32], block_size: usize, max_blocks: usize) -> Vec<(u32, u64)> {
        let mut out = Vec::new();
        for (i, h) in self.block_hashes(tokens, block_size).into_iter().take(max_blocks).enumerate() {
            match self.map.get(&h) {
                Some((block, toks)) if toks[..] == tokens[i * block_size..(i + 1) * block_size] => {
                    out.push((*block, h))
                }
                _ => break,
            }
        }
        out
    }

    /// Register `block` as holding the tokens that hash to `hash`; false when that content is
    /// already cached in another block.
    pub fn insert(&mut self, hash: u64, block: u32, tokens: &[u32]) -> bool {
        if self.map.contains_key(&hash) {
            return false;
        }
        self.map.insert(hash, (block, tokens.to_vec()));
        true
    }

    pub fn remove(&mut self, hash: u64, block: u32) {
        if self.map.get(&hash).is_some_and(|(b, _)| *b == block) {
            self.map.remove(&hash);
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn hit_rate(&self) -> f64 {
        if self.queried_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.queried_tokens as f64
        }
    }
}
