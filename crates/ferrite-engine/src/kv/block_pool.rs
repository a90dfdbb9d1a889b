//! `BlockPool`: fixed-size KV blocks with reference counts and an O(1) LRU free list.
//!
//! Block ids index one KV group's storage in the runtime's `KvCache`. A block is free when its
//! count is zero; a shared block (a forked sequence, a cached prefix) has a count above one.
//! Free blocks form a doubly-linked list: allocation takes the least recently freed block,
//! release appends, and a prefix-cache hit on a free block unlinks it — all O(1). A free block
//! may still hold a cached prefix (its `hash`); allocating it evicts that entry.

const NIL: u32 = u32::MAX;

#[derive(Debug)]
pub struct BlockPool {
    ref_counts: Vec<u32>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_free: usize,
    /// Prefix-cache key of a block whose contents are cached.
    hash: Vec<Option<u64>>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> BlockPool {
        let n = num_blocks as u32;
        BlockPool {
            ref_counts: vec![0; num_blocks],
            prev: (0..n).map(|i| if i == 0 { NIL } else { i - 1 }).collect(),
            next: (0..n).map(|i| if i + 1 == n { NIL } else { i + 1 }).collect(),
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            num_free: num_blocks,
            hash: vec![None; num_blocks],
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }
    /// Blocks with no owner (some may still hold evictable cached prefixes).
    pub fn num_free(&self) -> usize {
        self.num_free
    }
    pub fn ref_count(&self, id: u32) -> u32 {
        self.ref_counts[id as usize]
    }
    pub fn hash(&self, id: u32) -> Option<u64> {
        self.hash[id as usize]
    }
    pub fn set_hash(&mut self, id: u32, h: Option<u64>) {
        self.hash[id as usize] = h;
    }

    fn unlink(&mut self, id: u32) {
        let (p, n) = (self.prev[id as usize], self.next[id as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[id as usize] = NIL;
        self.next[id as usize] = NIL;
        self.num_free -= 1;
    }

    fn push_tail(&mut self, id: u32) {
        self.prev[id as usize] = self.tail;
        self.next[id as usize] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    /// Take the least recently freed block (count 1). Returns it and the prefix-cache key it
    /// held, which the caller must evict; `None` when no block is free.
    pub fn allocate(&mut self) -> Option<(u32, Option<u64>)> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.unlink(id);
        self.ref_counts[id as usize] = 1;
        Some((id, self.hash[id as usize].take()))
    }

    /// Add a reference to a block (a free one leaves the free list: a cache hit).
    pub fn retain(&mut self, id: u32) {
        if self.ref_counts[id as usize] == 0 {
            self.unlink(id);
        }
        self.ref_counts[id as usize] += 1;
    }

    /// Drop one reference; at zero the block becomes the most recently freed.
    pub fn release(&mut self, id: u32) {
        let c = &mut self.ref_counts[id as usize];
        debug_assert!(*c > 0, "double free of block {id}");
        if *c == 0 {
            return;
        }
        *c -= 1;
        if *c == 0 {
            self.push_tail(id);
        }
    }

    /// Check that the free list and the counts agree (tests and debug builds call this).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = 0;
        let mut cur = self.head;
        let mut prev = NIL;
        while cur != NIL {
            if self.ref_counts[cur as usize] != 0 {
                return Err(format!("block {cur} is on the free list with count {}", self.ref_counts[cur as usize]));
            }
            if self.prev[cur as usize] != prev {
                return Err(format!("free list back-link of block {cur} is broken"));
            }
            seen += 1;
            if seen > self.num_blocks() {
                return Err("free list has a cycle".into());
            }
            prev = cur;
            cur = self.next[cur as usize];
        }
        let zero = self.ref_counts.iter().filter(|&&c| c == 0).count();
        if seen != self.num_free || zero != self.num_free {
            return Err(format!("{zero} blocks have count 0, {seen} are linked, num_free says {}", self.num_free));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_order_retain_and_eviction() {
        let mut p = BlockPool::new(3);
        let a = p.allocate().unwrap().0;
        let b = p.allocate().unwrap().0;
        let c = p.allocate().unwrap().0;
        assert!(p.allocate().is_none());
        p.set_hash(b, Some(42));
        p.release(b);
        p.release(a);
        p.check_invariants().unwrap();
        // A cache hit revives b from the middle of the free list.
        p.retain(b);
        assert_eq!(p.num_free(), 1);
        p.release(b);
        // LRU: a was freed before b's second release.
        assert_eq!(p.allocate(), Some((a, None)));
        assert_eq!(p.allocate(), Some((b, Some(42))));
        p.release(c);
        p.release(a);
        p.release(b);
        assert_eq!(p.num_free(), 3);
        p.check_invariants().unwrap();
    }
}
