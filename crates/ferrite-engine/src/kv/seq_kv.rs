//! `SeqKv`: one sequence's KV allocation, an owned value.
//!
//! It holds a block table per KV group and a handle to the pools its blocks came from.
//! It cannot be cloned, and the only way its blocks go back is by ownership: dropping it (or
//! overwriting it with a fresh one) releases every block it holds into its own pools, and
//! rollback goes through the `KvManager` that made it. No copy of its tables that could free
//! or outlive a block exists — a fork or a prefix hit gets its own `SeqKv` whose blocks the
//! manager retained (reference counts), and the rows of a model step carry plain block ids,
//! copied from the read-only view `tables()`.
//!
//! ```
//! fn owns(kv: ferrite_engine::kv::SeqKv) -> bool { kv.is_empty() }
//! ```
//! ```compile_fail
//! fn copies(kv: &ferrite_engine::kv::SeqKv) -> ferrite_engine::kv::SeqKv { kv.clone() }
//! ```

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use ferrite_runtime::batch::NO_BLOCK;

use super::block_pool::BlockPool;

/// The block pools of one `KvManager`, one per KV group, shared with the allocations made
/// from them so that dropping an allocation returns its blocks.
pub(super) type SharedPools = Arc<Mutex<Vec<BlockPool>>>;

/// Lock `pools`. The engine thread is the only one that uses them; a panic elsewhere while
/// they were held cannot have left a block half released (every update is one count), so a
/// poisoned lock is taken as it is.
pub(super) fn lock(pools: &SharedPools) -> MutexGuard<'_, Vec<BlockPool>> {
    pools.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One sequence's blocks: a table per KV group (`NO_BLOCK` where a sliding window released
/// one), and the chained hashes of its full blocks, whose chain starts at `root` (0 for the
/// base model, the adapter's digest for a sequence run through a LoRA adapter: its KV differs).
pub struct SeqKv {
    pub(super) pools: SharedPools,
    pub(super) tables: Vec<Vec<u32>>,
    pub(super) hashes: Vec<u64>,
    pub(super) root: u64,
    /// The per-token state slots of the verify row being run, if any.
    pub(super) span: Option<Span>,
}

/// A verify row's state slots in a recurrent group: slot `i` receives the state after position
/// `from + 1 + i`, so a rollback to any accepted length finds its state (`KvManager::truncate`).
#[derive(Debug)]
pub(super) struct Span {
    pub group: usize,
    pub from: usize,
    pub slots: Vec<u32>,
}

impl SeqKv {
    pub(super) fn new(pools: &SharedPools, groups: usize, root: u64) -> SeqKv {
        SeqKv { pools: pools.clone(), tables: vec![Vec::new(); groups], hashes: Vec::new(), root, span: None }
    }

    /// The state slots a verify row writes after each of its query tokens but the last
    /// (`RowSpan::span_states`); empty without a span.
    pub fn span_states(&self) -> &[u32] {
        self.span.as_ref().map_or(&[], |s| &s.slots)
    }

    /// Where its prefix-cache hash chain starts (what computes its KV besides the model).
    pub fn root(&self) -> u64 {
        self.root
    }

    /// The block tables, one per group, read-only: what a row of a model step is given.
    pub fn tables(&self) -> &[Vec<u32>] {
        &self.tables
    }

    /// The chained hashes of the full blocks computed so far.
    pub fn hashes(&self) -> &[u64] {
        &self.hashes
    }

    pub fn is_empty(&self) -> bool {
        self.tables.iter().all(Vec::is_empty) && self.span.is_none()
    }

    /// Whether this allocation's blocks come from `pools`.
    pub(super) fn is_from(&self, pools: &SharedPools) -> bool {
        Arc::ptr_eq(&self.pools, pools)
    }
}

impl Drop for SeqKv {
    /// Release every block into the pools it came from (cached ones stay findable until
    /// evicted).
    fn drop(&mut self) {
        let mut pools = lock(&self.pools);
        for (pool, table) in pools.iter_mut().zip(&self.tables) {
            for &b in table.iter().filter(|&&b| b != NO_BLOCK) {
                pool.release(b);
            }
        }
        if let Some(span) = &self.span {
            for &b in &span.slots {
                pools[span.group].release(b);
            }
        }
    }
}

impl fmt::Debug for SeqKv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SeqKv").field("tables", &self.tables).field("hashes", &self.hashes).finish()
    }
}
