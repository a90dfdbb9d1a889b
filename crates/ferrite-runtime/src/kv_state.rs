//! Recurrent state: the fixed-size memory a linear-attention layer (gated DeltaNet) keeps per
//! sequence in place of keys and values, and the rule that says which state slots a row of a
//! step reads and writes.
//!
//! A layer's state is a short convolution window (the last `conv_kernel - 1` inputs of its
//! causal depthwise conv, `[conv_kernel - 1][channels]`) and the recurrent matrix of each value
//! head (`[heads][k_dim][v_dim]`), f32. A `StatePool` holds one such state per slot; the slots
//! of a recurrent KV group are its "blocks" (every state layer of the group has its own pool,
//! indexed by the same slot ids), handed out by the engine like any block.
//!
//! Which slot holds which state is positional, the same table a full-attention group keeps:
//! table entry `e` holds the state after position `min((e + 1) · block_size, computed)` — the
//! state at the end of its block (a snapshot the prefix cache can serve), or the live state
//! for the block the sequence is in. An entry may be `NO_BLOCK` where no snapshot is kept.
//! A row whose first query position is `p` therefore reads entry `(p - 1) / block_size` (the
//! zero state at `p = 0`), and writes the state after each of its positions that ends a block
//! whose entry holds a slot, and after its last position (that entry must hold one). A verify
//! row (or a draft model's drafting row) also names `span_states`: slot `i` gets the state
//! after its first `i + 1` query tokens, so a rollback to any accepted length finds its state
//! (`state_rows`).

use crate::batch::{ForwardBatch, NO_BLOCK};
use crate::error::{Result, RuntimeError};
use crate::hugemem::HugeVec;

/// The shape of one layer's recurrent state, and the KV group whose slots hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateSpec {
    /// Channels of the causal convolution (q, k and v of every head).
    pub conv_channels: usize,
    /// Taps of the convolution; the state keeps `conv_kernel - 1` inputs.
    pub conv_kernel: usize,
    /// Value heads, each with a `[k_dim][v_dim]` recurrent matrix.
    pub heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub group: usize,
}

impl StateSpec {
    /// f32 values of one slot's convolution window.
    pub fn conv_values(&self) -> usize {
        self.conv_channels * self.conv_kernel.saturating_sub(1)
    }

    /// f32 values of one slot's recurrent matrices.
    pub fn ssm_values(&self) -> usize {
        self.heads * self.k_dim * self.v_dim
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> usize {
        4 * (self.conv_values() + self.ssm_values())
    }
}

/// One layer's states, one per slot.
pub struct StatePool {
    pub spec: StateSpec,
    conv: HugeVec<f32>,
    ssm: HugeVec<f32>,
    slots: usize,
}

impl StatePool {
    /// `slots` zero states (unbacked memory until written).
    pub fn zeroed(spec: StateSpec, slots: usize) -> StatePool {
        StatePool {
            spec,
            conv: HugeVec::zeroed(slots * spec.conv_values()),
            ssm: HugeVec::zeroed(slots * spec.ssm_values()),
            slots,
        }
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    /// An error unless `slot` exists.
    pub fn check(&self, slot: u32) -> Result<usize> {
        check_slot(slot, self.slots)
    }

    /// The convolution window of `slot`, `[conv_kernel - 1][channels]` (oldest input first).
    pub fn conv(&self, slot: u32) -> Result<&[f32]> {
        let (s, n) = (self.check(slot)?, self.spec.conv_values());
        Ok(&self.conv[s * n..(s + 1) * n])
    }

    pub fn conv_mut(&mut self, slot: u32) -> Result<&mut [f32]> {
        let (s, n) = (self.check(slot)?, self.spec.conv_values());
        Ok(&mut self.conv[s * n..(s + 1) * n])
    }

    /// The recurrent matrices of `slot`, `[heads][k_dim][v_dim]`.
    pub fn ssm(&self, slot: u32) -> Result<&[f32]> {
        let (s, n) = (self.check(slot)?, self.spec.ssm_values());
        Ok(&self.ssm[s * n..(s + 1) * n])
    }

    pub fn ssm_mut(&mut self, slot: u32) -> Result<&mut [f32]> {
        let (s, n) = (self.check(slot)?, self.spec.ssm_values());
        Ok(&mut self.ssm[s * n..(s + 1) * n])
    }

    /// The raw bytes of `slot` as a tier block holds them (`kv_host`): its convolution window,
    /// then its recurrent matrices. Panics for a slot that does not exist (callers check it).
    pub(crate) fn slot_parts(&self, slot: usize) -> [&[u8]; 2] {
        let (c, m) = (self.spec.conv_values(), self.spec.ssm_values());
        [
            bytemuck::cast_slice(&self.conv[slot * c..(slot + 1) * c]),
            bytemuck::cast_slice(&self.ssm[slot * m..(slot + 1) * m]),
        ]
    }

    /// `slot_parts`, to overwrite.
    pub(crate) fn slot_parts_mut(&mut self, slot: usize) -> [&mut [u8]; 2] {
        let (c, m) = (self.spec.conv_values(), self.spec.ssm_values());
        [
            bytemuck::cast_slice_mut(&mut self.conv[slot * c..(slot + 1) * c]),
            bytemuck::cast_slice_mut(&mut self.ssm[slot * m..(slot + 1) * m]),
        ]
    }

    /// The whole recurrent-matrix storage (kernels that write disjoint heads of several
    /// slots from parallel workers index it themselves, after `check`ing every slot).
    pub(crate) fn ssm_all_mut(&mut self) -> &mut [f32] {
        &mut self.ssm
    }
}

/// Where one row of a step reads its recurrent state and where it writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateRow {
    /// The row's query tokens in the batch.
    pub tokens: std::ops::Range<usize>,
    /// The slot holding the state before the row's first token; None: the zero state of a
    /// sequence's start.
    pub read: Option<u32>,
    /// `(n, slot)`: the state after the row's first `n` tokens goes to `slot`; ascending `n`,
    /// the last one `n = tokens.len()`.
    pub writes: Vec<(usize, u32)>,
}

/// `slot` as an index, or an error unless it is one of `slots`.
fn check_slot(slot: u32, slots: usize) -> Result<usize> {
    let s = slot as usize;
    if slot == NO_BLOCK || s >= slots {
        return Err(RuntimeError::Shape(format!("state slot {slot} of {slots} does not exist")));
    }
    Ok(s)
}

/// Check that every slot of `rows` is one of `slots` and that no row writes a slot another
/// row reads or writes, or one slot twice (the CPU's parallel workers and the CUDA kernels'
/// threads would race).
pub fn check_rows(slots: usize, rows: &[StateRow]) -> Result<()> {
    let mut written = std::collections::HashSet::new();
    for row in rows {
        let mut mine = std::collections::HashSet::new();
        for &(_, slot) in &row.writes {
            check_slot(slot, slots)?;
            if !mine.insert(slot) {
                return Err(RuntimeError::Shape(format!("a row writes state slot {slot} twice")));
            }
            if written.contains(&slot) {
                return Err(RuntimeError::Shape(format!("state slot {slot} is written by two rows")));
            }
        }
        written.extend(mine);
    }
    for (r, row) in rows.iter().enumerate() {
        if let Some(slot) = row.read {
            check_slot(slot, slots)?;
            let own = row.writes.iter().any(|&(_, s)| s == slot);
            if !own && written.contains(&slot) {
                return Err(RuntimeError::Shape(format!("row {r} reads state slot {slot}, which another row writes")));
            }
        }
    }
    Ok(())
}

/// The reads and writes of every row of `batch` in the recurrent group `group` (see the
/// module docs). An error names a row whose table lacks the slot it must read or write.
pub fn state_rows(batch: &ForwardBatch, group: usize, block_size: usize) -> Result<Vec<StateRow>> {
    if block_size == 0 {
        return Err(RuntimeError::Shape("block size 0".into()));
    }
    let mut out = Vec::with_capacity(batch.rows.len());
    for (r, row) in batch.rows.iter().enumerate() {
        let tokens = row.query_start..row.query_start + row.query_len;
        let table = row.block_tables.get(group).map(Vec::as_slice).unwrap_or(&[]);
        let entry = |e: usize| table.get(e).copied().filter(|&s| s != NO_BLOCK);
        let (first, context) = (row.first_position(), row.context_len);
        let missing = |what: &str, e: usize| {
            RuntimeError::Shape(format!("row {r}: no state slot to {what} (table entry {e} of {})", table.len()))
        };
        let read = match first {
            0 => None,
            p => Some(entry((p - 1) / block_size).ok_or_else(|| missing("read", (p - 1) / block_size))?),
        };
        let mut writes = Vec::new();
        for n in 1..=row.query_len {
            let len = first + n;
            if let Some(&slot) = row.span_states.get(n - 1) {
                writes.push((n, slot));
            }
            let e = (len - 1) / block_size;
            if len == context {
                writes.push((n, entry(e).ok_or_else(|| missing("write", e))?));
            } else if len.is_multiple_of(block_size) {
                if let Some(slot) = entry(e) {
                    writes.push((n, slot));
                }
            }
        }
        out.push(StateRow { tokens, read, writes });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::RowLogits;

    #[test]
    fn rows_read_the_entry_before_them_and_write_block_ends_the_end_and_the_span() {
        let mut b = ForwardBatch::default();
        // Positions 0..6, block 4: no read; writes the block end (entry 0) and the end (entry 1).
        b.push_row(&[1; 6], 6, vec![vec![10, 11]], RowLogits::Last);
        // Positions 6..8 (decode-like): reads entry 1 (position 5), writes the end at 8 = a block end.
        b.push_row(&[1; 2], 8, vec![vec![NO_BLOCK, 11]], RowLogits::Last);
        // A verify row at 9..12 with span slots: state after 1 and 2 tokens into the span.
        b.push_row(&[1; 3], 12, vec![vec![NO_BLOCK, NO_BLOCK, 12]], RowLogits::All);
        b.rows[2].span_states = vec![20, 21];
        // A drafting row of one token whose state also goes to a span slot.
        b.push_row(&[1], 13, vec![vec![NO_BLOCK, NO_BLOCK, 12, 13]], RowLogits::Last);
        b.rows[3].span_states = vec![22];
        let rows = state_rows(&b, 0, 4).expect("rows");
        assert_eq!(rows[3], StateRow { tokens: 11..12, read: Some(12), writes: vec![(1, 22), (1, 13)] });
        assert_eq!(rows[0], StateRow { tokens: 0..6, read: None, writes: vec![(4, 10), (6, 11)] });
        assert_eq!(rows[1], StateRow { tokens: 6..8, read: Some(11), writes: vec![(2, 11)] });
        assert_eq!(rows[2], StateRow { tokens: 8..11, read: Some(12), writes: vec![(1, 20), (2, 21), (3, 12)] });
        // A missing end entry is an error, not a silent drop of the state.
        let mut bad = ForwardBatch::default();
        bad.push_row(&[1; 2], 6, vec![vec![10, NO_BLOCK]], RowLogits::Last);
        assert!(state_rows(&bad, 0, 4).is_err());
    }
}
