//! `KvManager`: the blocks every sequence owns, per KV group.
//!
//! Each group has its own `BlockPool` and the `GroupPolicy` of its kind (`policy.rs`), which
//! says how long its tables are, which blocks the next query still reads and what a prefix
//! hit needs. A sequence's blocks are a `SeqKv` made here: an owned value that returns its
//! blocks to these pools when it is dropped, so a block can only be freed by giving up the
//! one table that holds it. Sharing never copies a table: a prefix hit and a fork get their
//! own `SeqKv` whose blocks the pool retained (their counts went up).
//!
//! After each step, blocks that left a sliding window are released. When the prefix cache is
//! on, every group's full blocks are registered in the `PrefixCache` so later sequences with
//! the same prefix reuse them: a hit of `h` blocks is the longest one every group's policy can
//! serve — all `h` blocks in a full-attention group, only those the window still reads at
//! position `h · block_size` in a sliding one (the ones before were released and may be gone).
//!
//! A recurrent group's blocks are state slots (`policy::RecurrentState`): its table keeps the
//! live state and strided snapshots, and a verify row gets a span of per-token state slots
//! (`reserve_span`) from which `truncate` restores the state at the accepted length.
//!
//! With a tier below the pool that takes evicted blocks (host RAM), every cached block the
//! pools evict is recorded as a `Spill` — its hash, tokens and the block of each group that
//! caches it — while its bytes are still intact; the engine hands the spills to the tier
//! (`take_spills`) before the next write to the pool. A recurrent group's state snapshot is
//! an optional part of a block below the pool (`GroupPolicy::snapshots`): a block is spilled,
//! published and restored when every other group has it, with its snapshot where one is
//! cached, and a restore asks for the snapshot of the hit's end only.
//!
//! A quantized cache with a delayed start (`--quantized-kv-start`) has a second set of pools,
//! the full-precision twins, with their own block ids, free lists and prefix-cache entries
//! (`transition.rs`): a row before its start allocates there, and the allocation that takes
//! it past its start moves it into the quantized pools. A recurrent group holds no quantized
//! KV: its twin pool is empty, and its state slots stay in its own pool on both sides of a
//! row's start (`SeqKv::pool`). Tiers below the pool hold blocks of the quantized pools only.

use std::sync::{Arc, Mutex};

use ferrite_runtime::batch::NO_BLOCK;
use ferrite_runtime::KvLayout;

use super::block_pool::BlockPool;
use super::policy::{policy_for, GroupPolicy, RecurrentState};
use super::prefix_cache::{chain_hash, PrefixCache};
use super::seq_kv::{lock, pool_index, SeqKv, SharedPools, Span, NEVER};

pub struct KvManager {
    /// The rules of each group's kind, in group order.
    pub(super) policies: Vec<Box<dyn GroupPolicy>>,
    /// Each group's blocks, shared with the `SeqKv`s made from them; then, with a delayed
    /// quantized start, each group's full-precision twin blocks (pool `groups + g`; none for a
    /// recurrent group, whose rows keep their state slots in pool `g`).
    pub(super) pools: SharedPools,
    pub(super) block_size: usize,
    /// Entries per pool (`pools`' indices).
    pub(super) cache: Option<PrefixCache>,
    namespace: u64,
    /// Evicted cached blocks not handed to a tier yet; None when no tier takes them.
    pub(super) spills: Option<Vec<Spill>>,
    /// Whether the full-precision twin pools exist.
    twins: bool,
}

/// A cached block the pools evicted, its bytes intact until the next write to the pools:
/// its chained hash, its tokens, and the block of each group that caches it (`NO_BLOCK` for a
/// snapshot group that keeps no snapshot of it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spill {
    pub hash: u64,
    pub tokens: Vec<u32>,
    pub holders: Vec<u32>,
}

/// Take the least recently freed block of `pool` (pool index `g`), evicting the cached prefix
/// it held; a spill records it when every group but a snapshot group (`state`) cached it
/// (`groups` of them: the quantized pools; a twin pool's index is past them, and its blocks
/// are not spilled — nor a snapshot cached under a full-precision chain, which no quantized
/// pool caches).
pub(super) fn take_free(
    pool: &mut BlockPool,
    g: usize,
    cache: &mut Option<PrefixCache>,
    spills: &mut Option<Vec<Spill>>,
    (groups, state): (usize, Option<usize>),
) -> Option<u32> {
    let (block, evicted) = pool.allocate()?;
    let (Some(h), Some(cache)) = (evicted, cache.as_mut()) else { return Some(block) };
    let tokens = cache.remove(g, h, block);
    if let (Some(spills), Some(tokens), true) = (spills.as_mut(), tokens, g < groups) {
        let holders: Option<Vec<u32>> = (0..groups)
            .map(|o| match cache.get(o, h, &tokens) {
                _ if o == g => Some(block),
                None if Some(o) == state => Some(NO_BLOCK),
                held => held,
            })
            .collect();
        if let Some(holders) = holders {
            spills.push(Spill { hash: h, tokens, holders });
        }
    }
    Some(block)
}

impl KvManager {
    /// `prefix_namespace` turns the prefix cache on.
    pub fn new(
        layout: &KvLayout,
        group_blocks: &[usize],
        block_size: usize,
        prefix_namespace: Option<u64>,
    ) -> KvManager {
        KvManager::with_full_precision(layout, group_blocks, &[], block_size, prefix_namespace)
    }

    /// `new`, with `full_blocks[g]` full-precision twin blocks in group `g` for rows before
    /// their quantized start (none when empty; 0 for a recurrent group).
    pub fn with_full_precision(
        layout: &KvLayout,
        group_blocks: &[usize],
        full_blocks: &[usize],
        block_size: usize,
        prefix_namespace: Option<u64>,
    ) -> KvManager {
        let policies: Vec<_> = layout.groups.iter().map(|&kind| policy_for(kind)).collect();
        let pools: Vec<BlockPool> = group_blocks.iter().chain(full_blocks).map(|&n| BlockPool::new(n)).collect();
        let cache = prefix_namespace.map(|ns| PrefixCache::new(ns, pools.len()));
        KvManager {
            policies,
            pools: Arc::new(Mutex::new(pools)),
            block_size,
            cache,
            namespace: prefix_namespace.unwrap_or(0),
            spills: None,
            twins: !full_blocks.is_empty(),
        }
    }

    /// Whether rows may keep full-precision KV before a quantized start (twin pools exist).
    pub fn has_full_precision(&self) -> bool {
        self.twins
    }

    /// Keep a recurrent group's state snapshots every `blocks` blocks (default 1).
    pub fn set_snapshot_stride(&mut self, blocks: usize) {
        for p in self.policies.iter_mut().filter(|p| p.spans()) {
            *p = Box::new(RecurrentState { stride: blocks.max(1) });
        }
    }

    /// The groups a spill records (the quantized pools') and the snapshot group among them.
    pub(super) fn spill_shape(&self) -> (usize, Option<usize>) {
        (self.policies.len(), self.state_group())
    }

    /// The group whose blocks are state snapshots (`GroupPolicy::snapshots`), if one is.
    pub fn state_group(&self) -> Option<usize> {
        self.policies.iter().position(|p| p.snapshots())
    }

    /// Whether a group keeps recurrent state (verify rows need `reserve_span`).
    pub fn has_recurrent_state(&self) -> bool {
        self.policies.iter().any(|p| p.spans())
    }

    /// Take the state slots of a verify row of `kv` whose first query position is `from` and
    /// that proposes `k` tokens: the state after each of positions `from .. from + k` gets a
    /// slot (`SeqKv::span_states`), so `truncate` can restore any accepted length. True (and
    /// nothing taken) without a recurrent group; false when the slots are not free.
    pub fn reserve_span(&mut self, kv: &mut SeqKv, from: usize, k: usize) -> bool {
        debug_assert!(kv.is_from(&self.pools) && kv.span.is_none(), "one span at a time, from its own pools");
        let Some(g) = self.policies.iter().position(|p| p.spans()) else { return true };
        let (groups, at) = (self.spill_shape(), kv.pool(g));
        let mut pools = lock(&self.pools);
        if pools[at].num_free() < k {
            return false;
        }
        let mut slots = Vec::with_capacity(k);
        for _ in 0..k {
            match take_free(&mut pools[at], at, &mut self.cache, &mut self.spills, groups) {
                Some(b) => slots.push(b),
                None => break,
            }
        }
        kv.span = Some(Span { group: g, from, slots });
        true
    }

    /// Fit `kv`'s recurrent tables to a row of a step that ends at `context` positions (its
    /// query may be shorter than what was allocated, a proposal cut short): the entry of its
    /// last position holds a slot — the last entry's, moved there — and no entry past it does.
    /// Other groups keep their tables. False where no slot could be found (never after
    /// `allocate` covered `context`).
    pub fn fit_row(&mut self, kv: &mut SeqKv, context: usize) -> bool {
        if context == 0 {
            return true;
        }
        let (bs, groups) = (self.block_size, self.spill_shape());
        let end = (context - 1) / bs;
        let mut pools = lock(&self.pools);
        let (base, state) = (kv.base, kv.state);
        for (g, (policy, table)) in self.policies.iter().zip(kv.tables.iter_mut()).enumerate() {
            if !policy.last_holds_block() {
                continue;
            }
            let at = pool_index(base, state, g);
            let mut spare = None;
            while table.len() > end + 1 {
                match (table.pop(), spare) {
                    (Some(b), None) if b != NO_BLOCK => spare = Some(b),
                    (Some(b), Some(_)) if b != NO_BLOCK => pools[at].release(b),
                    _ => {}
                }
            }
            table.resize(end + 1, NO_BLOCK);
            if table[end] == NO_BLOCK {
                match spare.take().or_else(|| take_free(&mut pools[at], at, &mut self.cache, &mut self.spills, groups))
                {
                    Some(b) => table[end] = b,
                    None => return false,
                }
            }
            if let Some(b) = spare {
                pools[at].release(b);
            }
        }
        true
    }

    /// Release `kv`'s span without restoring from it (its row's last state stood).
    pub fn drop_span(&mut self, kv: &mut SeqKv) {
        if let Some(span) = kv.span.take() {
            let mut pools = lock(&self.pools);
            span.slots.iter().for_each(|&b| pools[kv.pool(span.group)].release(b));
        }
    }

    /// Record the cached blocks the pools evict from now on (`take_spills`).
    pub fn keep_spills(&mut self) {
        self.spills.get_or_insert_with(Vec::new);
    }

    /// The cached blocks evicted since the last call (see the module docs).
    pub fn take_spills(&mut self) -> Vec<Spill> {
        self.spills.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// An allocation with no blocks yet, drawing on these pools.
    pub fn new_seq(&self) -> SeqKv {
        self.new_seq_in(0)
    }

    /// An allocation with no blocks yet whose prefix-cache chain starts at `root` (a LoRA
    /// adapter's digest): it shares cached blocks only with sequences of the same root.
    pub fn new_seq_in(&self, root: u64) -> SeqKv {
        SeqKv::new(&self.pools, self.policies.len(), self.state_group(), root)
    }

    /// An allocation with no blocks yet, rooted at `root`, whose KV turns quantized at
    /// position `start` (0: from the start; `NEVER`: it keeps full precision): before it, its
    /// blocks are in the full-precision twin pools. Without twin pools every row's KV is the
    /// cache's own from the start (requests are checked against that first).
    pub fn new_seq_from(&self, root: u64, start: usize) -> SeqKv {
        let mut kv = self.new_seq_in(root);
        if self.twins && start > 0 {
            kv.base = self.policies.len();
            kv.start = start;
        }
        kv
    }

    /// A fresh allocation for what `kv` holds now (same root and start): a preempted or
    /// recomputed sequence starts over in it.
    pub fn fresh(&self, kv: &SeqKv) -> SeqKv {
        self.new_seq_from(kv.root, kv.start)
    }

    pub fn prefix_cache(&self) -> Option<&PrefixCache> {
        self.cache.as_ref()
    }

    /// Free blocks over all groups, and the total.
    pub fn free_blocks(&self) -> (usize, usize) {
        lock(&self.pools).iter().fold((0, 0), |(f, t), p| (f + p.num_free(), t + p.num_blocks()))
    }

    /// Positions the smallest group can hold: the longest sequence that can ever run.
    pub fn capacity_tokens(&self) -> usize {
        self.capacity_of(0)
    }

    /// Positions the smallest group's full-precision twin pool can hold (0 without them).
    pub fn full_precision_capacity_tokens(&self) -> usize {
        if self.twins {
            self.capacity_of(self.policies.len())
        } else {
            0
        }
    }

    /// Positions the smallest group of the pools from `base` on can hold.
    fn capacity_of(&self, base: usize) -> usize {
        let pools = lock(&self.pools);
        let (bs, state) = (self.block_size, self.state_group());
        (self.policies.iter().enumerate())
            .map(|(g, p)| p.capacity_tokens(pools[pool_index(base, state, g)].num_blocks(), bs))
            .min()
            .unwrap_or(0)
    }

    /// Reuse the longest cached prefix of `tokens` (at most `tokens.len() - 1` positions, so
    /// the last one is computed and gives logits). `kv` must hold no blocks. Returns the
    /// number of cached positions. A row before its quantized start takes full-precision
    /// blocks up to its start, or continues a chain that turned quantized at the same start
    /// past it (then it is quantized from the hit on).
    pub fn acquire_prefix(&mut self, kv: &mut SeqKv, tokens: &[u32]) -> usize {
        debug_assert!(kv.is_from(&self.pools) && kv.is_empty(), "a prefix goes into a fresh allocation of this pool");
        let bs = self.block_size;
        let turned = (kv.base != 0 && kv.start != NEVER)
            .then(|| {
                let hashes = self.prefix_hashes(kv.main_root(), tokens);
                let hit = self.hit_len(0, &hashes, tokens);
                (hit * bs >= kv.start && hit > 0).then_some((0, hashes, hit))
            })
            .flatten();
        let (base, hashes, hit) = turned.unwrap_or_else(|| {
            let mut hashes = self.prefix_hashes(kv.chain_root(), tokens);
            if kv.base != 0 {
                // Full-precision blocks hold positions before the start only.
                hashes.truncate(kv.start / bs);
            }
            let hit = self.hit_len(kv.base, &hashes, tokens);
            (kv.base, hashes, hit)
        });
        let Some(cache) = self.cache.as_mut() else { return 0 };
        cache.queried_tokens += tokens.len() as u64;
        cache.hit_tokens += (hit * bs) as u64;
        kv.base = base;
        let mut pools = lock(&self.pools);
        for (g, policy) in self.policies.iter().enumerate() {
            let (first, at) = (policy.first_needed(hit * bs, bs), kv.pool(g));
            for i in 0..hit {
                let id = if i < first { None } else { cache.get(at, hashes[i], &tokens[i * bs..(i + 1) * bs]) };
                if let Some(id) = id {
                    pools[at].retain(id);
                }
                kv.tables[g].push(id.unwrap_or(NO_BLOCK));
            }
        }
        kv.hashes = hashes[..hit].to_vec();
        hit * bs
    }

    /// The longest prefix hit of `hashes` (of `tokens`) the pools from `base` on can serve:
    /// every group's policy bounds it and must serve it.
    fn hit_len(&self, base: usize, hashes: &[u64], tokens: &[u32]) -> usize {
        let Some(cache) = self.cache.as_ref() else { return 0 };
        let (bs, state) = (self.block_size, self.state_group());
        let block =
            |g: usize, i: usize| cache.get(pool_index(base, state, g), hashes[i], &tokens[i * bs..(i + 1) * bs]);
        let mut hit = hashes.len();
        for (g, policy) in self.policies.iter().enumerate() {
            hit = policy.hit_bound(hit, &|i| block(g, i).is_some());
        }
        let served = |hit: usize| {
            (self.policies.iter().enumerate()).all(|(g, p)| p.serves_hit(hit, bs, &|i| block(g, i).is_some()))
        };
        while hit > 0 && !served(hit) {
            hit -= 1;
        }
        hit
    }

    /// The chained hashes of the full blocks of `tokens` in a chain rooted at `root` (0, or an
    /// adapter's digest; `SeqKv::root`), empty without a prefix cache.
    pub fn block_hashes(&self, root: u64, tokens: &[u32]) -> Vec<u64> {
        self.cache.as_ref().map_or_else(Vec::new, |c| c.block_hashes(root, tokens, self.block_size))
    }

    /// The hashes of the blocks of `tokens` a prefix hit may serve: the full blocks short of
    /// the last position (computed for its logits).
    pub fn prefix_hashes(&self, root: u64, tokens: &[u32]) -> Vec<u64> {
        let mut hashes = self.block_hashes(root, tokens);
        hashes.truncate(tokens.len().saturating_sub(1) / self.block_size);
        hashes
    }

    /// How many of the blocks `hashes` (of `tokens`), from the first, every group has cached
    /// (every group but a snapshot group, which caches only some blocks).
    pub fn cached_run(&self, hashes: &[u64], tokens: &[u32]) -> usize {
        let Some(cache) = self.cache.as_ref() else { return 0 };
        let bs = self.block_size;
        let all =
            |i: usize| (self.block_groups()).all(|g| cache.get(g, hashes[i], &tokens[i * bs..(i + 1) * bs]).is_some());
        (0..hashes.len()).take_while(|&i| all(i)).count()
    }

    /// The groups every block below the pool carries: all but a snapshot group.
    fn block_groups(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.policies.len()).filter(|&g| !self.policies[g].snapshots())
    }

    /// Whether the snapshot group caches the state after block `hash` (of `tokens`).
    pub fn caches_snapshot(&self, hash: u64, tokens: &[u32]) -> bool {
        let cache = self.cache.as_ref();
        self.state_group().zip(cache).is_some_and(|(g, c)| c.get(g, hash, tokens).is_some())
    }

    /// Make the cached blocks of `hashes` (of `tokens`) the most recently used of their pools.
    pub fn touch_prefix(&mut self, hashes: &[u64], tokens: &[u32]) {
        let Some(cache) = self.cache.as_ref() else { return };
        let bs = self.block_size;
        let mut pools = lock(&self.pools);
        for (g, pool) in pools.iter_mut().enumerate().take(self.policies.len()) {
            for (i, &h) in hashes.iter().enumerate() {
                if let Some(b) = cache.get(g, h, &tokens[i * bs..(i + 1) * bs]) {
                    pool.retain(b);
                    pool.release(b);
                }
            }
        }
    }

    /// Blocks every group can take for restores: the fewest free blocks of any group a
    /// restored block always fills (a snapshot group's slot is taken for the hit's end only).
    pub fn restorable_blocks(&self) -> usize {
        let pools = lock(&self.pools);
        self.block_groups().map(|g| pools[g].num_free()).min().unwrap_or(0)
    }

    /// Take a free block for a restore of block `hash` (of `tokens`) in each group that does
    /// not cache it already — the snapshot group only when `snapshot` (the restore gives the
    /// state after this block): (group, block) pairs, each owned by the caller until
    /// `finish_restore`. A group without a free block gets none.
    pub fn restore_targets(&mut self, hash: u64, tokens: &[u32], snapshot: bool) -> Vec<(usize, u32)> {
        let Some(cache) = self.cache.as_ref() else { return Vec::new() };
        let wanted = |g: usize| snapshot || !self.policies[g].snapshots();
        let lacking: Vec<usize> =
            (0..self.policies.len()).filter(|&g| wanted(g) && cache.get(g, hash, tokens).is_none()).collect();
        let groups = self.spill_shape();
        let mut pools = lock(&self.pools);
        let mut out = Vec::new();
        for g in lacking {
            if let Some(b) = take_free(&mut pools[g], g, &mut self.cache, &mut self.spills, groups) {
                out.push((g, b));
            }
        }
        out
    }

    /// Register the targets of a restore whose copy in succeeded (`filled[i]` for
    /// `targets[i]`) in the prefix cache, unowned (LRU free blocks the next lookup finds),
    /// and give every target back.
    pub fn finish_restore(&mut self, hash: u64, tokens: &[u32], targets: &[(usize, u32)], filled: &[bool]) {
        let mut pools = lock(&self.pools);
        for (&(g, block), &ok) in targets.iter().zip(filled) {
            if let Some(cache) = self.cache.as_mut() {
                if ok && cache.insert(g, hash, block, tokens) {
                    pools[g].set_hash(block, Some(hash));
                }
            }
            pools[g].release(block);
        }
    }

    /// The block of each group holding full block `i` of `kv` (of `tokens`): its own table
    /// entry, or the cached block a sliding window released; a snapshot group's entry is
    /// `NO_BLOCK` where it keeps no state after this block. `None` when another group's copy
    /// is gone, or the blocks are full-precision ones (tiers hold quantized pools' blocks).
    pub fn block_holders(&self, kv: &SeqKv, i: usize, tokens: &[u32]) -> Option<Vec<u32>> {
        let cache = self.cache.as_ref().filter(|_| !kv.full_precision())?;
        let (bs, hash) = (self.block_size, *kv.hashes.get(i)?);
        let block_tokens = tokens.get(i * bs..(i + 1) * bs)?;
        (kv.tables.iter().enumerate())
            .map(|(g, t)| match (t.get(i), cache.get(g, hash, block_tokens)) {
                (Some(&b), _) if b != NO_BLOCK && !self.policies[g].snapshots() => Some(b),
                (_, None) if self.policies[g].snapshots() => Some(NO_BLOCK),
                (_, cached) => cached,
            })
            .collect()
    }

    /// Grow every table to cover `total` positions; all or nothing. New entries get a block
    /// where their group's policy gives them one (every entry, but for a recurrent group only
    /// snapshot entries and the last, which must hold a block). A row before its quantized
    /// start that `total` takes past it turns quantized (`turn`): its tables move into the
    /// quantized pools, and the conversions of its blocks wait in it (`SeqKv::pending_moves`)
    /// until `end_transition`.
    pub fn allocate(&mut self, kv: &mut SeqKv, total: usize) -> bool {
        debug_assert!(kv.is_from(&self.pools), "an allocation grows from its own pools");
        if kv.base != 0 && total > kv.start {
            return self.turn(kv, total);
        }
        let plan = self.growth(kv, total);
        self.grow(kv, plan)
    }

    /// Per group, the length of `kv`'s table covering `total` positions and the new entries
    /// that get a block (`allocate`).
    pub(super) fn growth(&self, kv: &SeqKv, total: usize) -> Vec<(usize, Vec<usize>)> {
        let bs = self.block_size;
        (self.policies.iter().zip(&kv.tables))
            .map(|(p, t)| {
                let len = p.table_len(total, bs).max(t.len());
                let mut fill: Vec<usize> = (t.len()..len).filter(|&e| p.holds_block(e, len)).collect();
                if p.last_holds_block() && len > 0 && t.get(len - 1) == Some(&NO_BLOCK) {
                    fill.push(len - 1);
                }
                (len, fill)
            })
            .collect()
    }

    /// Grow `kv`'s tables as `plan` (`growth`) says, from the pools they index; all or nothing.
    pub(super) fn grow(&mut self, kv: &mut SeqKv, plan: Vec<(usize, Vec<usize>)>) -> bool {
        let mut pools = lock(&self.pools);
        if plan.iter().enumerate().any(|(g, (_, fill))| pools[kv.pool(g)].num_free() < fill.len()) {
            return false;
        }
        let groups = self.spill_shape();
        for (g, (len, fill)) in plan.into_iter().enumerate() {
            let at = kv.pool(g);
            kv.tables[g].resize(len, NO_BLOCK);
            for e in fill {
                let Some(block) = take_free(&mut pools[at], at, &mut self.cache, &mut self.spills, groups) else {
                    return false;
                };
                kv.tables[g][e] = block;
            }
        }
        true
    }

    /// After `computed` positions of `tokens` are in the cache: register newly full blocks in
    /// the prefix cache, then release blocks the next query no longer reads (a block leaves a
    /// window only after it is full, so it is registered first and stays findable until
    /// evicted).
    pub fn after_step(&mut self, kv: &mut SeqKv, tokens: &[u32], computed: usize) {
        debug_assert!(kv.is_from(&self.pools), "an allocation is stepped by its own manager");
        let bs = self.block_size;
        // A span no verdict rolled back from (its row never reached one) holds nothing needed.
        self.drop_span(kv);
        let mut pools = lock(&self.pools);
        if let Some(cache) = self.cache.as_mut() {
            let root = kv.chain_root();
            while kv.hashes.len() < computed / bs {
                let i = kv.hashes.len();
                let block_tokens = &tokens[i * bs..(i + 1) * bs];
                let h = chain_hash(kv.hashes.last().copied().unwrap_or(root), self.namespace, block_tokens);
                for (g, table) in kv.tables.iter().enumerate() {
                    let (block, at) = (table[i], kv.pool(g));
                    // A snapshot cached under the full-precision chain stays there (a row's
                    // state slots do not turn): its state is that of any start past it.
                    if block != NO_BLOCK && pools[at].hash(block).is_none() && cache.insert(at, h, block, block_tokens)
                    {
                        pools[at].set_hash(block, Some(h));
                    }
                }
                kv.hashes.push(h);
            }
        }
        let (base, state) = (kv.base, kv.state);
        for (g, (policy, table)) in self.policies.iter().zip(kv.tables.iter_mut()).enumerate() {
            for slot in table.iter_mut().take(policy.first_needed(computed, bs)) {
                if *slot != NO_BLOCK {
                    pools[pool_index(base, state, g)].release(*slot);
                    *slot = NO_BLOCK;
                }
            }
        }
    }

    /// Roll `kv` back to its first `len` positions, `computed` of them computed: blocks past
    /// them are released (a rejected verify tail), and a recurrent group's live entry gets the
    /// state after `computed` positions from the span of the verify row (`reserve_span`).
    /// Prefix-cache entries only ever cover committed positions, so none is lost.
    pub fn truncate(&mut self, kv: &mut SeqKv, computed: usize, len: usize) {
        debug_assert!(kv.is_from(&self.pools), "an allocation is rolled back by its own manager");
        let bs = self.block_size;
        debug_assert!(
            kv.base != 0 || kv.start == 0 || len >= kv.start,
            "a quantized row is rolled back past its start"
        );
        let (base, state) = (kv.base, kv.state);
        let mut pools = lock(&self.pools);
        if let Some(Span { group, from, mut slots }) = kv.span.take() {
            let at = pool_index(base, state, group);
            // When the whole span stood, the row's last entry already holds the state.
            if let Some(i) = computed.checked_sub(from + 1).filter(|&i| i < slots.len()) {
                let (slot, e) = (slots.remove(i), (computed - 1) / bs);
                let table = &mut kv.tables[group];
                if table.len() <= e {
                    table.resize(e + 1, NO_BLOCK);
                }
                let old = std::mem::replace(&mut table[e], slot);
                if old != NO_BLOCK {
                    pools[at].release(old);
                }
            }
            slots.iter().for_each(|&b| pools[at].release(b));
        }
        for (g, (policy, table)) in self.policies.iter().zip(kv.tables.iter_mut()).enumerate() {
            let keep = policy.table_len(len, bs).min(table.len());
            for b in table.drain(keep..).filter(|&b| b != NO_BLOCK) {
                pools[pool_index(base, state, g)].release(b);
            }
        }
        kv.hashes.truncate(len / bs);
    }

    /// A new allocation sharing the first `blocks` blocks of `kv` (for forking n > 1
    /// children): each shared block is retained once more. Empty unless every group's policy
    /// shares (a sliding table may have released blocks), and for a row that turned quantized
    /// at a start past the shared blocks (the child computes the positions before its start
    /// at full precision again).
    pub fn share_prefix(&mut self, kv: &SeqKv, blocks: usize) -> SeqKv {
        debug_assert!(kv.is_from(&self.pools), "an allocation is shared within its own pools");
        let mut out = self.fresh(kv);
        let turned_after = kv.base == 0 && blocks * self.block_size < kv.start;
        if !self.policies.iter().all(|p| p.shares_prefix()) || turned_after {
            return out;
        }
        out.base = kv.base;
        let mut pools = lock(&self.pools);
        for (g, table) in kv.tables.iter().enumerate() {
            for &b in table.iter().take(blocks) {
                pools[kv.pool(g)].retain(b);
                out.tables[g].push(b);
            }
        }
        out.hashes = kv.hashes.iter().take(blocks).copied().collect();
        out
    }

    /// Check that every pool's free list agrees with its counts.
    pub fn check_invariants(&self) -> Result<(), String> {
        lock(&self.pools).iter().try_for_each(BlockPool::check_invariants)
    }

    /// Check that every block's count equals the number of table entries of `holders` that
    /// hold it: `holders` must be every live allocation of this manager.
    pub fn check_holders<'a>(&self, holders: impl IntoIterator<Item = &'a SeqKv>) -> Result<(), String> {
        let pools = lock(&self.pools);
        let mut held: Vec<Vec<u32>> = pools.iter().map(|p| vec![0; p.num_blocks()]).collect();
        for kv in holders {
            if !kv.is_from(&self.pools) {
                return Err("an allocation of other pools was counted".into());
            }
            for (g, table) in kv.tables.iter().enumerate() {
                let span = kv.span.as_ref().filter(|s| s.group == g).map_or(&[][..], |s| &s.slots);
                let held = &mut held[kv.pool(g)];
                for &b in table.iter().chain(span).filter(|&&b| b != NO_BLOCK) {
                    *held.get_mut(b as usize).ok_or(format!("group {g} has no block {b}"))? += 1;
                }
            }
            let groups = self.policies.len();
            for &(g, b, _) in &kv.pending {
                let held = held.get_mut(groups + g).and_then(|h| h.get_mut(b as usize));
                *held.ok_or(format!("group {g} has no full-precision block {b}"))? += 1;
            }
        }
        for (g, (pool, held)) in pools.iter().zip(&held).enumerate() {
            if let Some((id, n)) = held.iter().enumerate().find(|&(id, &n)| pool.ref_count(id as u32) != n) {
                return Err(format!("group {g}: block {id} has count {} but {n} holders", pool.ref_count(id as u32)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use ferrite_runtime::kv::KvLayerSpec;
    use ferrite_runtime::KvGroupKind;

    use super::*;

    fn manager(groups: Vec<KvGroupKind>, blocks: usize) -> KvManager {
        let layers = (0..groups.len()).map(|group| KvLayerSpec { n_kv_heads: 1, head_dim: 4, group }).collect();
        let n = groups.len();
        KvManager::new(&KvLayout { groups, layers, states: Vec::new() }, &vec![blocks; n], 4, Some(7))
    }

    #[test]
    fn dropping_an_allocation_mid_generation_returns_every_block() {
        let mut m = manager(vec![KvGroupKind::Full], 16);
        let tokens: Vec<u32> = (1..=14).collect();
        let mut parent = m.new_seq();
        assert!(m.allocate(&mut parent, 14));
        m.after_step(&mut parent, &tokens, 14);
        // A fork shares the first three blocks; the pool counts both holders.
        let child = m.share_prefix(&parent, 3);
        assert_eq!(child.tables(), &[parent.tables()[0][..3].to_vec()]);
        assert_eq!(m.free_blocks(), (12, 16));
        m.check_holders([&parent, &child]).unwrap();
        // Leaving out a holder is caught.
        assert!(m.check_holders([&parent]).is_err());
        // The parent ends mid-generation: only the blocks the child shares stay taken.
        drop(parent);
        assert_eq!(m.free_blocks(), (13, 16));
        m.check_holders([&child]).unwrap();
        drop(child);
        assert_eq!(m.free_blocks(), (16, 16));
        m.check_invariants().unwrap();
        // The released blocks stay cached: a new sequence with the same prefix finds them.
        let mut again = m.new_seq();
        assert_eq!(m.acquire_prefix(&mut again, &tokens), 12);
        m.check_holders([&again]).unwrap();
    }

    #[test]
    fn evicted_cached_blocks_are_recorded_as_spills_with_every_groups_holder() {
        let mut m = manager(vec![KvGroupKind::Full, KvGroupKind::Full], 3);
        m.keep_spills();
        let tokens: Vec<u32> = (1..=8).collect();
        let mut a = m.new_seq();
        assert!(m.allocate(&mut a, 8));
        m.after_step(&mut a, &tokens, 8);
        let held: Vec<Vec<u32>> = a.tables().to_vec();
        drop(a);
        // Three fresh blocks per group take the free list: the two cached blocks of each group
        // are evicted, each recorded once with both groups' holders.
        let mut b = m.new_seq();
        assert!(m.allocate(&mut b, 12));
        let spills = m.take_spills();
        assert_eq!(spills.len(), 2, "{spills:?}");
        assert_eq!(spills[0].tokens, tokens[..4]);
        assert_eq!(spills[0].holders, vec![held[0][0], held[1][0]]);
        assert_eq!(spills[1].holders, vec![held[0][1], held[1][1]]);
        assert!(m.take_spills().is_empty());
        drop(b);
        // A restore takes free blocks, and registers only what was filled.
        let h = m.block_hashes(0, &tokens)[0];
        let targets = m.restore_targets(h, &tokens[..4], true);
        assert_eq!(targets.len(), 2);
        m.finish_restore(h, &tokens[..4], &targets, &[true, false]);
        let c = m.prefix_cache().expect("cache");
        assert!(c.get(0, h, &tokens[..4]).is_some() && c.get(1, h, &tokens[..4]).is_none());
        m.check_invariants().unwrap();
    }

    #[test]
    fn a_verify_span_rolls_the_recurrent_state_back_to_the_accepted_length() {
        let mut m = manager(vec![KvGroupKind::Full, KvGroupKind::Recurrent], 32);
        let tokens: Vec<u32> = (1..=20).collect();
        let mut kv = m.new_seq();
        // Ten positions computed: the state after them is in entry 2 (positions 8..10).
        assert!(m.allocate(&mut kv, 10));
        m.after_step(&mut kv, &tokens, 10);
        let live = kv.tables()[1][2];
        assert_eq!(kv.tables()[1][..2], [NO_BLOCK, NO_BLOCK], "entries before the live one are released");
        // A verify row [pending, d1, d2, d3] at positions 10..14: three span slots.
        for (used, want) in [(0usize, 0usize), (1, 1), (2, 2), (3, 3)] {
            let mut kv2 = m.new_seq();
            assert!(m.allocate(&mut kv2, 10));
            m.after_step(&mut kv2, &tokens, 10);
            assert!(m.allocate(&mut kv2, 14));
            assert!(m.reserve_span(&mut kv2, 10, 3));
            let span = kv2.span_states().to_vec();
            let end = kv2.tables()[1][3];
            m.check_holders([&kv, &kv2]).unwrap();
            // The pending token and `used` drafts stood.
            let computed = 11 + used;
            m.truncate(&mut kv2, computed, computed + 1);
            let holder = kv2.tables()[1][(computed - 1) / 4];
            let expect = if want < 3 { span[want] } else { end };
            assert_eq!(holder, expect, "{used} accepted: the state after {computed} positions");
            assert!(kv2.span_states().is_empty());
            m.after_step(&mut kv2, &tokens, computed);
            m.check_holders([&kv, &kv2]).unwrap();
        }
        assert_eq!(kv.tables()[1][2], live);
        // Without free slots no span is taken.
        let mut kv3 = m.new_seq();
        assert!(!m.reserve_span(&mut kv3, 0, 1000));
        drop((kv, kv3));
        assert_eq!(m.free_blocks(), (64, 64));
        m.check_invariants().unwrap();
    }

    #[test]
    fn a_sliding_group_releases_what_left_the_window_and_the_rest_on_drop() {
        let mut m = manager(vec![KvGroupKind::Full, KvGroupKind::Sliding { window: 8 }], 16);
        let tokens: Vec<u32> = (1..=24).collect();
        let mut kv = m.new_seq();
        assert!(m.allocate(&mut kv, 24));
        m.after_step(&mut kv, &tokens, 24);
        // Position 24 reads 17..=24: the sliding table keeps blocks 4 and 5 of six.
        assert_eq!(kv.tables()[1].iter().filter(|&&b| b != NO_BLOCK).count(), 2);
        assert_eq!(m.free_blocks(), (32 - 6 - 2, 32));
        m.check_holders([&kv]).unwrap();
        // No fork shares a sliding table.
        assert!(m.share_prefix(&kv, 4).is_empty());
        m.truncate(&mut kv, 17, 17);
        assert_eq!(m.free_blocks(), (32 - 5 - 1, 32));
        m.check_holders([&kv]).unwrap();
        drop(kv);
        assert_eq!(m.free_blocks(), (32, 32));
        m.check_invariants().unwrap();
    }
}
