//! `PrefixCache`: full KV blocks keyed by a hash chained over (parent hash, block tokens,
//! namespace). The namespace folds in the model fingerprint and the KV scheme; a chain starts
//! at its sequence's root (0, or the digest of the LoRA adapter it runs through), so blocks
//! are never shared across things that would compute different KV.
//!
//! Each KV group (full attention, sliding window) has its own entries under the same chained
//! hashes: a block id means something only within its group's pool. `get` finds the cached
//! block of one group for one block of tokens; `insert` registers a full block; `remove`
//! forgets an evicted one. Entries keep their tokens, so a hash collision can never return a
//! wrong block. Which blocks a hit needs (all of them for full attention, only those inside
//! the window for a sliding group) is each group's `GroupPolicy`'s business.

use std::collections::HashMap;

pub struct PrefixCache {
    namespace: u64,
    /// Per KV group: chained hash → (block, the block's tokens).
    groups: Vec<HashMap<u64, (u32, Vec<u32>)>>,
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
    pub fn new(namespace: u64, groups: usize) -> PrefixCache {
        PrefixCache { namespace, groups: vec![HashMap::new(); groups], queried_tokens: 0, hit_tokens: 0 }
    }

    /// Hashes of the full blocks of `tokens`, chained from `root`.
    pub fn block_hashes(&self, root: u64, tokens: &[u32], block_size: usize) -> Vec<u64> {
        let mut parent = root;
        tokens
            .chunks_exact(block_size)
            .map(|b| {
                parent = chain_hash(parent, self.namespace, b);
                parent
            })
            .collect()
    }

    /// The block of `group` caching `tokens` (one block's worth) under `hash`.
    pub fn get(&self, group: usize, hash: u64, tokens: &[u32]) -> Option<u32> {
        self.groups[group].get(&hash).filter(|(_, toks)| toks[..] == *tokens).map(|&(block, _)| block)
    }

    /// Register `block` of `group` as holding the tokens that hash to `hash`; false when that
    /// content is already cached in another block.
    pub fn insert(&mut self, group: usize, hash: u64, block: u32, tokens: &[u32]) -> bool {
        let map = &mut self.groups[group];
        if map.contains_key(&hash) {
            return false;
        }
        map.insert(hash, (block, tokens.to_vec()));
        true
    }

    /// Forget `block` of `group` caching `hash`; the tokens it cached, if it did.
    pub fn remove(&mut self, group: usize, hash: u64, block: u32) -> Option<Vec<u32>> {
        let map = &mut self.groups[group];
        match map.get(&hash) {
            Some((b, _)) if *b == block => map.remove(&hash).map(|(_, t)| t),
            _ => None,
        }
    }

    /// Cached blocks over all groups.
    pub fn len(&self) -> usize {
        self.groups.iter().map(HashMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn hit_rate(&self) -> f64 {
        if self.queried_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.queried_tokens as f64
        }
    }
}
