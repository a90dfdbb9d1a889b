//! The host-RAM tier of the prefix cache (`--host-cache-memory BYTES`, for GPU pools):
//! whole KV blocks the device pool evicted from its prefix cache, kept in page-locked host
//! memory (`TierSlots`) instead of being dropped, least recently used going first.
//!
//! - **Saves** come from the pool's eviction hook (`KvManager::take_spills`): before the next
//!   write that could overwrite an evicted block (a step, a restore), the engine hands each
//!   evicted block here, and the copy is queued on the cache's copy stream (a memcpy for a
//!   host pool). A block whose every group the pool still caches is saved whole; one the tier
//!   holds already only counts as used.
//! - **State snapshots** (a model with recurrent state): a spilled block that carries the
//!   snapshot after it has it saved too, into a snapshot slot of its own; blocks and snapshots
//!   are two LRU stores under the same chained hashes (a snapshot is as large as many blocks).
//!   The budget is split as the pool's: one snapshot per `stride` blocks.
//! - **Hits**: the tier answers lookups from memory; `fetch` marks the run it holds (and
//!   which of its blocks have a snapshot), and the engine looks each block up again (`place_of`,
//!   hash and tokens) as it copies it in through `install_restores`, so a block this tier
//!   evicted in between is a plain miss.
//! - Memory is taken as slots are first written, up to the budget.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc;
use std::sync::Arc;

use ferrite_runtime::batch::NO_BLOCK;
use ferrite_runtime::KvCache;

use super::manager::Spill;
use super::tier::{BlockData, KvTier, Restored, TierKind};
use super::tier_slots::{Place, TierSlots};
use crate::metrics::Metrics;

struct Entry {
    slot: usize,
    tokens: Vec<u32>,
    /// Position in the LRU order (`Lru::order`).
    stamp: u64,
}

/// Slots of one kind (blocks, or snapshots) by chained hash, least recently used first.
struct Lru {
    entries: HashMap<u64, Entry>,
    /// Stamp → hash, oldest first.
    order: BTreeMap<u64, u64>,
    clock: u64,
    /// Slots given back (a save failed).
    free: Vec<usize>,
    /// Slots never used yet start here.
    unused: usize,
    slots: usize,
}

impl Lru {
    fn new(slots: usize) -> Lru {
        Lru { entries: HashMap::new(), order: BTreeMap::new(), clock: 0, free: Vec::new(), unused: 0, slots }
    }

    /// The slot of `hash` if it holds `tokens`.
    fn get(&self, hash: u64, tokens: &[u32]) -> Option<usize> {
        self.entries.get(&hash).filter(|e| e.tokens == tokens).map(|e| e.slot)
    }

    fn touch(&mut self, hash: u64) {
        let Some(e) = self.entries.get_mut(&hash) else { return };
        self.order.remove(&e.stamp);
        self.clock += 1;
        e.stamp = self.clock;
        self.order.insert(self.clock, hash);
    }

    /// A slot for a new entry: an unused one, a freed one, or the least recently used
    /// entry's (true: an entry was evicted).
    fn take_slot(&mut self) -> Option<(usize, bool)> {
        if let Some(s) = self.free.pop() {
            return Some((s, false));
        }
        if self.unused < self.slots {
            self.unused += 1;
            return Some((self.unused - 1, false));
        }
        let (_, hash) = self.order.pop_first()?;
        Some((self.entries.remove(&hash)?.slot, true))
    }

    fn insert(&mut self, hash: u64, tokens: Vec<u32>, slot: usize) {
        self.clock += 1;
        self.entries.insert(hash, Entry { slot, tokens, stamp: self.clock });
        self.order.insert(self.clock, hash);
    }
}

pub struct HostTier {
    mem: TierSlots,
    blocks: Lru,
    states: Lru,
    metrics: Arc<Metrics>,
}

/// A spilled block or snapshot being saved: its hash, tokens and slot.
type Saved = (u64, Vec<u32>, usize);

impl HostTier {
    /// A tier over `mem` (`TierSlots`, sized by the budget).
    pub fn new(mem: TierSlots, metrics: Arc<Metrics>) -> HostTier {
        let capacity = mem.blocks.slots() * mem.block_bytes() + mem.state_slots() * mem.state_bytes();
        metrics.host_capacity_bytes.store(capacity as u64, Relaxed);
        let (blocks, states) = (Lru::new(mem.blocks.slots()), Lru::new(mem.state_slots()));
        HostTier { mem, blocks, states, metrics }
    }

    /// The memory the tier's blocks are in.
    pub fn mem(&self) -> &TierSlots {
        &self.mem
    }

    /// Keep the blocks the pool evicted (`spills`: each block's hash, tokens and the pool block
    /// `holders[g]` of each group `g`, a snapshot group's `NO_BLOCK` where it kept none): their
    /// bytes are copied (queued, for a device pool) into slots, in one batch. A block or
    /// snapshot the tier holds already only counts as used.
    pub fn save(&mut self, kv: &KvCache, spills: Vec<Spill>) {
        let (mut blocks, mut states): (Vec<Saved>, Vec<Saved>) = (Vec::new(), Vec::new());
        let mut moves = Vec::new();
        let state_group = self.mem.state_group().filter(|_| self.mem.state_slots() > 0);
        for s in spills {
            let fresh =
                |lru: &Lru, saved: &[Saved]| !lru.entries.contains_key(&s.hash) && saved.iter().all(|x| x.0 != s.hash);
            let mut place = Place::default();
            if fresh(&self.blocks, &blocks) {
                let Some((slot, evicted)) = self.blocks.take_slot() else { break };
                if evicted {
                    self.metrics.host_evicted_blocks.fetch_add(1, Relaxed);
                }
                place.block = Some(slot);
                blocks.push((s.hash, s.tokens.clone(), slot));
            }
            let has_state = state_group.is_some_and(|g| s.holders[g] != NO_BLOCK);
            if has_state && fresh(&self.states, &states) {
                if let Some((slot, _)) = self.states.take_slot() {
                    place.state = Some(slot);
                    states.push((s.hash, s.tokens.clone(), slot));
                }
            }
            self.blocks.touch(s.hash);
            self.states.touch(s.hash);
            let held: Vec<(usize, u32)> =
                (s.holders.iter().copied().enumerate()).filter(|&(_, b)| b != NO_BLOCK).collect();
            moves.extend(self.mem.moves(&held, place));
        }
        let m = &self.metrics;
        if self.mem.save(kv, &moves).is_err() {
            self.blocks.free.extend(blocks.iter().map(|b| b.2));
            self.states.free.extend(states.iter().map(|b| b.2));
            m.host_failed_saves.fetch_add(blocks.len() as u64, Relaxed);
            return;
        }
        let written = blocks.len() * self.mem.block_bytes() + states.len() * self.mem.state_bytes();
        m.host_written_bytes.fetch_add(written as u64, Relaxed);
        for (hash, tokens, slot) in blocks {
            self.blocks.insert(hash, tokens, slot);
        }
        for (hash, tokens, slot) in states {
            self.states.insert(hash, tokens, slot);
        }
        m.host_blocks.store(self.blocks.entries.len() as u64, Relaxed);
        let bytes =
            self.blocks.entries.len() * self.mem.block_bytes() + self.states.entries.len() * self.mem.state_bytes();
        m.host_bytes.store(bytes as u64, Relaxed);
    }

    /// Where block `hash` holding `tokens` is (its slot, and its snapshot's), each made the
    /// most recently used.
    pub fn place_of(&mut self, hash: u64, tokens: &[u32]) -> Place {
        let place = Place { block: self.blocks.get(hash, tokens), state: self.states.get(hash, tokens) };
        self.blocks.touch(hash);
        self.states.touch(hash);
        place
    }

    /// Whether the tier holds the snapshot after block `hash` holding `tokens`.
    pub fn holds_state(&self, hash: u64, tokens: &[u32]) -> bool {
        self.states.get(hash, tokens).is_some()
    }
}

impl KvTier for HostTier {
    fn kind(&self) -> TierKind {
        TierKind::Host
    }

    fn holds(&self, hash: u64) -> bool {
        self.blocks.entries.contains_key(&hash)
    }

    /// The run held, from the first block, with its tokens checked: ready at once.
    fn fetch(&self, first: usize, hashes: Vec<u64>, tokens: Vec<u32>) -> Option<mpsc::Receiver<Restored>> {
        let bs = tokens.len().checked_div(hashes.len()).unwrap_or(0);
        let block = |j: usize| &tokens[j * bs..(j + 1) * bs];
        let held = (hashes.iter().enumerate()).take_while(|&(j, &h)| self.blocks.get(h, block(j)).is_some()).count();
        let blocks = (0..held).map(|j| BlockData::Held { state: self.holds_state(hashes[j], block(j)) }).collect();
        let (tx, rx) = mpsc::channel();
        tx.send(Restored { first, blocks }).ok()?;
        Some(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrite_runtime::kv::KvLayerSpec;
    use ferrite_runtime::kv_state::StateSpec;
    use ferrite_runtime::{KvGroupKind, KvLayout};

    fn spill(hash: u64, tokens: [u32; 2], holders: &[u32]) -> Spill {
        Spill { hash, tokens: tokens.to_vec(), holders: holders.to_vec() }
    }

    fn fetched(tier: &HostTier, hashes: Vec<u64>, tokens: Vec<u32>) -> Vec<bool> {
        let got = tier.fetch(0, hashes, tokens).and_then(|rx| rx.recv().ok()).expect("fetched");
        got.blocks.iter().map(BlockData::has_state).collect()
    }

    #[test]
    fn the_least_recently_used_block_goes_first_and_a_slot_serves_only_its_tokens() {
        let layout = KvLayout::uniform(2, 1, 4, KvGroupKind::Full);
        let kv = KvCache::new(&layout, &[4], 2).expect("cache");
        let metrics = Arc::new(Metrics::default());
        let mut tier = HostTier::new(TierSlots::new(&kv, None, 2, 0).expect("host"), metrics.clone());
        tier.save(&kv, vec![spill(1, [1, 2], &[0]), spill(2, [3, 4], &[1])]);
        assert_eq!(tier.place_of(1, &[1, 2]).block, Some(0), "1 is now the most recent");
        assert_eq!(tier.place_of(1, &[9, 9]), Place::default(), "another block's tokens under the hash");
        tier.save(&kv, vec![spill(3, [5, 6], &[2])]);
        assert!(!tier.holds(2) && tier.holds(1) && tier.holds(3));
        assert_eq!(metrics.host_evicted_blocks.load(Relaxed), 1);
        assert_eq!(tier.run_len(&[1, 3, 2]), 2);
        let got = tier.fetch(5, vec![1, 3], vec![1, 2, 5, 7]).and_then(|rx| rx.recv().ok()).expect("fetched");
        assert_eq!((got.first, got.blocks.len()), (5, 1), "block 3's tokens differ");
    }

    #[test]
    fn snapshots_are_kept_beside_their_blocks_in_slots_of_their_own() {
        let layout = KvLayout {
            groups: vec![KvGroupKind::Full, KvGroupKind::Recurrent],
            layers: vec![KvLayerSpec { n_kv_heads: 1, head_dim: 4, group: 0 }],
            states: vec![StateSpec { conv_channels: 2, conv_kernel: 2, heads: 1, k_dim: 2, v_dim: 2, group: 1 }],
        };
        let mut kv = KvCache::new(&layout, &[4, 3], 2).expect("cache");
        kv.state_mut(0).expect("state").ssm_mut(2).expect("slot").fill(7.0);
        let metrics = Arc::new(Metrics::default());
        let mut tier = HostTier::new(TierSlots::new(&kv, Some(1), 3, 1).expect("host"), metrics.clone());
        // Block 1 spilled without its snapshot, block 2 with it (state slot 2 of the pool).
        tier.save(&kv, vec![spill(1, [1, 2], &[0, NO_BLOCK]), spill(2, [3, 4], &[1, 2])]);
        assert_eq!(fetched(&tier, vec![1, 2], vec![1, 2, 3, 4]), [false, true]);
        let (block, state) = (kv.group_block_bytes(0) as u64, kv.group_block_bytes(1) as u64);
        assert_eq!(metrics.host_bytes.load(Relaxed), 2 * block + state);
        assert_eq!(metrics.host_capacity_bytes.load(Relaxed), 3 * block + state);
        // The snapshot comes back into another slot.
        let place = tier.place_of(2, &[3, 4]);
        assert_eq!(place, Place { block: Some(1), state: Some(0) });
        tier.mem().load(&mut kv, &tier.mem().moves(&[(1, 0)], place)).expect("load");
        assert!(kv.state_mut(0).expect("state").ssm(0).expect("slot").iter().all(|&x| x == 7.0));
        // A block already held gains its snapshot later; one snapshot slot: the older one goes.
        tier.save(&kv, vec![spill(1, [1, 2], &[3, 1])]);
        assert_eq!(fetched(&tier, vec![1, 2], vec![1, 2, 3, 4]), [true, false]);
        assert_eq!(metrics.host_blocks.load(Relaxed), 2);
    }
}
