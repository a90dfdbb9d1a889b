//! Engine counters and gauges, updated by the engine thread and read by anyone (the server's
//! `/metrics`, benchmarks, tests) without locking.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

#[derive(Debug, Default)]
pub struct Metrics {
    pub requests_added: AtomicU64,
    pub requests_finished: AtomicU64,
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub kv_blocks_free: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    /// KV bytes a token of context takes, and the tokens the cache holds.
    pub kv_bytes_per_token: AtomicU64,
    pub kv_capacity_tokens: AtomicU64,
    pub prefix_queried_tokens: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub batched_tokens: AtomicU64,
    pub steps: AtomicU64,
    pub preemptions: AtomicU64,
    /// Forward passes of the draft model.
    pub draft_forwards: AtomicU64,
    /// Tokens drafted for verification (speculation and echo fill) and those accepted.
    pub verify_proposed_tokens: AtomicU64,
    pub verify_accepted_tokens: AtomicU64,
    /// Tokens appended without sampling (fill asserts).
    pub asserted_tokens: AtomicU64,
    /// Steps queued on the device while the one before them still ran (`core/overlap.rs`).
    pub overlapped_steps: AtomicU64,
    /// Rows whose KV turned quantized at their delayed start, and the full-precision blocks
    /// converted when they did (`kv/transition.rs`).
    pub kv_transitions: AtomicU64,
    pub kv_converted_blocks: AtomicU64,
    /// Host-RAM tier (`kv/host.rs`): prompt tokens looked up there (past the pool's hit) and
    /// the tokens restored from it; bytes copied in (saves of evicted blocks) and out
    /// (restores); blocks and bytes held, the budget; blocks it evicted, and saves that failed.
    pub host_lookup_tokens: AtomicU64,
    pub host_hit_tokens: AtomicU64,
    pub host_written_bytes: AtomicU64,
    pub host_read_bytes: AtomicU64,
    pub host_blocks: AtomicU64,
    pub host_bytes: AtomicU64,
    pub host_capacity_bytes: AtomicU64,
    pub host_evicted_blocks: AtomicU64,
    pub host_failed_saves: AtomicU64,
    /// SSD tier (`kv/disk`): prompt tokens looked up there (past the pool's hit) and the
    /// tokens restored from it.
    pub ssd_lookup_tokens: AtomicU64,
    pub ssd_hit_tokens: AtomicU64,
    pub ssd_read_bytes: AtomicU64,
    pub ssd_written_bytes: AtomicU64,
    /// Time the writer spent writing (for its throughput).
    pub ssd_write_micros: AtomicU64,
    /// Bytes and files in the directory.
    pub ssd_bytes: AtomicU64,
    pub ssd_files: AtomicU64,
    /// Stores waiting for the writer, and their bytes.
    pub ssd_write_queue_jobs: AtomicU64,
    pub ssd_write_queue_bytes: AtomicU64,
    /// Stores dropped because the writer was behind (or failed).
    pub ssd_writes_dropped: AtomicU64,
    pub ssd_evicted_files: AtomicU64,
    /// Corrupt, truncated or replaced files found (each deleted, each a miss).
    pub ssd_corrupt_files: AtomicU64,
    /// Generations continued from a record of an interrupted one, and the tokens replayed.
    pub resumed_generations: AtomicU64,
    pub resumed_tokens: AtomicU64,
}

impl Metrics {
    pub(crate) fn requests_added(&self) {
        self.requests_added.fetch_add(1, Relaxed);
    }
    pub(crate) fn request_finished(&self) {
        self.requests_finished.fetch_add(1, Relaxed);
    }
    pub(crate) fn set_queue(&self, running: usize, waiting: usize) {
        self.running.store(running as u64, Relaxed);
        self.waiting.store(waiting as u64, Relaxed);
    }
    pub(crate) fn set_kv(&self, (free, total): (usize, usize)) {
        self.kv_blocks_free.store(free as u64, Relaxed);
        self.kv_blocks_total.store(total as u64, Relaxed);
    }
    pub(crate) fn set_kv_size(&self, bytes_per_token: usize, capacity_tokens: usize) {
        self.kv_bytes_per_token.store(bytes_per_token as u64, Relaxed);
        self.kv_capacity_tokens.store(capacity_tokens as u64, Relaxed);
    }
    pub(crate) fn set_prefix(&self, queried: u64, hit: u64) {
        self.prefix_queried_tokens.store(queried, Relaxed);
        self.prefix_hit_tokens.store(hit, Relaxed);
    }
    pub(crate) fn set_preemptions(&self, n: u64) {
        self.preemptions.store(n, Relaxed);
    }
    pub(crate) fn add_generated(&self, n: u64) {
        self.generated_tokens.fetch_add(n, Relaxed);
    }
    pub(crate) fn set_draft_forwards(&self, n: u64) {
        self.draft_forwards.store(n, Relaxed);
    }
    pub(crate) fn add_proposed(&self, n: usize) {
        self.verify_proposed_tokens.fetch_add(n as u64, Relaxed);
    }
    pub(crate) fn add_accepted(&self, n: usize) {
        self.verify_accepted_tokens.fetch_add(n as u64, Relaxed);
    }
    pub(crate) fn add_asserted(&self, n: usize) {
        self.asserted_tokens.fetch_add(n as u64, Relaxed);
    }
    pub(crate) fn add_overlapped(&self) {
        self.overlapped_steps.fetch_add(1, Relaxed);
    }
    pub(crate) fn add_transition(&self, blocks: u64) {
        self.kv_transitions.fetch_add(1, Relaxed);
        self.kv_converted_blocks.fetch_add(blocks, Relaxed);
    }
    pub(crate) fn add_batch(&self, tokens: usize) {
        self.batched_tokens.fetch_add(tokens as u64, Relaxed);
        self.steps.fetch_add(1, Relaxed);
    }

    /// Fraction of looked-up prompt tokens served from the prefix cache.
    pub fn prefix_hit_rate(&self) -> f64 {
        let q = self.prefix_queried_tokens.load(Relaxed);
        if q == 0 {
            0.0
        } else {
            self.prefix_hit_tokens.load(Relaxed) as f64 / q as f64
        }
    }
}
