//! `BlockPool`: fixed-size KV blocks with reference counts and an O(1) free list.
//!
//! Block ids index the runtime's `KvCache` pools. A block is free when its count is zero; a
//! shared block (a forked sequence, a cached prefix) has a count above one.

#[derive(Debug)]
pub struct BlockPool {
    ref_counts: Vec<u32>,
    free: Vec<u32>,
    block_size: usize,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> BlockPool {
        BlockPool {
            ref_counts: vec![0; num_blocks],
            // Pop from the end: hand out low ids first.
            free: (0..num_blocks as u32).rev().collect(),
            block_size,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Take a free block (count 1), or `None` when the pool is exhausted.
    pub fn allocate(&mut self) -> Option<u32> {
        let id = self.free.pop()?;
        self.ref_counts[id as usize] = 1;
        Some(id)
    }

    /// Add a reference to a block another owner holds.
    pub fn retain(&mut self, id: u32) {
        debug_assert!(self.ref_counts[id as usize] > 0, "retain of a free block {id}");
        self.ref_counts[id as usize] += 1;
    }

    /// Drop one reference; the block returns to the free list at zero.
    pub fn release(&mut self, id: u32) {
        let c = &mut self.ref_counts[id as usize];
        debug_assert!(*c > 0, "double free of block {id}");
        *c = c.saturating_sub(1);
        if *c == 0 {
            self.free.push(id);
        }
    }

    /// Grow `table` so it covers `tokens` positions; on exhaustion nothing is taken.
    pub fn grow(&mut self, table: &mut Vec<u32>, tokens: usize) -> bool {
        let need = self.blocks_for(tokens).saturating_sub(table.len());
        if need > self.free.len() {
            return false;
        }
        for _ in 0..need {
            if let Some(b) = self.allocate() {
                table.push(b);
            }
        }
        true
    }

    /// Release every block of `table` and clear it.
    pub fn release_all(&mut self, table: &mut Vec<u32>) {
        for b in table.drain(..) {
            self.release(b);
        }
    }

    /// Check the free list and counts agree (debug builds call this after each step).
    pub fn check_invariants(&self) -> Result<(), String> {
        let zero = self.ref_counts.iter().filter(|&&c| c == 0).count();
        if zero != self.free.len() {
            return Err(format!("{zero} blocks have count 0 but {} are on the free list", self.free.len()));
        }
        if let Some(b) = self.free.iter().find(|&&b| self.ref_counts[b as usize] != 0) {
            return Err(format!("block {b} is on the free list with a non-zero count"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_and_exhaustion() {
        let mut p = BlockPool::new(3, 16);
        let mut t = Vec::new();
        assert!(p.grow(&mut t, 33));
        assert_eq!(t.len(), 3);
        assert_eq!(p.num_free(), 0);
        let mut t2 = Vec::new();
        assert!(!p.grow(&mut t2, 1));
        p.retain(t[0]);
        p.release_all(&mut t);
        assert_eq!(p.num_free(), 2);
        p.check_invariants().unwrap();
    }
}
