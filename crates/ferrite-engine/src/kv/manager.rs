//! `KvManager`: the blocks every sequence owns, per KV group.
//!
//! Each group (full attention, sliding window) has its own `BlockPool`; a sequence has one
//! block table per group (`SeqKv`). Sliding groups release blocks that fall out of the window.
//! Full blocks of the first group are registered in the `PrefixCache` (when it is on and every
//! group is full attention) so later sequences with the same prefix reuse them.

use ferrite_runtime::batch::NO_BLOCK;
use ferrite_runtime::{KvGroupKind, KvLayout};

use super::block_pool::BlockPool;
use super::prefix_cache::{chain_hash, PrefixCache};

/// One sequence's blocks: a table per KV group, and the chained hashes of its full blocks.
#[derive(Debug, Default, Clone)]
pub struct SeqKv {
    pub tables: Vec<Vec<u32>>,
    hashes: Vec<u64>,
}

impl SeqKv {
    pub fn is_empty(&self) -> bool {
        self.tables.iter().all(Vec::is_empty)
    }
}

struct Group {
    kind: KvGroupKind,
    pool: BlockPool,
}

pub struct KvManager {
    groups: Vec<Group>,
    block_size: usize,
    cache: Option<PrefixCache>,
    namespace: u64,
}

impl KvManager {
    /// `prefix_namespace` turns the prefix cache on (for layouts of full-attention groups).
    pub fn new(
        layout: &KvLayout,
        group_blocks: &[usize],
        block_size: usize,
        prefix_namespace: Option<u64>,
    ) -> KvManager {
        let all_full = layout.groups.iter().all(|g| *g == KvGroupKind::Full);
        let groups =
            layout.groups.iter().zip(group_blocks).map(|(&kind, &n)| Group { kind, pool: BlockPool::new(n) }).collect();
        let cache = prefix_namespace.filter(|_| all_full).map(PrefixCache::new);
        KvManager { groups, block_size, cache, namespace: prefix_namespace.unwrap_or(0) }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn new_seq(&self) -> SeqKv {
        SeqKv { tables: vec![Vec::new(); self.groups.len()], hashes: Vec::new() }
    }

    pub fn prefix_cache(&self) -> Option<&PrefixCache> {
        self.cache.as_ref()
    }

    /// Free blocks over all groups, and the total.
    pub fn free_blocks(&self) -> (usize, usize) {
        self.groups.iter().fold((0, 0), |(f, t), g| (f + g.pool.num_free(), t + g.pool.num_blocks()))
    }

    /// Positions the smallest group can hold: the longest sequence that can ever run.
    pub fn capacity_tokens(&self) -> usize {
        self.groups
            .iter()
            .map(|g| match g.kind {
                KvGroupKind::Full => g.pool.num_blocks() * self.block_size,
                KvGroupKind::Sliding { .. } => usize::MAX,
            })
            .min()
            .unwrap_or(0)
    }

    /// Reuse the longest cached prefix of `tokens` (at most `tokens.len() - 1` positions, so
    /// the last one is computed and gives logits). `kv` must hold no blocks. Returns the
    /// number of cached positions.
    pub fn acquire_prefix(&mut self, kv: &mut SeqKv, tokens: &[u32]) -> usize {
        let bs = self.block_size;
        let Some(cache) = self.cache.as_mut() else { return 0 };
        let max_blocks = tokens.len().saturating_sub(1) / bs;
        let hits = cache.lookup(tokens, bs, max_blocks);
        cache.queried_tokens += tokens.len() as u64;
        cache.hit_tokens += (hits.len() * bs) as u64;
        let pool = &mut self.groups[0].pool;
        for &(block, hash) in &hits {
            pool.retain(block);
            kv.tables[0].push(block);
            kv.hashes.push(hash);
        }
        hits.len() * bs
    }

    /// Grow every table to cover `total` positions; all or nothing.
    pub fn allocate(&mut self, kv: &mut SeqKv, total: usize) -> bool {
        let need: Vec<usize> =
            kv.tables.iter().map(|t| total.div_ceil(self.block_size).saturating_sub(t.len())).collect();
        if self.groups.iter().zip(&need).any(|(g, &n)| g.pool.num_free() < n) {
            return false;
        }
        for (g, (group, &n)) in self.groups.iter_mut().zip(&need).enumerate() {
            for _ in 0..n {
                let Some((block, evicted)) = group.pool.allocate() else { return false };
                if let (Some(h), Some(cache)) = (evicted, self.cache.as_mut()) {
                    cache.remove(h, block);
                }
                kv.tables[g].push(block);
            }
        }
        true
    }

    /// After `computed` positions of `tokens` are in the cache: release blocks that left a
    /// sliding window and register newly full blocks in the prefix cache.
    pub fn after_step(&mut self, kv: &mut SeqKv, tokens: &[u32], computed: usize) {
        let bs = self.block_size;
        for (group, table) in self.groups.iter_mut().zip(kv.tables.iter_mut()) {
            if let KvGroupKind::Sliding { window } = group.kind {
                // The next query (position `computed`) reads positions from computed + 1 - window.
                let first_needed = (computed + 1).saturating_sub(window) / bs;
                for slot in table.iter_mut().take(first_needed) {
                    if *slot != NO_BLOCK {
                        group.pool.release(*slot);
                        *slot = NO_BLOCK;
                    }
                }
            }
        }
        let Some(cache) = self.cache.as_mut() else { return };
        let pool = &mut self.groups[0].pool;
        while kv.hashes.len() < computed / bs {
            let i = kv.hashes.len();
            let block_tokens = &tokens[i * bs..(i + 1) * bs];
            let h = chain_hash(kv.hashes.last().copied().unwrap_or(0), self.namespace, block_tokens);
            let block = kv.tables[0][i];
            if pool.hash(block).is_none() && cache.insert(h, block, block_tokens) {
                pool.set_hash(block, Some(h));
            }
            kv.hashes.push(h);
        }
    }

    /// Release every block of `kv` (cached ones stay findable until evicted).
    pub fn free(&mut self, kv: &mut SeqKv) {
        for (group, table) in self.groups.iter_mut().zip(kv.tables.iter_mut()) {
            for b in table.drain(..).filter(|&b| b != NO_BLOCK) {
                group.pool.release(b);
            }
        }
        kv.hashes.clear();
    }

    /// A new table set sharing the first `blocks` blocks of `kv` (for forking n > 1 children);
    /// only full-attention layouts share (a sliding table may have released blocks).
    pub fn share_prefix(&mut self, kv: &SeqKv, blocks: usize) -> SeqKv {
        let mut out = self.new_seq();
        if self.groups.iter().any(|g| g.kind != KvGroupKind::Full) {
            return out;
        }
        for (g, table) in kv.tables.iter().enumerate() {
            for &b in table.iter().take(blocks) {
                self.groups[g].pool.retain(b);
                out.tables[g].push(b);
            }
        }
        out.hashes = kv.hashes.iter().take(blocks).copied().collect();
        out
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        self.groups.iter().try_for_each(|g| g.pool.check_invariants())
    }
}
