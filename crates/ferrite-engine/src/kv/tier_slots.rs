//! `TierSlots`: host memory for blocks on their way below the pool or back — the host-RAM
//! tier's store and the staging slots the SSD tier's copies go through.
//!
//! A block below the pool is the block of every KV group but a snapshot group's and, for some
//! blocks only, the state snapshot after it (a recurrent group's slot: `GroupPolicy::
//! snapshots`). A snapshot takes as many bytes as the KV of many blocks, so the two kinds are
//! kept in two `HostBlocks` with slots of their own: `blocks`, a slot per block, and `states`,
//! a slot per snapshot (none for a model without recurrent state). A block's bytes as the SSD
//! tier stores them (`BlockData::Bytes`) are its `blocks` slot's, then its `states` slot's
//! where it carries a snapshot. A `BlockMove`'s slot is one of the memory holding its group.

use ferrite_runtime::{BlockMove, HostBlocks, KvCache};

/// Where a block's bytes are in `TierSlots`: its slot in `blocks` and, where it carries a
/// snapshot, that one's slot in `states`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Place {
    pub block: Option<usize>,
    pub state: Option<usize>,
}

pub struct TierSlots {
    pub blocks: HostBlocks,
    pub states: Option<HostBlocks>,
    /// The snapshot group, whose blocks go to `states`.
    state_group: Option<usize>,
}

impl TierSlots {
    /// Room for `blocks` blocks and, with a snapshot group `state_group`, `states` snapshots
    /// of `kv` (page-locked for a device cache).
    pub fn new(
        kv: &KvCache,
        state_group: Option<usize>,
        blocks: usize,
        states: usize,
    ) -> ferrite_runtime::Result<TierSlots> {
        let groups: Vec<usize> = (0..kv.group_blocks().len()).filter(|&g| Some(g) != state_group).collect();
        let states = state_group.map(|g| kv.host_blocks_for(&[g], states)).transpose()?;
        Ok(TierSlots { blocks: kv.host_blocks_for(&groups, blocks)?, states, state_group })
    }

    /// Bytes of a block below the pool, without its snapshot.
    pub fn block_bytes(&self) -> usize {
        self.blocks.slot_bytes()
    }

    /// Bytes of a snapshot (0 without a snapshot group).
    pub fn state_bytes(&self) -> usize {
        self.states.as_ref().map_or(0, HostBlocks::slot_bytes)
    }

    /// Slots of snapshots (0 without a snapshot group).
    pub fn state_slots(&self) -> usize {
        self.states.as_ref().map_or(0, HostBlocks::slots)
    }

    /// Bytes of a block below the pool, with its snapshot or not.
    pub fn bytes_of(&self, state: bool) -> usize {
        self.block_bytes() + if state { self.state_bytes() } else { 0 }
    }

    /// The snapshot group, if the model has one.
    pub fn state_group(&self) -> Option<usize> {
        self.state_group
    }

    /// The moves between pool blocks `targets` ((group, block) pairs) and the slots of
    /// `place` that hold their groups (a target whose slot `place` lacks is left out).
    pub fn moves(&self, targets: &[(usize, u32)], place: Place) -> Vec<BlockMove> {
        (targets.iter())
            .filter_map(|&(group, b)| {
                let slot = if Some(group) == self.state_group { place.state } else { place.block };
                slot.map(|slot| BlockMove { group, block: b as usize, slot })
            })
            .collect()
    }

    /// `moves` split by the memory holding their group: (`blocks`', `states`').
    fn split(&self, moves: &[BlockMove]) -> (Vec<BlockMove>, Vec<BlockMove>) {
        moves.iter().partition(|m| Some(m.group) != self.state_group)
    }

    /// Copy pool blocks out (`KvCache::save_blocks`; queued for a device cache).
    pub fn save(&mut self, kv: &KvCache, moves: &[BlockMove]) -> ferrite_runtime::Result<()> {
        let (blocks, states) = self.split(moves);
        kv.save_blocks(&blocks, &mut self.blocks)?;
        match self.states.as_mut() {
            Some(mem) => kv.save_blocks(&states, mem),
            None => Ok(()),
        }
    }

    /// Copy into pool blocks (`KvCache::load_blocks`; queued for a device cache).
    pub fn load(&self, kv: &mut KvCache, moves: &[BlockMove]) -> ferrite_runtime::Result<()> {
        let (blocks, states) = self.split(moves);
        kv.load_blocks(&blocks, &self.blocks)?;
        match self.states.as_ref() {
            Some(mem) => kv.load_blocks(&states, mem),
            None => Ok(()),
        }
    }

    /// Write blocks' bytes (as the SSD tier stores them) to their places: the block's part to
    /// its `blocks` slot, the snapshot's, if the place has a slot for it, to its `states` slot.
    pub fn write(&mut self, items: &[(Place, &[u8])]) -> ferrite_runtime::Result<()> {
        let n = self.block_bytes();
        let (mut blocks, mut states) = (Vec::new(), Vec::new());
        let short = || ferrite_runtime::RuntimeError::Shape("a tier block shorter than a block".into());
        for &(place, bytes) in items {
            blocks.extend(place.block.map(|slot| bytes.get(..n).map(|b| (slot, b)).ok_or_else(short)).transpose()?);
            states.extend(place.state.zip(bytes.get(n..)));
        }
        self.blocks.write_many(&blocks)?;
        match self.states.as_mut() {
            Some(mem) => mem.write_many(&states),
            None if states.is_empty() => Ok(()),
            None => Err(ferrite_runtime::RuntimeError::Shape("a snapshot for a model without one".into())),
        }
    }

    /// Append the bytes of the block at `place` (after the copies into it finished): its
    /// `blocks` slot's, then its snapshot's where it has one.
    pub fn read(&self, place: Place, out: &mut Vec<u8>) -> ferrite_runtime::Result<()> {
        if let Some(slot) = place.block {
            out.extend_from_slice(self.blocks.bytes(slot)?);
        }
        if let Some((slot, mem)) = place.state.zip(self.states.as_ref()) {
            out.extend_from_slice(mem.bytes(slot)?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrite_runtime::kv::KvLayerSpec;
    use ferrite_runtime::kv_state::StateSpec;
    use ferrite_runtime::{KvGroupKind, KvLayout};

    #[test]
    fn a_blocks_bytes_are_its_block_slot_then_its_snapshot_and_round_trip_through_the_pools() {
        let layout = KvLayout {
            groups: vec![KvGroupKind::Recurrent, KvGroupKind::Full],
            layers: vec![KvLayerSpec { n_kv_heads: 1, head_dim: 4, group: 1 }],
            states: vec![StateSpec { conv_channels: 2, conv_kernel: 2, heads: 1, k_dim: 2, v_dim: 2, group: 0 }],
        };
        let mut kv = KvCache::new(&layout, &[2, 3], 2).expect("cache");
        let mut mem = TierSlots::new(&kv, Some(0), 2, 1).expect("slots");
        assert_eq!((mem.block_bytes(), mem.state_bytes()), (2 * 2 * 4 * 2, 4 * (2 + 4)));
        let bytes: Vec<u8> = (0..mem.bytes_of(true)).map(|i| i as u8 + 1).collect();
        let (with, without) = (Place { block: Some(1), state: Some(0) }, Place { block: Some(0), state: None });
        mem.write(&[(with, &bytes), (without, &bytes)]).expect("write");
        // Into pool block 2 and state slot 1, and back out into other slots.
        let moves = mem.moves(&[(1, 2), (0, 1)], with);
        assert_eq!(mem.moves(&[(1, 2), (0, 1)], without), vec![BlockMove { group: 1, block: 2, slot: 0 }]);
        mem.load(&mut kv, &moves).expect("load");
        let back = Place { block: Some(0), state: Some(0) };
        mem.write(&[(back, &vec![0; mem.bytes_of(true)])]).expect("clear");
        mem.save(&kv, &mem.moves(&[(1, 2), (0, 1)], back)).expect("save");
        let mut out = Vec::new();
        mem.read(back, &mut out).expect("read");
        assert_eq!(out, bytes);
        out.clear();
        mem.read(Place { block: Some(1), state: None }, &mut out).expect("read");
        assert_eq!(out, bytes[..mem.block_bytes()]);
        // Without a snapshot group every group's block is in `blocks`.
        let plain = TierSlots::new(&kv, None, 1, 0).expect("slots");
        assert_eq!((plain.block_bytes(), plain.state_slots()), (kv.block_bytes(), 0));
    }
}
