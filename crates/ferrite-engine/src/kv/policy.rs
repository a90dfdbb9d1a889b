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
//! A recurrent group (hybrid linear attention) holds fixed-size states in slots, not keys and
//! values, but keeps the same positional table (`ferrite_runtime::kv_state`): entry `e` holds
//! the state after the end of block `e`, or the live state in the block the sequence is in.
//! Its policy (`RecurrentState`) gives a slot only to every `stride`-th entry (the snapshots
//! the prefix cache keeps) and the last one, releases every entry before the live one, serves
//! a hit wherever the snapshot at the hit's end is cached, and asks for per-token state slots
//! for a verify row (`spans`), from which a rejected tail is rolled back.

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

    /// Whether entry `entry` of a table growing to `len` entries gets a block.
    fn holds_block(&self, _entry: usize, _len: usize) -> bool {
        true
    }

    /// Whether the last entry must hold a block even where `holds_block` gave it none when it
    /// was allocated (a recurrent group writes its live state there).
    fn last_holds_block(&self) -> bool {
        false
    }

    /// Whether a verify row needs a block for the state after each of its query tokens, so a
    /// rollback can restore any accepted length (a recurrent group's state is overwritten).
    fn spans(&self) -> bool {
        false
    }

    /// Whether the group's cached blocks are state snapshots, kept only at some blocks (a
    /// recurrent group): a block stored below the pool carries one only where it was kept,
    /// while every other group's block is always there.
    fn snapshots(&self) -> bool {
        false
    }
}

/// The policy of a layout's group `kind`.
pub fn policy_for(kind: KvGroupKind) -> Box<dyn GroupPolicy> {
    match kind {
        KvGroupKind::Full => Box::new(FullAttention),
        KvGroupKind::Sliding { window } => Box::new(SlidingWindow { window }),
        KvGroupKind::Recurrent => Box::new(RecurrentState { stride: 1 }),
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

/// A recurrent state (linear attention): entry `e` holds the state after block `e` (a snapshot)
/// or the live state; only every `stride`-th entry keeps a snapshot slot, the last entry holds
/// the live state, and everything before the live entry is released after each step.
#[derive(Debug, Clone, Copy)]
pub struct RecurrentState {
    /// Blocks between state snapshots.
    pub stride: usize,
}

impl GroupPolicy for RecurrentState {
    fn table_len(&self, positions: usize, block_size: usize) -> usize {
        positions.div_ceil(block_size)
    }

    /// The entry holding the state after `computed` positions, which the next query reads.
    fn first_needed(&self, computed: usize, block_size: usize) -> usize {
        computed.saturating_sub(1) / block_size
    }

    /// The state does not grow with the sequence.
    fn capacity_tokens(&self, _num_blocks: usize, _block_size: usize) -> usize {
        usize::MAX
    }

    fn hit_bound(&self, max: usize, _cached: &dyn Fn(usize) -> bool) -> usize {
        max
    }

    /// The snapshot after the hit's last block.
    fn serves_hit(&self, hit: usize, _block_size: usize, cached: &dyn Fn(usize) -> bool) -> bool {
        hit == 0 || cached(hit - 1)
    }

    /// A fork recomputes from a prefix hit instead: the parent released its early entries.
    fn shares_prefix(&self) -> bool {
        false
    }

    fn holds_block(&self, entry: usize, len: usize) -> bool {
        entry + 1 == len || (entry + 1).is_multiple_of(self.stride.max(1))
    }

    fn last_holds_block(&self) -> bool {
        true
    }

    fn spans(&self) -> bool {
        true
    }

    fn snapshots(&self) -> bool {
        true
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

    #[test]
    fn a_recurrent_state_keeps_the_live_entry_and_strided_snapshots() {
        let p = RecurrentState { stride: 3 };
        assert_eq!(p.table_len(9, 4), 3);
        // After 8 positions the state is in entry 1 (positions 4..8); after 9, entry 2.
        assert_eq!(p.first_needed(8, 4), 1);
        assert_eq!(p.first_needed(9, 4), 2);
        assert_eq!(p.first_needed(0, 4), 0);
        assert_eq!(p.capacity_tokens(2, 4), usize::MAX);
        // Snapshots at entries 2, 5, ... and the last entry.
        let held: Vec<bool> = (0..7).map(|e| p.holds_block(e, 7)).collect();
        assert_eq!(held, vec![false, false, true, false, false, true, true]);
        // A hit needs only the snapshot at its end.
        let cached = |i: usize| i == 5;
        assert!(p.serves_hit(6, 4, &cached) && !p.serves_hit(5, 4, &cached) && p.serves_hit(0, 4, &cached));
        assert!(p.spans() && p.last_holds_block() && !p.shares_prefix() && p.snapshots());
    }
}
