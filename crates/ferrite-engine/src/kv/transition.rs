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

use ferrite_runtime::batch::NO_BLOCK;

use super::manager::{take_free, KvManager};
use super::seq_kv::{lock, SeqKv};

impl KvManager {
    /// Move `kv`, a row before its start, into the quantized pools with tables covering
    /// `total` positions; all or nothing (false when the quantized pools lack the blocks).
    pub(super) fn turn(&mut self, kv: &mut SeqKv, total: usize) -> bool {
        debug_assert!(kv.base != 0 && kv.pending.is_empty(), "only a full-precision row turns, once");
        let (bs, groups) = (self.block_size, self.policies.len());
        let entries: Vec<usize> = self.policies.iter().map(|p| p.table_len(total, bs)).collect();
        let released = |g: usize, i: usize| kv.tables[g].get(i) == Some(&NO_BLOCK);
        let need: Vec<usize> =
            entries.iter().enumerate().map(|(g, &n)| (0..n).filter(|&i| !released(g, i)).count()).collect();
        let mut pools = lock(&self.pools);
        if pools.iter().take(groups).zip(&need).any(|(p, &n)| p.num_free() < n) {
            return false;
        }
        let mut tables: Vec<Vec<u32>> = Vec::with_capacity(groups);
        let mut pending = Vec::new();
        for (g, &n) in entries.iter().enumerate() {
            let mut table = Vec::with_capacity(n);
            for i in 0..n {
                let block = match released(g, i) {
                    true => Some(NO_BLOCK),
                    false => take_free(&mut pools[g], g, &mut self.cache, &mut self.spills, groups),
                };
                let Some(block) = block else {
                    // Counted free above; should it happen, what was taken goes back.
                    tables.push(table);
                    for (o, t) in tables.iter().enumerate() {
                        t.iter().filter(|&&b| b != NO_BLOCK).for_each(|&b| pools[o].release(b));
                    }
                    return false;
                };
                match kv.tables[g].get(i) {
                    Some(&old) if old != NO_BLOCK => pending.push((g, old, block)),
                    _ => {}
                }
                table.push(block);
            }
            tables.push(table);
        }
        kv.pending = pending;
        kv.tables = tables;
        kv.base = 0;
        kv.hashes.clear();
        true
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
