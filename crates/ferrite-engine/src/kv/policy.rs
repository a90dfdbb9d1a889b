//! KV group kinds as policies: the rules of each kind of KV group, one implementation per kind.
//!
//! The `KvManager` owns the mechanism (pools, tables, the prefix cache, reference counts); a
//! group's `GroupPolicy` answers the questions whose answer depends on its kind — how many
//! table entries a length needs (allocation and truncation), which entries the next query
//! still reads (the rest are released as the window slides), how long a sequence the group can
//! hold, which cached blocks a prefix hit needs, and whether a fork may share the table.
//! `policy_for` is the one place that maps a layout's `KvGroupKind` to its policy.
//!
//! Layers that read a donor layer's KV (Gemma 4's shared layers) are not a group: they own no
//! blocks and read their donor's group, so they follow their donor's policy.
//!
//! Room for a recurrent-state kind (hybrid linear attention, state-space layers): such a group
//! holds one fixed-size state per sequence rather than a block per `block_size` positions. Its
//! policy would answer `table_len` with 1 for any non-empty length, `first_needed` with 0 (the
//! state is updated in place), `capacity_tokens` without bound, `shares_prefix` with false (a
//! fork copies the state instead of sharing it), and serve a prefix hit only at a length whose
//! state snapshot the cache holds. Rolling back a rejected verify tail cannot drop entries: it
//! needs a snapshot from before the tail, so that kind brings a rollback rule of its own to
//! this trait (and a state pool to the manager) when it lands.

use std::fmt::Debug;

use ferrite_runtime::KvGroupKind;

/// The rules of one kind of KV group. Block indices are table entries: entry `i` holds
/// positions `i · block_size .. (i + 1) · block_size`.
pub trait GroupPolicy: Debug + Send {
    /// Table entries a sequence of `positions` positions has: what allocation grows a table to
    /// and what truncation cuts it back to.
    fn table_len(&self, positions: usize, block_size: usize) -> usize;

    /// The first entry the next query (position `computed`) still reads once `computed`
    /// positions are in the cache; entries before it are released after each step.
    fn first_needed(&self, computed: usize, block_size: usize) -> usize;

    /// The longest sequence one sequence can have in a pool of `num_blocks` blocks.
    fn capacity_tokens(&self, num_blocks: usize, block_size: usize) -> usize;

    /// A bound on the blocks of a prefix hit (at most `max`), given which of the prefix's
    /// blocks this group has `cached`: no longer hit can be served.
    fn hit_bound(&self, max: usize, cached: &dyn Fn(usize) -> bool) -> usize;

    /// Whether this group can serve a prefix hit of `hit` blocks from what it has `cached`.
    fn serves_hit(&self, hit: usize, block_size: usize, cached: &dyn Fn(usize) -> bool) -> bool;

    /// Whether a fork may share this group's table entries (their blocks are retained).
    fn shares_prefix(&self) -> bool;
}

/// The policy of a layout's group `kind`.
pub fn policy_for(kind: KvGroupKind) -> Box<dyn GroupPolicy> {
    match kind {
        KvGroupKind::Full => Box::new(FullAttention),
        KvGroupKind::Sliding { window } => Box::new(SlidingWindow { window }),
    }
}

/// Full attention: every position is read by every later query, so every block stays.
#[derive(Debug, Clone, Copy)]
pub struct FullAttention;

impl GroupPolicy for FullAttention {
    fn table_len(&self, positions: usize, block_size: usize) -> usize {
        positions.div_ceil(block_size)
    }

    fn first_needed(&self, _computed: usize, _block_size: usize) -> usize {
        0
    }

    fn capacity_tokens(&self, num_blocks: usize, block_size: usize) -> usize {
        num_blocks * block_size
    }

    /// The run of cached blocks from the start.
    fn hit_bound(&self, max: usize, cached: &dyn Fn(usize) -> bool) -> usize {
        (0..max).take_while(|&i| cached(i)).count()
    }

    /// Every block of the hit.
    fn serves_hit(&self, hit: usize, _block_size: usize, cached: &dyn Fn(usize) -> bool) -> bool {
        (0..hit).all(cached)
    }

    fn shares_prefix(&self) -> bool {
        true
    }
}

/// A sliding window: a query at position `p` reads positions `p + 1 - window ..= p`; blocks
/// wholly before that are released (their table entries become `NO_BLOCK`).
#[derive(Debug, Clone, Copy)]
pub struct SlidingWindow {
    pub window: usize,
}

impl GroupPolicy for SlidingWindow {
    /// Entries stay positional (released ones hold `NO_BLOCK`), so the table is as long as
    /// a full one.
    fn table_len(&self, positions: usize, block_size: usize) -> usize {
        positions.div_ceil(block_size)
    }

    fn first_needed(&self, computed: usize, block_size: usize) -> usize {
        (computed + 1).saturating_sub(self.window) / block_size
    }

    /// A window reuses its blocks: any length runs in a pool that holds one window.
    fn capacity_tokens(&self, _num_blocks: usize, _block_size: usize) -> usize {
        usize::MAX
    }

    /// No bound from the start of the prefix: its early blocks may long be evicted.
    fn hit_bound(&self, max: usize, _cached: &dyn Fn(usize) -> bool) -> usize {
        max
    }

    /// The blocks the window reads at the first position after the hit.
    fn serves_hit(&self, hit: usize, block_size: usize, cached: &dyn Fn(usize) -> bool) -> bool {
        (self.first_needed(hit * block_size, block_size)..hit).all(cached)
    }

    /// A sliding table may have released the blocks a fork would need.
    fn shares_prefix(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_attention_keeps_everything_and_needs_the_whole_prefix() {
        let p = policy_for(KvGroupKind::Full);
        assert_eq!(p.table_len(9, 4), 3);
        assert_eq!(p.first_needed(1000, 4), 0);
        assert_eq!(p.capacity_tokens(10, 4), 40);
        let cached = |i: usize| i != 3;
        assert_eq!(p.hit_bound(8, &cached), 3);
        assert!(p.serves_hit(3, 4, &cached));
        assert!(!p.serves_hit(4, 4, &cached));
        assert!(p.shares_prefix());
    }

    #[test]
    fn sliding_window_releases_what_left_it_and_needs_only_the_window() {
        let p = policy_for(KvGroupKind::Sliding { window: 8 });
        assert_eq!(p.table_len(9, 4), 3);
        // Position 20 reads 13..=20: blocks 3 (12..16) on.
        assert_eq!(p.first_needed(20, 4), 3);
        assert_eq!(p.first_needed(5, 4), 0);
        assert_eq!(p.capacity_tokens(10, 4), usize::MAX);
        // Blocks 0..4 evicted: a hit of 8 blocks (position 32 reads 25..=32) needs 6 and 7.
        let cached = |i: usize| i >= 4;
        assert_eq!(p.hit_bound(8, &cached), 8);
        assert!(p.serves_hit(8, 4, &cached));
        assert!(!p.serves_hit(4, 4, &cached));
        assert!(!p.shares_prefix());
    }
}
