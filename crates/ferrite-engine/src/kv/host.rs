//! The host-RAM tier of the prefix cache (`--host-cache-memory BYTES`, for GPU pools):
//! whole KV blocks the device pool evicted from its prefix cache, kept in page-locked host
//! memory (`HostBlocks`) instead of being dropped, least recently used going first.
//!
//! - **Saves** come from the pool's eviction hook (`KvManager::take_spills`): before the next
//!   write that could overwrite an evicted block (a step, a restore), the engine hands each
//!   evicted block here, and the copy is queued on the cache's copy stream (a memcpy for a
//!   host pool). A block whose every group the pool still caches is saved whole; one the tier
//!   holds already only counts as used.
//! - **Hits**: the tier answers lookups from memory; `fetch` marks the run it holds, and the
//!   engine looks each block up again (`slot_of`, hash and tokens) as it copies it in through
//!   `install_restores`, so a block this tier evicted in between is a plain miss.
//! - Memory is taken as slots are first written, up to the budget.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc;
use std::sync::Arc;

use ferrite_runtime::{BlockMove, HostBlocks, KvCache};

use super::manager::Spill;
use super::tier::{BlockData, KvTier, Restored, TierKind};
use crate::metrics::Metrics;

struct Entry {
    slot: usize,
    tokens: Vec<u32>,
    /// Position in the LRU order (`HostTier::lru`).
    stamp: u64,
}

pub struct HostTier {
    mem: HostBlocks,
    entries: HashMap<u64, Entry>,
    /// Stamp → hash, oldest first.
    lru: BTreeMap<u64, u64>,
    clock: u64,
    /// Slots given back (their entry evicted or a save failed).
    free: Vec<usize>,
    /// Slots never used yet start here.
    unused: usize,
    metrics: Arc<Metrics>,
}

impl HostTier {
    /// A tier over `mem` (from `KvCache::host_blocks`, sized by the budget).
    pub fn new(mem: HostBlocks, metrics: Arc<Metrics>) -> HostTier {
        metrics.host_capacity_bytes.store((mem.slots() * mem.slot_bytes()) as u64, Relaxed);
        HostTier { mem, entries: HashMap::new(), lru: BTreeMap::new(), clock: 0, free: Vec::new(), unused: 0, metrics }
    }

    /// The memory the tier's blocks are in.
    pub fn mem(&self) -> &HostBlocks {
        &self.mem
    }

    fn touch(&mut self, hash: u64) {
        let Some(e) = self.entries.get_mut(&hash) else { return };
        self.lru.remove(&e.stamp);
        self.clock += 1;
        e.stamp = self.clock;
        self.lru.insert(self.clock, hash);
    }

    /// A slot for a new block: an unused one, a freed one, or the least recently used
    /// block's.
    fn take_slot(&mut self) -> Option<usize> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        if self.unused < self.mem.slots() {
            self.unused += 1;
            return Some(self.unused - 1);
        }
        let (_, hash) = self.lru.pop_first()?;
        let e = self.entries.remove(&hash)?;
        self.metrics.host_evicted_blocks.fetch_add(1, Relaxed);
        Some(e.slot)
    }

    /// Keep the blocks the pool evicted (`spills`: each block's hash, tokens and the pool block
    /// `holders[g]` of each group `g`): their bytes are copied (queued, for a device pool) into
    /// slots, in one batch. A block the tier holds already only counts as used.
    pub fn save(&mut self, kv: &KvCache, spills: Vec<Spill>) {
        let mut saved = Vec::new();
        let mut moves = Vec::new();
        for s in spills {
            if self.entries.contains_key(&s.hash) || saved.iter().any(|(h, _, _)| *h == s.hash) {
                self.touch(s.hash);
                continue;
            }
            let Some(slot) = self.take_slot() else { break };
            moves.extend(s.holders.iter().enumerate().map(|(group, &b)| BlockMove { group, block: b as usize, slot }));
            saved.push((s.hash, s.tokens, slot));
        }
        if kv.save_blocks(&moves, &mut self.mem).is_err() {
            self.free.extend(saved.iter().map(|&(_, _, slot)| slot));
            self.metrics.host_failed_saves.fetch_add(saved.len() as u64, Relaxed);
            return;
        }
        let m = &self.metrics;
        for (hash, tokens, slot) in saved {
            self.clock += 1;
            self.entries.insert(hash, Entry { slot, tokens, stamp: self.clock });
            self.lru.insert(self.clock, hash);
            m.host_written_bytes.fetch_add(self.mem.slot_bytes() as u64, Relaxed);
        }
        m.host_blocks.store(self.entries.len() as u64, Relaxed);
        m.host_bytes.store((self.entries.len() * self.mem.slot_bytes()) as u64, Relaxed);
    }

    /// The slot of block `hash` if it holds `tokens`, made the most recently used.
    pub fn slot_of(&mut self, hash: u64, tokens: &[u32]) -> Option<usize> {
        let slot = self.entries.get(&hash).filter(|e| e.tokens == tokens)?.slot;
        self.touch(hash);
        Some(slot)
    }
}

impl KvTier for HostTier {
    fn kind(&self) -> TierKind {
        TierKind::Host
    }

    fn holds(&self, hash: u64) -> bool {
        self.entries.contains_key(&hash)
    }

    /// The run held, from the first block, with its tokens checked: ready at once.
    fn fetch(&self, first: usize, hashes: Vec<u64>, tokens: Vec<u32>) -> Option<mpsc::Receiver<Restored>> {
        let bs = tokens.len().checked_div(hashes.len()).unwrap_or(0);
        let held = (hashes.iter().enumerate())
            .take_while(|&(j, h)| self.entries.get(h).is_some_and(|e| e.tokens[..] == tokens[j * bs..(j + 1) * bs]))
            .count();
        let (tx, rx) = mpsc::channel();
        tx.send(Restored { first, blocks: (0..held).map(|_| BlockData::Held).collect() }).ok()?;
        Some(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrite_runtime::KvLayout;

    #[test]
    fn the_least_recently_used_block_goes_first_and_a_slot_serves_only_its_tokens() {
        let layout = KvLayout::uniform(2, 1, 4, ferrite_runtime::KvGroupKind::Full);
        let kv = KvCache::new(&layout, &[4], 2).expect("cache");
        let metrics = Arc::new(Metrics::default());
        let mut tier = HostTier::new(kv.host_blocks(2).expect("host"), metrics.clone());
        let spill = |hash, tokens: [u32; 2], block| Spill { hash, tokens: tokens.to_vec(), holders: vec![block] };
        tier.save(&kv, vec![spill(1, [1, 2], 0), spill(2, [3, 4], 1)]);
        assert_eq!(tier.slot_of(1, &[1, 2]), Some(0), "1 is now the most recent");
        assert_eq!(tier.slot_of(1, &[9, 9]), None, "another block's tokens under the hash");
        tier.save(&kv, vec![spill(3, [5, 6], 2)]);
        assert!(!tier.holds(2) && tier.holds(1) && tier.holds(3));
        assert_eq!(metrics.host_evicted_blocks.load(Relaxed), 1);
        assert_eq!(tier.run_len(&[1, 3, 2]), 2);
        let got = tier.fetch(5, vec![1, 3], vec![1, 2, 5, 7]).and_then(|rx| rx.recv().ok()).expect("fetched");
        assert_eq!((got.first, got.blocks.len()), (5, 1), "block 3's tokens differ");
    }
}
