//! `KvTier`: a store of full KV blocks below the pool, addressed by chained block hash.
//!
//! Lookup goes pool first, then each tier in order (a host-RAM tier for device pools would
//! sit before the SSD tier, `kv/disk`); the longest run of blocks found wins. A tier never
//! hands blocks to a sequence itself: what it `fetch`es (read ahead, on its own thread, when
//! a request arrives) the engine copies into pool blocks and registers in the prefix cache
//! just before the scheduler looks the request up, so a restored prefix is served by the same
//! path as any pool hit. Stores go through a bounded queue: `reserve` refuses, rather than
//! waits, when the tier's writer is behind.

use std::sync::mpsc::Receiver;

/// Blocks a tier read back: `blocks[j]` is block `first + j` of the sequence, every group's
/// bytes in group order (`KvCache::copy_block_out`), checked against the hashes and tokens
/// it was asked for.
#[derive(Debug, Default)]
pub struct Restored {
    pub first: usize,
    pub blocks: Vec<Vec<u8>>,
}

pub trait KvTier: Send {
    /// The tier's name in usage and metrics.
    fn name(&self) -> &'static str;

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

    /// Reserve room in the write queue for `bytes`; false (and the store dropped) when the
    /// writer is behind.
    fn reserve(&self, bytes: u64) -> bool;

    /// Store a run of consecutive blocks (`payload`: each block's bytes, in order) for which
    /// `reserved` bytes were reserved.
    fn store(&self, hashes: Vec<u64>, tokens: Vec<u32>, payload: Vec<u8>, reserved: u64);
}
