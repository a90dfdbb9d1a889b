//! The transition of a row's KV from the full-precision twin pools into the quantized pools
//! at its delayed start (`--quantized-kv-start N`, or a request's own `quantized_kv_start`).
//!
//! A row before its start allocates in the twin pools, and the scheduler never gives it a
//! query span that straddles the start. The allocation that takes it past its start (its next
//! query begins at the start) turns it: fresh blocks of the quantized pools for every table
//! entry it holds or needs (entries a sliding window released stay released), the twin blocks
//! kept in the allocation (`pending`) until the engine has converted their values into the
//! new ones (`KvCache::convert_blocks`) and called `end_transition`, which releases them —
//! still cached under the full-precision chain for rows before their start. Its hash chain
//! starts again under the quantized pools' root for that start (`after_step` registers the
//! converted blocks there), so a prefix of one precision, or turned at another start, is
//! never served to it. Rollbacks (a rejected verify tail) happen inside one side of the start
//! and never cross it back.
//!
//! A recurrent group (gated DeltaNet layers' state slots) holds no quantized KV and has no
//! twins: its slots are the same on both sides of the start, and a turn neither converts nor
//! moves them. Its snapshots before the start stay cached under the full-precision chain (the
//! state after a position before any start is the same for every start past it), those after
//! it under the quantized chain of the row's start, as its other groups' blocks.

use ferrite_runtime::batch::NO_BLOCK;

use super::manager::{take_free, KvManager};
use super::seq_kv::{lock, SeqKv};

impl KvManager {
    /// Move `kv`, a row before its start, into the quantized pools with tables covering
    /// `total` positions; all or nothing (false when the quantized pools lack the blocks). A
    /// recurrent group's table keeps its state slots and grows as any row's does.
    pub(super) fn turn(&mut self, kv: &mut SeqKv, total: usize) -> bool {
        debug_assert!(kv.base != 0 && kv.pending.is_empty(), "only a full-precision row turns, once");
        let (bs, groups, shape) = (self.block_size, self.policies.len(), self.spill_shape());
        let turns = |g: usize| Some(g) != kv.state;
        let entries: Vec<usize> = self.policies.iter().map(|p| p.table_len(total, bs)).collect();
        let released = |g: usize, i: usize| kv.tables[g].get(i) == Some(&NO_BLOCK);
        let growth = self.growth(kv, total);
        let need: Vec<usize> = (0..groups)
            .map(|g| match turns(g) {
                true => (0..entries[g]).filter(|&i| !released(g, i)).count(),
                false => growth[g].1.len(),
            })
            .collect();
        let mut pools = lock(&self.pools);
        if pools.iter().take(groups).zip(&need).any(|(p, &n)| p.num_free() < n) {
            return false;
        }
        let mut tables: Vec<(usize, Vec<u32>)> = Vec::with_capacity(groups);
        let mut pending = Vec::new();
        for g in (0..groups).filter(|&g| turns(g)) {
            let mut table = Vec::with_capacity(entries[g]);
            for i in 0..entries[g] {
                let block = match released(g, i) {
                    true => Some(NO_BLOCK),
                    false => take_free(&mut pools[g], g, &mut self.cache, &mut self.spills, shape),
                };
                let Some(block) = block else {
                    // Counted free above; should it happen, what was taken goes back.
                    tables.push((g, table));
                    for (o, t) in &tables {
                        t.iter().filter(|&&b| b != NO_BLOCK).for_each(|&b| pools[*o].release(b));
                    }
                    return false;
                };
                match kv.tables[g].get(i) {
                    Some(&old) if old != NO_BLOCK => pending.push((g, old, block)),
                    _ => {}
                }
                table.push(block);
            }
            tables.push((g, table));
        }
        drop(pools);
        for (g, table) in tables {
            kv.tables[g] = table;
        }
        kv.pending = pending;
        kv.base = 0;
        kv.hashes.clear();
        // The turned tables cover `total`: only a recurrent group grows, into slots counted above.
        let growth = self.growth(kv, total);
        self.grow(kv, growth)
    }

    /// Release the twin blocks `kv`'s transition converted (their values are in its tables
    /// now, or the step that needed them failed).
    pub fn end_transition(&mut self, kv: &mut SeqKv) {
        debug_assert!(kv.is_from(&self.pools), "an allocation ends its transition in its own pools");
        let groups = self.policies.len();
        let mut pools = lock(&self.pools);
        for (g, b, _) in kv.pending.drain(..) {
            pools[groups + g].release(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use ferrite_runtime::kv::KvLayerSpec;
    use ferrite_runtime::{KvGroupKind, KvLayout};

    use super::*;
    use crate::kv::NEVER;

    /// A full and a sliding (window 8) group, `blocks` quantized and `full` twin blocks each,
    /// blocks of 4.
    fn manager(blocks: usize, full: usize) -> KvManager {
        let groups = vec![KvGroupKind::Full, KvGroupKind::Sliding { window: 8 }];
        let layers = (0..2).map(|group| KvLayerSpec { n_kv_heads: 1, head_dim: 4, group }).collect();
        let full = if full > 0 { vec![full; 2] } else { Vec::new() };
        KvManager::with_full_precision(
            &KvLayout { groups, layers, states: Vec::new() },
            &[blocks; 2],
            &full,
            4,
            Some(7),
        )
    }

    #[test]
    fn a_row_turns_when_its_allocation_passes_its_start_and_holds_its_twins_until_converted() {
        let mut m = manager(16, 8);
        let tokens: Vec<u32> = (1..=30).collect();
        let mut kv = m.new_seq_from(0, 10);
        assert!(kv.full_precision() && m.has_full_precision());
        assert_eq!((kv.room_before_start(0), kv.room_before_start(7), kv.room_before_start(10)), (10, 3, usize::MAX));
        assert!(m.allocate(&mut kv, 10));
        m.after_step(&mut kv, &tokens, 10);
        let twins = kv.tables().to_vec();
        assert_eq!(m.free_blocks(), (32 + 16 - 6, 48));
        // Past the start: fresh quantized blocks for every entry, the twins held until converted.
        assert!(m.allocate(&mut kv, 12));
        assert!(!kv.full_precision() && kv.hashes().is_empty());
        let moves = kv.pending_moves();
        for (g, moves) in moves.iter().enumerate() {
            let pairs: Vec<(u32, u32)> = twins[g].iter().copied().zip(kv.tables()[g].iter().copied()).collect();
            assert_eq!(moves, &pairs, "group {g}");
        }
        assert_eq!(m.free_blocks(), (48 - 12, 48));
        m.check_holders([&kv]).unwrap();
        m.end_transition(&mut kv);
        assert!(kv.pending_moves().iter().all(Vec::is_empty));
        assert_eq!(m.free_blocks(), (48 - 6, 48));
        m.check_holders([&kv]).unwrap();
        // Its chain starts over in the quantized pools; the twin blocks stay cached.
        m.after_step(&mut kv, &tokens, 12);
        assert_eq!(kv.hashes().len(), 3);
        let cache = m.prefix_cache().expect("cache");
        assert_eq!(cache.len(), 2 * 2 + 2 * 3, "two twin blocks and three quantized ones per group");
        drop(kv);
        assert_eq!(m.free_blocks(), (48, 48));
        m.check_invariants().unwrap();
    }

    #[test]
    fn released_window_blocks_stay_released_and_a_turn_is_all_or_nothing() {
        let mut m = manager(7, 8);
        let tokens: Vec<u32> = (1..=30).collect();
        let mut kv = m.new_seq_from(0, 20);
        assert!(m.allocate(&mut kv, 20));
        m.after_step(&mut kv, &tokens, 20);
        // Position 20 reads 13..=20: the sliding table released blocks 0..3.
        assert_eq!(kv.tables()[1][..3], [NO_BLOCK; 3]);
        // Six quantized blocks for the full group's table at 21 positions, three for the window's.
        let mut other = m.new_seq();
        assert!(m.allocate(&mut other, 8));
        assert!(!m.allocate(&mut kv, 21), "six blocks do not fit in the five left");
        assert!(kv.full_precision() && kv.pending_moves().iter().all(Vec::is_empty));
        m.check_holders([&kv, &other]).unwrap();
        drop(other);
        assert!(m.allocate(&mut kv, 21));
        assert_eq!(kv.tables()[1][..3], [NO_BLOCK; 3]);
        assert_eq!(kv.pending_moves().iter().map(Vec::len).collect::<Vec<_>>(), vec![5, 2]);
        m.check_holders([&kv]).unwrap();
        drop(kv);
        assert_eq!(m.free_blocks(), (30, 30));
        m.check_invariants().unwrap();
    }

    #[test]
    fn a_recurrent_group_keeps_its_state_slots_through_the_turn_and_its_snapshots_serve_both_chains() {
        // A full group with eight twin blocks beside a recurrent group without (its twin pool
        // is empty), blocks of 4, a snapshot at every block.
        let groups = vec![KvGroupKind::Full, KvGroupKind::Recurrent];
        let layers = vec![KvLayerSpec { n_kv_heads: 1, head_dim: 4, group: 0 }];
        let layout = KvLayout { groups, layers, states: Vec::new() };
        let mut m = KvManager::with_full_precision(&layout, &[16, 8], &[8, 0], 4, Some(7));
        assert_eq!(m.full_precision_capacity_tokens(), 32);
        let tokens: Vec<u32> = (1..=30).collect();
        let mut kv = m.new_seq_from(0, 10);
        assert!(m.allocate(&mut kv, 10));
        m.after_step(&mut kv, &tokens, 10);
        // Three twin blocks; the state after 10 positions in entry 2 of the recurrent pool, the
        // snapshots of entries 0 and 1 released into its cache.
        let live = kv.tables()[1][2];
        assert_eq!(kv.tables()[1][..2], [NO_BLOCK; 2]);
        assert_eq!(m.free_blocks(), (32 - 3 - 1, 32));
        m.check_holders([&kv]).unwrap();
        // The turn converts the full group's blocks only: the live slot stays, no move for it.
        assert!(m.allocate(&mut kv, 12));
        assert!(!kv.full_precision());
        assert_eq!(kv.tables()[1], vec![NO_BLOCK, NO_BLOCK, live]);
        assert_eq!(kv.pending_moves().iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 0]);
        m.check_holders([&kv]).unwrap();
        m.end_transition(&mut kv);
        m.after_step(&mut kv, &tokens, 12);
        assert_eq!(m.free_blocks(), (32 - 3 - 1, 32));
        drop(kv);
        // A row of the same start is served the quantized chain, whose state after 12
        // positions is the slot that lived through the turn ...
        let mut again = m.new_seq_from(0, 10);
        assert_eq!(m.acquire_prefix(&mut again, &tokens[..13]), 12);
        assert!(!again.full_precision());
        assert_eq!(again.tables()[1], vec![NO_BLOCK, NO_BLOCK, live]);
        // ... and a row of a later start the full-precision chain, with the snapshot after
        // block 1 made before the turn (block 2 was not full then).
        let mut other = m.new_seq_from(0, 20);
        assert_eq!(m.acquire_prefix(&mut other, &tokens[..13]), 8);
        assert!(other.full_precision());
        assert!(other.tables()[1][1] != NO_BLOCK && other.tables()[1][1] != live);
        m.check_holders([&again, &other]).unwrap();
        drop((again, other));
        assert_eq!(m.free_blocks(), (32, 32));
        m.check_invariants().unwrap();
    }

    #[test]
    fn full_precision_rows_never_turn_and_rows_without_twins_start_quantized() {
        let mut m = manager(16, 8);
        let mut kv = m.new_seq_from(0, NEVER);
        assert!(m.allocate(&mut kv, 30) && kv.full_precision());
        assert!(!m.allocate(&mut kv, 40), "the twin pool holds 32 positions");
        let plain = manager(16, 0);
        assert!(!plain.new_seq_from(0, 10).full_precision() && !plain.has_full_precision());
    }
}
