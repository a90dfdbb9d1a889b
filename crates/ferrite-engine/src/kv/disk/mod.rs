//! The SSD tier of the prefix cache (`--prefix-cache-dir`, `--prefix-cache-disk-bytes`):
//! content-addressed files of runs of full KV blocks that survive restarts.
//!
//! - A run file is named by the chained hashes of its first and last blocks, which fold in
//!   the namespace digest (model, tokenizer, KV scheme, block size, layout, format version),
//!   which every header repeats. Each block's token ids and payload CRC32 are checked when it
//!   is read: a corrupt, truncated or replaced file is a miss — deleted, counted in
//!   `ssd_corrupt_files` — and the prefix is recomputed.
//! - Writes run on a background writer thread (`io.rs`): temporary file, fsync, rename, fsync
//!   of the directory, then LRU eviction within the byte budget. The queue is bounded by bytes;
//!   a store that does not fit is dropped (`ssd_writes_dropped`), never waited for.
//! - Reads run on a reader thread, ahead of the step that needs them.
//! - The index (`index.rs`) is rebuilt at start-up from file names and run headers.
//!
//! Two servers on one directory: no locks. Temporary names carry the process id and a
//! counter, so writers never share a file, and `rename` publishes a file whole; since names are
//! content addresses, two servers writing the same name write the same bytes. A file another
//! server evicted is a plain miss (gone) here. Each process enforces the budget over the
//! files it knows (those at its start and those it wrote).

mod file;
mod index;
mod io;

use std::fs;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

pub use file::FORMAT_VERSION;
use file::{FileError, GenRecord, RunHeader};
use index::{Index, Kind, GEN_EXT, RUN_EXT};
use io::{ReadJob, WriteJob};

use super::tier::{KvTier, Restored, TierKind};
use crate::metrics::Metrics;

/// Where the SSD tier lives and how much it may hold.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    pub dir: PathBuf,
    /// Bytes of files the directory may hold (`--prefix-cache-disk-bytes`).
    pub max_bytes: u64,
    /// Bytes of stores the write queue may hold before it drops new ones.
    pub queue_bytes: u64,
}

impl DiskConfig {
    pub fn new(dir: PathBuf, max_bytes: u64) -> DiskConfig {
        DiskConfig { dir, max_bytes, queue_bytes: 256 << 20 }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("prefix cache directory {dir}: {source}")]
pub struct DiskError {
    dir: String,
    source: std::io::Error,
}

/// What the engine, reader and writer share.
struct Shared {
    dir: PathBuf,
    namespace: u64,
    block_size: usize,
    group_bytes: Vec<u64>,
    /// The group whose block (a state snapshot) only some blocks carry.
    state_group: Option<usize>,
    index: Mutex<Index>,
    /// Block hashes queued for writing.
    pending: Mutex<std::collections::HashSet<u64>>,
    /// Generations whose records are being deleted (key → the ticket of the last deletion
    /// queued): a lookup never finds them, though the writer has not deleted the file yet.
    forgotten: Mutex<std::collections::HashMap<u64, u64>>,
    /// The last ticket handed out to a deletion.
    tickets: AtomicU64,
    queued_bytes: AtomicU64,
    metrics: Arc<Metrics>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// A file that failed: forget it, and delete and count it when it was corrupt (a file
    /// that vanished was evicted by another server).
    fn failed(&self, name: &str, e: &FileError) {
        lock(&self.index).remove(name);
        if matches!(e, FileError::Corrupt(_)) {
            let _ = fs::remove_file(self.dir.join(name));
            self.metrics.ssd_corrupt_files.fetch_add(1, Relaxed);
        }
        self.gauges();
    }

    fn gauges(&self) {
        let ix = lock(&self.index);
        self.metrics.ssd_bytes.store(ix.total_bytes(), Relaxed);
        self.metrics.ssd_files.store(ix.num_files() as u64, Relaxed);
    }
}

pub struct DiskTier {
    shared: Arc<Shared>,
    writes: Option<mpsc::Sender<WriteJob>>,
    reads: Option<mpsc::Sender<ReadJob>>,
    threads: Vec<JoinHandle<()>>,
    queue_bytes: u64,
}

impl DiskTier {
    /// Open (creating) the directory, rebuild the index and start the reader and writer.
    /// `group_bytes`: bytes of one block of each KV group; `state_group`: the group whose
    /// block, a state snapshot, only some blocks carry (`kv/tier_slots.rs`).
    pub fn open(
        cfg: &DiskConfig,
        namespace: u64,
        block_size: usize,
        (group_bytes, state_group): (Vec<u64>, Option<usize>),
        metrics: Arc<Metrics>,
    ) -> Result<DiskTier, DiskError> {
        let err = |source| DiskError { dir: cfg.dir.display().to_string(), source };
        fs::create_dir_all(&cfg.dir).map_err(err)?;
        let (index, report, evicted) = Index::scan(&cfg.dir, namespace, cfg.max_bytes).map_err(err)?;
        metrics.ssd_corrupt_files.fetch_add(report.corrupt, Relaxed);
        metrics.ssd_evicted_files.fetch_add(evicted.len() as u64, Relaxed);
        let shared = Arc::new(Shared {
            dir: cfg.dir.clone(),
            namespace,
            block_size,
            group_bytes,
            state_group,
            index: Mutex::new(index),
            pending: Mutex::new(Default::default()),
            forgotten: Mutex::new(Default::default()),
            tickets: AtomicU64::new(0),
            queued_bytes: AtomicU64::new(0),
            metrics,
        });
        shared.gauges();
        let (wtx, wrx) = mpsc::channel();
        let (rtx, rrx) = mpsc::channel();
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new().name(name.into()).spawn(f).map_err(err)
        };
        let (ws, rs) = (shared.clone(), shared.clone());
        let threads = vec![
            spawn("ferrite-kv-writer", Box::new(move || io::write_loop(&ws, wrx)))?,
            spawn("ferrite-kv-reader", Box::new(move || io::read_loop(&rs, rrx)))?,
        ];
        Ok(DiskTier { shared, writes: Some(wtx), reads: Some(rtx), threads, queue_bytes: cfg.queue_bytes })
    }

    fn send(&self, job: WriteJob) {
        if let Some(tx) = &self.writes {
            self.shared.metrics.ssd_write_queue_jobs.fetch_add(1, Relaxed);
            if tx.send(job).is_err() {
                self.shared.metrics.ssd_write_queue_jobs.fetch_sub(1, Relaxed);
            }
        }
    }

    fn gen_name(key: u64) -> String {
        format!("{key:016x}.{GEN_EXT}")
    }

    /// Store the record of a generation cut short (queued like any write; dropped when the
    /// writer is behind).
    pub fn store_generation(&self, key: u64, prompt: &[u32], generated: &[u32]) {
        let rec =
            GenRecord { namespace: self.shared.namespace, key, prompt: prompt.to_vec(), generated: generated.to_vec() };
        let bytes = rec.encode();
        let n = bytes.len() as u64;
        // A newer record supersedes a deletion still queued.
        lock(&self.shared.forgotten).remove(&key);
        if self.reserve(n) {
            self.send(WriteJob::File {
                name: Self::gen_name(key),
                parts: vec![bytes],
                kind: Kind::Generation(key),
                reserved: n,
            });
        }
    }

    /// Delete the record of generation `key`, if one was (or is being) written.
    pub fn forget_generation(&self, key: u64) {
        let ticket = self.shared.tickets.fetch_add(1, Relaxed) + 1;
        lock(&self.shared.forgotten).insert(key, ticket);
        self.send(WriteJob::ForgetGeneration { name: Self::gen_name(key), key, ticket });
    }

    /// The tokens generated so far by the cut generation `key` of `prompt`, if its record is
    /// here and intact (a small synchronous read).
    pub fn load_generation(&self, key: u64, prompt: &[u32]) -> Option<Vec<u32>> {
        if lock(&self.shared.forgotten).contains_key(&key) {
            return None;
        }
        let name = lock(&self.shared.index).generation(key)?.to_string();
        let rec = fs::read(self.shared.dir.join(&name)).map_err(FileError::from).and_then(|b| GenRecord::decode(&b));
        match rec {
            Ok(r) if r.namespace == self.shared.namespace && r.key == key && r.prompt == prompt => Some(r.generated),
            // Another prompt under this key (a digest collision): not ours, leave it.
            Ok(r) if r.namespace == self.shared.namespace && r.key == key => None,
            Ok(_) => {
                self.shared.failed(&name, &FileError::Corrupt("a record under another key"));
                None
            }
            Err(e) => {
                self.shared.failed(&name, &e);
                None
            }
        }
    }

    /// Reserve room in the write queue for `bytes`; false (and the store dropped) when the
    /// writer is behind.
    pub fn reserve(&self, bytes: u64) -> bool {
        let q = &self.shared.queued_bytes;
        let before = q.fetch_add(bytes, Relaxed);
        // One store always fits an empty queue.
        if before > 0 && before + bytes > self.queue_bytes {
            q.fetch_sub(bytes, Relaxed);
            self.shared.metrics.ssd_writes_dropped.fetch_add(1, Relaxed);
            return false;
        }
        self.shared.metrics.ssd_write_queue_bytes.store(before + bytes, Relaxed);
        true
    }

    /// Store a run of consecutive blocks (`payload`: each block's bytes, in order, with its
    /// snapshot where `states` says it carries one) for which `reserved` bytes were reserved;
    /// a run of no blocks frees the reservation.
    pub fn store(&self, hashes: Vec<u64>, tokens: Vec<u32>, states: Vec<bool>, payload: Vec<u8>, reserved: u64) {
        let (Some(&first), Some(&last)) = (hashes.first(), hashes.last()) else {
            let left = self.shared.queued_bytes.fetch_sub(reserved, Relaxed) - reserved;
            self.shared.metrics.ssd_write_queue_bytes.store(left, Relaxed);
            return;
        };
        let s = &self.shared;
        let mut header = RunHeader {
            namespace: s.namespace,
            block_size: s.block_size as u32,
            group_bytes: s.group_bytes.clone(),
            state_group: s.state_group.map(|g| g as u32),
            hashes: hashes.clone(),
            checksums: Vec::new(),
            states,
            tokens,
        };
        let ends = header.offsets().iter().map(|&o| (o - header.encoded_len() as u64) as usize).collect::<Vec<_>>();
        header.checksums =
            ends.windows(2).map(|w| crc32fast::hash(payload.get(w[0]..w[1]).unwrap_or_default())).collect();
        lock(&s.pending).extend(&hashes);
        let name = format!("{first:016x}-{last:016x}.{RUN_EXT}");
        self.send(WriteJob::File { name, parts: vec![header.encode(), payload], kind: Kind::Run(hashes), reserved });
    }
}

impl KvTier for DiskTier {
    fn kind(&self) -> TierKind {
        TierKind::Ssd
    }

    fn holds(&self, hash: u64) -> bool {
        lock(&self.shared.index).locate(hash).is_some() || lock(&self.shared.pending).contains(&hash)
    }

    fn run_len(&self, hashes: &[u64]) -> usize {
        let ix = lock(&self.shared.index);
        hashes.iter().take_while(|&&h| ix.locate(h).is_some()).count()
    }

    fn fetch(&self, first: usize, hashes: Vec<u64>, tokens: Vec<u32>) -> Option<mpsc::Receiver<Restored>> {
        let (reply, rx) = mpsc::channel();
        self.reads.as_ref()?.send(ReadJob { first, hashes, tokens, reply }).ok()?;
        Some(rx)
    }
}

impl Drop for DiskTier {
    /// Finish the queued writes (a shutdown keeps what it published), then stop.
    fn drop(&mut self) {
        self.writes.take();
        self.reads.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
