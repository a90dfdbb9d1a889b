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
//! Under a quantized cache with a delayed start, an allocation also knows its precision: its
//! tables index the cache's own pools or, before its quantized start, the full-precision twin
//! pools (`full_precision()`); at the transition the manager gives it new tables and it holds
//! the twin blocks (`pending`) until their values were converted. A recurrent group's state
//! slots have no twins: its table indexes the group's own pool on both sides of the start
//! (`pool`), and keeps its slots through the transition.
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
use super::prefix_cache::chain_hash;

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
/// base model, the adapter's digest for a sequence run through a LoRA adapter: its KV differs)
/// mixed with its precision (`chain_root`).
pub struct SeqKv {
    pub(super) pools: SharedPools,
    pub(super) tables: Vec<Vec<u32>>,
    pub(super) hashes: Vec<u64>,
    pub(super) root: u64,
    /// The first of the pools its tables index: 0 (the cache's own) or the number of groups
    /// (the full-precision twins); a recurrent group's table always indexes its own (`pool`).
    pub(super) base: usize,
    /// The recurrent group, whose state slots have no twins (`KvManager::state_group`).
    pub(super) state: Option<usize>,
    /// The position its KV turns quantized at: 0 from the start, `NEVER` for a full-precision
    /// row of a quantized cache.
    pub(super) start: usize,
    /// Twin blocks its tables were converted from, held until their values are copied:
    /// (group, twin block, block).
    pub(super) pending: Vec<(usize, u32, u32)>,
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

/// A quantized start no row reaches: the row keeps full-precision KV.
pub const NEVER: usize = usize::MAX;

/// Tag of the full-precision twin pools' chains.
const FULL_PRECISION: u64 = 0x0066_756c_6c5f_6b76;

/// The pool of group `g`'s blocks for tables based at `base` (0 or the number of groups): a
/// recurrent group (`state`) has no full-precision twin, its state slots stay in its own pool.
pub(super) fn pool_index(base: usize, state: Option<usize>, g: usize) -> usize {
    if Some(g) == state {
        g
    } else {
        base + g
    }
}

/// The prefix-cache chain root of blocks of a sequence rooted at `root`: in the twin pools
/// (`full_precision`), one chain for every start (a position before any start is computed
/// the same way); in the cache's own pools, a chain per start (0 keeps `root` itself: a cache
/// without a delayed start keeps its chains).
pub(super) fn chain_root(root: u64, full_precision: bool, start: usize) -> u64 {
    match (full_precision, start) {
        (true, _) => chain_hash(root, FULL_PRECISION, &[]),
        (false, 0) => root,
        (false, n) => chain_hash(root, n as u64, &[]),
    }
}

impl SeqKv {
    pub(super) fn new(pools: &SharedPools, groups: usize, state: Option<usize>, root: u64) -> SeqKv {
        SeqKv {
            pools: pools.clone(),
            tables: vec![Vec::new(); groups],
            hashes: Vec::new(),
            root,
            base: 0,
            state,
            start: 0,
            pending: Vec::new(),
            span: None,
        }
    }

    /// The pool group `g`'s table indexes now (`pool_index`).
    pub(super) fn pool(&self, g: usize) -> usize {
        pool_index(self.base, self.state, g)
    }

    /// The state slots a verify row writes after each of its query tokens but the last
    /// (`RowSpan::span_states`); empty without a span.
    pub fn span_states(&self) -> &[u32] {
        self.span.as_ref().map_or(&[], |s| &s.slots)
    }

    /// What computes its KV besides the model (0, or its adapter's digest).
    pub fn root(&self) -> u64 {
        self.root
    }

    /// Where the hash chain of its blocks in the cache's own pools starts: what tiers below
    /// the pool (which hold those blocks only) key its prefix by.
    pub fn main_root(&self) -> u64 {
        chain_root(self.root, false, self.start)
    }

    /// Where the hash chain of its blocks where they are now starts.
    pub(super) fn chain_root(&self) -> u64 {
        chain_root(self.root, self.base != 0, self.start)
    }

    /// Whether its tables index the full-precision twin pools (it has not turned quantized).
    pub fn full_precision(&self) -> bool {
        self.base != 0
    }

    /// The position its KV turns quantized at (0: from the start, `NEVER`: it does not).
    pub fn quantized_start(&self) -> usize {
        self.start
    }

    /// Query positions it may compute from `computed` on before it has to turn quantized (a
    /// step's span never straddles its start); unbounded once it may turn.
    pub fn room_before_start(&self, computed: usize) -> usize {
        if self.base != 0 && computed < self.start {
            self.start - computed
        } else {
            usize::MAX
        }
    }

    /// The conversions its last transition left to copy, per group: (twin block, block).
    pub fn pending_moves(&self) -> Vec<Vec<(u32, u32)>> {
        let mut out = vec![Vec::new(); self.tables.len()];
        for &(g, from, to) in &self.pending {
            out[g].push((from, to));
        }
        out
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
        for (g, table) in self.tables.iter().enumerate() {
            let pool = &mut pools[self.pool(g)];
            for &b in table.iter().filter(|&&b| b != NO_BLOCK) {
                pool.release(b);
            }
        }
        let groups = self.tables.len();
        for &(g, b, _) in &self.pending {
            pools[groups + g].release(b);
        }
        if let Some(span) = &self.span {
            for &b in &span.slots {
                pools[self.pool(span.group)].release(b);
            }
        }
    }
}

impl fmt::Debug for SeqKv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SeqKv")
            .field("tables", &self.tables)
            .field("hashes", &self.hashes)
            .field("full_precision", &self.full_precision())
            .field("start", &self.start)
            .finish()
    }
}
