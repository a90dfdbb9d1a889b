//! `KvManager`: the blocks every sequence owns, per KV group.
//!
//! Each group (full attention, sliding window) has its own `BlockPool`; a sequence has one
//! block table per group (`SeqKv`). Sliding groups release blocks that fall out of the window.
//! When the prefix cache is on, every group's full blocks are registered in the `PrefixCache`
//! so later sequences with the same prefix reuse them: a hit of `h` blocks needs all `h` in a
//! full-attention group, but in a sliding group only the blocks the window still reads at
//! position `h · block_size` (the ones before were released and may be gone).

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
    /// `prefix_namespace` turns the prefix cache on.
    pub fn new(
        layout: &KvLayout,
        group_blocks: &[usize],
        block_size: usize,
        prefix_namespace: Option<u64>,
    ) -> KvManager {
        let groups =
            layout.groups.iter().zip(group_blocks).map(|(&kind, &n)| Group { kind, pool: BlockPool::new(n) }).collect();
        let cache = prefix_namespace.map(|ns| PrefixCache::new(ns, layout.groups.len()));
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
        let mut hashes = cache.block_hashes(tokens, bs);
        hashes.truncate(tokens.len().saturating_sub(1) / bs);
        let block = |cache: &PrefixCache, g: usize, i: usize| cache.get(g, hashes[i], &tokens[i * bs..(i + 1) * bs]);
        // Full groups: the longest run of cached blocks from the start.
        let mut hit = hashes.len();
        for (g, group) in self.groups.iter().enumerate() {
            if group.kind == KvGroupKind::Full {
                hit = (0..hit).take_while(|&i| block(cache, g, i).is_some()).count();
            }
        }
        // Sliding groups: the longest such hit whose window is cached.
        let window_cached = |hit: usize| {
            self.groups
                .iter()
                .enumerate()
                .all(|(g, group)| (first_needed(group.kind, hit * bs, bs)..hit).all(|i| block(cache, g, i).is_some()))
        };
        while hit > 0 && !window_cached(hit) {
            hit -= 1;
        }
        cache.queried_tokens += tokens.len() as u64;
        cache.hit_tokens += (hit * bs) as u64;
        for (g, group) in self.groups.iter_mut().enumerate() {
            let first = first_needed(group.kind, hit * bs, bs);
            for i in 0..hit {
                let id = if i < first { None } else { block(cache, g, i) };
                if let Some(id) = id {
                    group.pool.retain(id);
                }
                kv.tables[g].push(id.unwrap_or(NO_BLOCK));
            }
        }
        kv.hashes = hashes[..hit].to_vec();
        hit * bs
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
                    cache.remove(g, h, block);
                }
                kv.tables[g].push(block);
            }
        }
        true
    }

    /// After `computed` positions of `tokens` are in the cache: register newly full blocks in
    /// the prefix cache, then release blocks that left a sliding window (a block leaves only
    /// after it is full, so it is registered first and stays findable until evicted).
    pub fn after_step(&mut self, kv: &mut SeqKv, tokens: &[u32], computed: usize) {
        let bs = self.block_size;
        if let Some(cache) = self.cache.as_mut() {
            while kv.hashes.len() < computed / bs {
                let i = kv.hashes.len();
                let block_tokens = &tokens[i * bs..(i + 1) * bs];
                let h = chain_hash(kv.hashes.last().copied().unwrap_or(0), self.namespace, block_tokens);
                for (g, (group, table)) in self.groups.iter_mut().zip(&kv.tables).enumerate() {
                    let block = table[i];
                    if block != NO_BLOCK && group.pool.hash(block).is_none() && cache.insert(g, h, block, block_tokens)
                    {
                        group.pool.set_hash(block, Some(h));
                    }
                }
                kv.hashes.push(h);
            }
        }
        for (group, table) in self.groups.iter_mut().zip(kv.tables.iter_mut()) {
            for slot in table.iter_mut().take(first_needed(group.kind, computed, bs)) {
                if *slot != NO_BLOCK {
                    group.pool.release(*slot);
                    *slot = NO_BLOCK;
                }
            }
        }
    }

    /// Roll `kv` back to its first `len` positions: blocks past them are released (a rejected
    /// verify tail). Prefix-cache entries only ever cover committed positions, so none is lost.
    pub fn truncate(&mut self, kv: &mut SeqKv, len: usize) {
        let keep = len.div_ceil(self.block_size);
        for (group, table) in self.groups.iter_mut().zip(kv.tables.iter_mut()) {
            for b in table.drain(keep.min(table.len())..).filter(|&b| b != NO_BLOCK) {
                group.pool.release(b);
            }
        }
        kv.hashes.truncate(len / self.block_size);
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

/// The first block a group still reads once `computed` positions are in the cache: the next
/// query (position `computed`) of a sliding group reads from `computed + 1 - window` on.
fn first_needed(kind: KvGroupKind, computed: usize, block_size: usize) -> usize {
    match kind {
        KvGroupKind::Full => 0,
        KvGroupKind::Sliding { window } => (computed + 1).saturating_sub(window) / block_size,
    }
}
