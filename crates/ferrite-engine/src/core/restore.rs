//! Moving KV blocks between the pool and the tiers below it (`kv/tier.rs`), the one path
//! every tier goes through.
//!
//! - **Read ahead** (a request arrives): the blocks of its prompt the pool lacks are looked up
//!   in host RAM, then on the SSD from where host RAM's run ends; the SSD's part is read on
//!   its reader thread meanwhile.
//! - **Install** (`install_restores`, just before the scheduler looks the request up): the
//!   pool's part of the hit is touched, host RAM is looked up again from where the pool's part
//!   ends now, the SSD's read-ahead is taken, and the longest contiguous run is copied into
//!   free pool blocks (`KvCache::load_blocks`, queued on the copy stream for a device pool)
//!   registered in the prefix cache: the ordinary prefix hit serves them. A model with
//!   recurrent state also needs the state snapshot after the hit's last block: the run ends at
//!   the last block whose snapshot the pool caches or a tier holds, and that snapshot (only
//!   it) is restored into a fresh state slot — host RAM's may be one of a block the pool kept.
//! - **Spills**: cached blocks the pool evicts are saved to host RAM before anything writes
//!   the pool again (`before_forward`, and within a restore before each block's copy in);
//!   then the next step is fenced after the queued copies.
//! - **Publish**: full blocks go to the SSD tier, with the snapshot after each one that has
//!   one cached, copied out through the staging slots a window at a time.

use std::sync::atomic::Ordering::Relaxed;

use ferrite_runtime::batch::NO_BLOCK;
use ferrite_runtime::{BlockMove, KvCache};

use super::EngineCore;
use crate::error::EngineError;
use crate::kv::disk::DiskTier;
use crate::kv::host::HostTier;
use crate::kv::{BlockData, KvManager, KvTier, Place, TierKind, TierSlots};
use crate::sequence::Sequence;

/// Hand the blocks the pool evicted since the last call to the host tier.
fn spill(kvm: &mut KvManager, host: &mut Option<HostTier>, kv: &KvCache) {
    let Some(host) = host.as_mut() else { return };
    host.save(kv, kvm.take_spills());
}

/// A run of consecutive blocks being published: what the SSD tier gets in one store.
#[derive(Default)]
struct Run {
    hashes: Vec<u64>,
    tokens: Vec<u32>,
    /// Whether each block carries its snapshot.
    states: Vec<bool>,
    payload: Vec<u8>,
    reserved: u64,
    /// The copies of pool blocks into the staging slots, not queued yet, and where each
    /// staged block is (`blocks` slots `0..`, `states` slots `0..staged_states`).
    moves: Vec<BlockMove>,
    staged: Vec<Place>,
    staged_states: usize,
    /// A copy failed: the run is dropped.
    failed: bool,
}

impl Run {
    /// Whether the staging slots have no room for another block (carrying a snapshot or not).
    fn staging_full(&self, staging: &TierSlots, state: bool) -> bool {
        self.staged.len() == staging.blocks.slots() || (state && self.staged_states == staging.state_slots())
    }

    /// Copy the staged blocks out and read them back into the payload (waiting for the copies).
    fn unstage(&mut self, kv: &KvCache, staging: &mut TierSlots) {
        if staging.save(kv, &std::mem::take(&mut self.moves)).is_err() {
            self.failed = true;
        }
        self.staged_states = 0;
        for place in std::mem::take(&mut self.staged) {
            if self.failed || staging.read(place, &mut self.payload).is_err() {
                self.failed = true;
            }
        }
    }

    /// Store what the run holds (a failed run stores nothing and frees its reservation).
    fn flush(&mut self, disk: &DiskTier, kv: &KvCache, staging: &mut TierSlots) {
        self.unstage(kv, staging);
        let run = std::mem::take(self);
        if run.failed {
            disk.store(Vec::new(), Vec::new(), Vec::new(), Vec::new(), run.reserved);
        } else {
            disk.store(run.hashes, run.tokens, run.states, run.payload, run.reserved);
        }
    }
}

/// Hand full blocks `seq.tier.published .. upto` of `seq` to the SSD tier, as runs of the
/// blocks it does not hold yet, each with its snapshot where the pool caches one; stops at
/// the first block the writer has no room for.
pub(super) fn publish(
    disk: &DiskTier,
    kvm: &KvManager,
    kv: &KvCache,
    staging: &mut TierSlots,
    seq: &mut Sequence,
    upto: usize,
) {
    // Tiers hold blocks of the quantized pools only (`kv/transition.rs`).
    if seq.kv.full_precision() {
        return;
    }
    let bs = kvm.block_size();
    let upto = upto.min(seq.kv.hashes().len());
    let mut run = Run::default();
    for i in seq.tier.published..upto {
        let h = seq.kv.hashes()[i];
        let holders = if disk.holds(h) { None } else { kvm.block_holders(&seq.kv, i, &seq.tokens) };
        let Some(holders) = holders else {
            run.flush(disk, kv, staging);
            continue;
        };
        let state = staging.state_group().is_some_and(|g| holders[g] != NO_BLOCK);
        if run.staging_full(staging, state) {
            run.unstage(kv, staging);
        }
        let bytes = staging.bytes_of(state) as u64;
        if run.failed || !disk.reserve(bytes) {
            break;
        }
        run.reserved += bytes;
        let place = Place { block: Some(run.staged.len()), state: state.then_some(run.staged_states) };
        run.staged_states += usize::from(state);
        let held: Vec<(usize, u32)> = (holders.iter().copied().enumerate()).filter(|&(_, b)| b != NO_BLOCK).collect();
        run.moves.extend(staging.moves(&held, place));
        run.staged.push(place);
        run.hashes.push(h);
        run.states.push(state);
        run.tokens.extend_from_slice(&seq.tokens[i * bs..(i + 1) * bs]);
    }
    run.flush(disk, kv, staging);
    seq.tier.published = upto;
}

/// A block to copy in: its index in the sequence, the tier it comes from, its bytes, and
/// whether the snapshot after it is restored too (the hit's end, with recurrent state).
struct Planned {
    index: usize,
    kind: TierKind,
    data: BlockData,
    state: bool,
}

impl EngineCore {
    /// Save what the pool evicted, then fence the next forward pass after the queued copies.
    pub(super) fn before_forward(&mut self) -> Result<(), EngineError> {
        spill(&mut self.kvm, &mut self.host, &self.kv);
        Ok(self.kv.fence()?)
    }

    /// Start reading the blocks of `seq`'s prefix that the pool lacks and a tier has.
    pub(super) fn read_ahead(&self, seq: &mut Sequence) {
        if self.host.is_none() && self.disk.is_none() {
            return;
        }
        let bs = self.kvm.block_size();
        let hashes = self.kvm.prefix_hashes(seq.kv.main_root(), &seq.tokens);
        let mut next = self.kvm.cached_run(&hashes, &seq.tokens);
        if let Some(host) = &self.host {
            self.metrics.host_lookup_tokens.fetch_add(((hashes.len() - next) * bs) as u64, Relaxed);
            let found = host.run_len(&hashes[next..]);
            // With recurrent state, host RAM may hold the snapshot the pool's blocks lack.
            seq.tier.restore |= found > 0 || self.kvm.state_group().is_some();
            next += found;
        }
        if let Some(disk) = &self.disk {
            self.metrics.ssd_lookup_tokens.fetch_add(((hashes.len() - next) * bs) as u64, Relaxed);
            let found = disk.run_len(&hashes[next..]);
            if found > 0 {
                let tokens = seq.tokens[next * bs..(next + found) * bs].to_vec();
                seq.tier.read_ahead = disk.fetch(next, hashes[next..next + found].to_vec(), tokens);
                seq.tier.restore = true;
            }
        }
    }

    /// Install the restores of the waiting sequences the next schedule may admit (waiting
    /// for the SSD reads still under way): their blocks become cached pool blocks.
    pub(super) fn install_restores(&mut self) {
        let room = self.sched.max_num_seqs.saturating_sub(self.sched.running.len()).max(1);
        for w in 0..self.sched.waiting.len().min(room) {
            if std::mem::take(&mut self.sched.waiting[w].tier.restore) {
                self.install(w);
            }
        }
    }

    /// The blocks to copy in for `waiting[w]`, whose prefix the pool holds up to `pooled`:
    /// host RAM's runs from there (past the blocks the pool still holds between them), then
    /// the SSD's read-ahead where it continues them, as many as leave the pool room for the
    /// rest of the sequence; with recurrent state, up to the last block whose snapshot is
    /// there (`end_at_snapshot`).
    fn plan_restore(&mut self, w: usize, hashes: &[u64], pooled: usize) -> Vec<Planned> {
        let bs = self.kvm.block_size();
        let seq = &mut self.sched.waiting[w];
        let tokens = &seq.tokens;
        let mut next = pooled;
        let mut plan = Vec::new();
        while let Some(host) = &self.host {
            next += self.kvm.cached_run(&hashes[next..], &tokens[next * bs..]);
            let run = host.fetch(next, hashes[next..].to_vec(), tokens[next * bs..hashes.len() * bs].to_vec());
            let blocks = run.and_then(|rx| rx.recv().ok()).map_or_else(Vec::new, |r| r.blocks);
            if blocks.is_empty() {
                break;
            }
            for data in blocks {
                plan.push(Planned { index: next, kind: TierKind::Host, data, state: false });
                next += 1;
            }
        }
        if let Some(restored) = seq.tier.read_ahead.take().and_then(|rx| rx.recv().ok()) {
            if restored.first <= next {
                let skip = next - restored.first;
                for (j, data) in restored.blocks.into_iter().enumerate().skip(skip) {
                    plan.push(Planned { index: restored.first + j, kind: TierKind::Ssd, data, state: false });
                }
            }
        }
        let tokens = &self.sched.waiting[w].tokens;
        let total = (tokens.len() + 1).div_ceil(bs);
        plan.truncate(self.kvm.restorable_blocks().saturating_sub(total.saturating_sub(plan.len())));
        // The blocks the pool or the plan hold run to here.
        let end = match plan.last() {
            Some(p) if p.index >= next => p.index + 1,
            Some(p) => {
                next.min(p.index + 1 + self.kvm.cached_run(&hashes[p.index + 1..], &tokens[(p.index + 1) * bs..]))
            }
            None => pooled,
        };
        if self.kvm.state_group().is_some() {
            let tokens = tokens.clone();
            self.end_at_snapshot(&mut plan, hashes, &tokens, end);
        }
        plan
    }

    /// With recurrent state a hit must end at a block whose snapshot is there: cut `plan`
    /// (ascending blocks; with the pool's, blocks `0..end` are there) after the last block
    /// whose snapshot the pool caches or a tier holds, and mark that one's for restoring where
    /// the pool lacks it — host RAM may hold the snapshot of a block the pool kept.
    fn end_at_snapshot(&self, plan: &mut Vec<Planned>, hashes: &[u64], tokens: &[u32], end: usize) {
        let bs = self.kvm.block_size();
        let mut k = plan.len();
        for i in (0..end).rev() {
            let t = &tokens[i * bs..(i + 1) * bs];
            while k > 0 && plan[k - 1].index > i {
                k -= 1;
            }
            let planned = (k > 0 && plan[k - 1].index == i).then(|| k - 1);
            if self.kvm.caches_snapshot(hashes[i], t) {
                plan.truncate(planned.map_or(k, |p| p + 1));
                return;
            }
            if let Some(p) = planned.filter(|&p| plan[p].data.has_state()) {
                plan.truncate(p + 1);
                plan[p].state = true;
                return;
            }
            if planned.is_none() && self.host.as_ref().is_some_and(|h| h.holds_state(hashes[i], t)) {
                plan.truncate(k);
                let data = BlockData::Held { state: true };
                plan.push(Planned { index: i, kind: TierKind::Host, data, state: true });
                return;
            }
        }
        plan.clear();
    }

    /// Copy the blocks a tier holds of `waiting[w]`'s prefix into the pool.
    fn install(&mut self, w: usize) {
        let bs = self.kvm.block_size();
        let (root, tokens) = (self.sched.waiting[w].kv.main_root(), self.sched.waiting[w].tokens.clone());
        let hashes = self.kvm.prefix_hashes(root, &tokens);
        let pooled = self.kvm.cached_run(&hashes, &tokens);
        // What the pool holds of the prefix becomes the most recently used, so the blocks
        // taken for the restore are older ones.
        self.kvm.touch_prefix(&hashes, &tokens);
        let plan = self.plan_restore(w, &hashes, pooled);
        let window = self.staging.as_ref().map_or(1, |s| s.blocks.slots()).max(1);
        let state_group = self.kvm.state_group();
        let mut restored = [0..0, 0..0];
        'windows: for part in plan.chunks(window) {
            // The SSD's bytes go to the staging slots first (waiting, once, for the copies
            // of the window before): block `k` of the window to slot `k`, the one snapshot a
            // restore takes to snapshot slot 0.
            let staged = |k: usize, p: &Planned| Place { block: Some(k), state: p.state.then_some(0) };
            let bytes: Vec<(Place, &[u8])> = (part.iter().enumerate())
                .filter_map(|(k, p)| match &p.data {
                    BlockData::Bytes { bytes, .. } => Some((staged(k, p), &bytes[..])),
                    BlockData::Held { .. } => None,
                })
                .collect();
            if let Some(staging) = self.staging.as_mut() {
                if staging.write(&bytes).is_err() {
                    break 'windows;
                }
            }
            // Pool blocks for the window's blocks, and where each one's bytes are: staging
            // slots or host-tier slots (looked up again: they may have left the tier).
            let (mut from_staging, mut from_host) = (Vec::new(), Vec::new());
            let mut taken = Vec::new();
            let mut complete = true;
            for (k, p) in part.iter().enumerate() {
                let (i, t) = (p.index, &tokens[p.index * bs..(p.index + 1) * bs]);
                let targets = self.kvm.restore_targets(hashes[i], t, p.state);
                let (mem, moves, place) = match &p.data {
                    BlockData::Bytes { .. } => (self.staging.as_ref(), &mut from_staging, staged(k, p)),
                    BlockData::Held { .. } => {
                        let place = self.host.as_mut().map(|h| h.place_of(hashes[i], t)).unwrap_or_default();
                        (self.host.as_ref().map(HostTier::mem), &mut from_host, place)
                    }
                };
                let lacks_block = targets.iter().any(|&(g, _)| Some(g) != state_group) && place.block.is_none();
                let Some(mem) = mem.filter(|_| !lacks_block) else {
                    self.kvm.finish_restore(hashes[i], t, &targets, &vec![false; targets.len()]);
                    complete = false;
                    break;
                };
                let these = mem.moves(&targets, place);
                // A snapshot that left host RAM meanwhile is not filled: the hit ends earlier.
                let filled: Vec<bool> =
                    targets.iter().map(|&(g, b)| these.iter().any(|m| (m.group, m.block) == (g, b as usize))).collect();
                moves.extend(these);
                taken.push((p, targets, filled));
            }
            // What the pool evicted for them is saved before they are overwritten (the
            // copies run in order on one stream).
            spill(&mut self.kvm, &mut self.host, &self.kv);
            let staged_ok = match self.staging.as_ref() {
                Some(staging) if !from_staging.is_empty() => staging.load(&mut self.kv, &from_staging).is_ok(),
                _ => from_staging.is_empty(),
            };
            let held_ok = match self.host.as_ref() {
                Some(host) if !from_host.is_empty() => host.mem().load(&mut self.kv, &from_host).is_ok(),
                _ => from_host.is_empty(),
            };
            for (p, targets, filled) in taken {
                let (i, t) = (p.index, &tokens[p.index * bs..(p.index + 1) * bs]);
                let ok = match p.data {
                    BlockData::Bytes { .. } => staged_ok,
                    BlockData::Held { .. } => held_ok,
                };
                let filled: Vec<bool> = filled.iter().map(|&f| f && ok).collect();
                self.kvm.finish_restore(hashes[i], t, &targets, &filled);
                if !ok {
                    break 'windows;
                }
                if targets.is_empty() {
                    // The pool had it already (restored for another request meanwhile).
                    continue;
                }
                // Each tier's blocks come in order, one run.
                let r = &mut restored[p.kind as usize];
                *r = if r.start == r.end { i..i + 1 } else { r.start..i + 1 };
                // The SSD's reader counts the bytes it reads.
                match p.kind {
                    TierKind::Host => {
                        let bytes = self.host.as_ref().map_or(0, |h| h.mem().bytes_of(p.state));
                        self.metrics.host_hit_tokens.fetch_add(bs as u64, Relaxed);
                        self.metrics.host_read_bytes.fetch_add(bytes as u64, Relaxed);
                    }
                    TierKind::Ssd => {
                        self.metrics.ssd_hit_tokens.fetch_add(bs as u64, Relaxed);
                    }
                }
            }
            if !complete {
                break;
            }
        }
        self.sched.waiting[w].tier.restored = restored;
    }
}
