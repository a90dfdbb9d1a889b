//! `KvTier`: a store of full KV blocks below the pool, addressed by chained block hash.
//!
//! Lookup goes pool first, then each tier in order — the host-RAM tier (`kv/host.rs`, GPU
//! pools) before the SSD tier (`kv/disk`); the longest run of blocks found wins. A tier never
//! hands blocks to a sequence itself: what it `fetch`es (read ahead, on the SSD tier's own
//! thread, when a request arrives; at once from host RAM) the engine copies into pool blocks
//! and registers in the prefix cache just before the scheduler looks the request up, so a
//! restored prefix is served by the same path as any pool hit.

use std::sync::mpsc::Receiver;

/// Which tier a block came from (usage and metrics count tokens by tier).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierKind {
    Host = 0,
    Ssd = 1,
}

/// Where the bytes of a block a tier found are, and whether it carries the state snapshot
/// after it (a model with recurrent state; `kv/tier_slots.rs`).
#[derive(Debug)]
pub enum BlockData {
    /// Read into memory (the SSD tier): the block's bytes as `TierSlots` hold them — every
    /// group's but the snapshot group's, in group order, then the snapshot's where `state`.
    Bytes { bytes: Vec<u8>, state: bool },
    /// In the host tier's own slots, looked up again (hash and tokens) when copied in.
    Held { state: bool },
}

impl BlockData {
    /// Whether the tier holds the state snapshot after this block.
    pub fn has_state(&self) -> bool {
        match *self {
            BlockData::Bytes { state, .. } | BlockData::Held { state } => state,
        }
    }
}

/// Blocks a tier found: `blocks[j]` is block `first + j` of the sequence, checked against
/// the hashes and tokens it was asked for.
#[derive(Debug, Default)]
pub struct Restored {
    pub first: usize,
    pub blocks: Vec<BlockData>,
}

pub trait KvTier: Send {
    fn kind(&self) -> TierKind;

    /// Whether the tier holds (or is about to hold) the block `hash`.
    fn holds(&self, hash: u64) -> bool;

    /// How many of `hashes`, from the first, the tier holds.
    fn run_len(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|&&h| self.holds(h)).count()
    }

    /// Start reading blocks `first ..` of a sequence, whose chained hashes are `hashes` and
    /// whose tokens are `tokens` (`block_size` each); the blocks that were found intact, from
    /// the first, arrive on the receiver.
    fn fetch(&self, first: usize, hashes: Vec<u64>, tokens: Vec<u32>) -> Option<Receiver<Restored>>;
}
