//! The SSD tier's two threads. The writer takes stores off the queue in order and writes
//! each atomically (temporary file named by process and counter, fsync, rename, fsync of the
//! directory), then registers it and evicts down to the budget. The reader serves read-ahead
//! requests: for each wanted block it finds the file and slot in the index, checks the
//! header, the block's hash and token ids and the payload CRC32, and stops at the first block
//! that is missing or bad; a bad file is deleted and counted.

use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc;
use std::time::{Instant, SystemTime};

use super::file::{FileError, RunHeader};
use super::index::{stamp, Entry, Kind, TMP_EXT};
use super::{lock, Shared};
use crate::kv::tier::{BlockData, Restored};

pub(super) enum WriteJob {
    /// Write `parts`, concatenated, as file `name`.
    File { name: String, parts: Vec<Vec<u8>>, kind: Kind, reserved: u64 },
    /// Delete the record of generation `key` (`DiskTier::forget_generation`, its `ticket`).
    ForgetGeneration { name: String, key: u64, ticket: u64 },
}

pub(super) struct ReadJob {
    pub first: usize,
    pub hashes: Vec<u64>,
    pub tokens: Vec<u32>,
    pub reply: mpsc::Sender<Restored>,
}

/// Write `parts` to `name` in `shared.dir` atomically; the bytes written.
fn write_atomically(shared: &Shared, name: &str, parts: &[Vec<u8>]) -> std::io::Result<u64> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let tmp = shared.dir.join(format!("{name}.{}.{}.{TMP_EXT}", std::process::id(), COUNTER.fetch_add(1, Relaxed)));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        for p in parts {
            f.write_all(p)?;
        }
        f.sync_all()?;
        fs::rename(&tmp, shared.dir.join(name))?;
        File::open(&shared.dir)?.sync_all()?;
        Ok(parts.iter().map(|p| p.len() as u64).sum())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

pub(super) fn write_loop(shared: &Shared, jobs: mpsc::Receiver<WriteJob>) {
    // Writes are background work: a store the writer has no time for waits in the bounded
    // queue (and is dropped past it); a decode step never waits for the writer.
    ferrite_runtime::threads::run_at_lowest_priority();
    let m = &shared.metrics;
    for job in jobs {
        match job {
            WriteJob::File { name, parts, kind, reserved } => {
                let t0 = Instant::now();
                let size: u64 = parts.iter().map(|p| p.len() as u64).sum();
                // A file larger than the whole budget could never stay.
                let written = if size > lock(&shared.index).budget {
                    Err(std::io::Error::other("larger than the byte budget"))
                } else {
                    write_atomically(shared, &name, &parts)
                };
                m.ssd_write_micros.fetch_add(t0.elapsed().as_micros() as u64, Relaxed);
                let hashes = match &kind {
                    Kind::Run(h) => h.clone(),
                    _ => Vec::new(),
                };
                match written {
                    Ok(bytes) => {
                        let entry = Entry { bytes, last_use: stamp(SystemTime::now()), kind };
                        let evicted = lock(&shared.index).add(name, entry);
                        for e in &evicted {
                            let _ = fs::remove_file(shared.dir.join(e));
                        }
                        m.ssd_written_bytes.fetch_add(bytes, Relaxed);
                        m.ssd_evicted_files.fetch_add(evicted.len() as u64, Relaxed);
                    }
                    Err(e) => {
                        if size <= lock(&shared.index).budget {
                            eprintln!("ferrite-engine: prefix cache write of {name} failed: {e}");
                        }
                        m.ssd_writes_dropped.fetch_add(1, Relaxed);
                    }
                }
                let mut pending = lock(&shared.pending);
                hashes.iter().for_each(|h| {
                    pending.remove(h);
                });
                drop(pending);
                let left = shared.queued_bytes.fetch_sub(reserved, Relaxed) - reserved;
                m.ssd_write_queue_bytes.store(left, Relaxed);
            }
            WriteJob::ForgetGeneration { name, key, ticket } => {
                lock(&shared.index).remove(&name);
                let _ = fs::remove_file(shared.dir.join(&name));
                let mut forgotten = lock(&shared.forgotten);
                if forgotten.get(&key) == Some(&ticket) {
                    forgotten.remove(&key);
                }
            }
        }
        m.ssd_write_queue_jobs.fetch_sub(1, Relaxed);
        shared.gauges();
    }
}

pub(super) fn read_loop(shared: &Shared, jobs: mpsc::Receiver<ReadJob>) {
    for job in jobs {
        let restored = read_run(shared, &job);
        // The request may have left meanwhile: nobody to tell.
        let _ = job.reply.send(restored);
    }
}

/// Open run file `name` and check that its header is one this tier writes.
fn open_run(shared: &Shared, name: &str) -> Result<(File, RunHeader), FileError> {
    let mut f = File::open(shared.dir.join(name))?;
    let h = RunHeader::read(&mut std::io::BufReader::new(&mut f))?;
    if h.namespace != shared.namespace
        || h.block_size as usize != shared.block_size
        || h.group_bytes != shared.group_bytes
        || h.state_group.map(|g| g as usize) != shared.state_group
    {
        return Err(FileError::Corrupt("a run of another namespace under this name"));
    }
    Ok((f, h))
}

/// An open run: its name, file, header and where each block starts (`RunHeader::offsets`).
struct OpenRun {
    name: String,
    file: File,
    header: RunHeader,
    offsets: Vec<u64>,
}

impl OpenRun {
    /// Block `slot`, checked against `hash` and `tokens`: its bytes, and whether they end with
    /// its snapshot.
    fn block(&self, slot: usize, hash: u64, tokens: &[u32]) -> Result<(Vec<u8>, bool), FileError> {
        let h = &self.header;
        let bs = h.block_size as usize;
        if h.hashes.get(slot) != Some(&hash) || h.tokens.get(slot * bs..(slot + 1) * bs) != Some(tokens) {
            return Err(FileError::Corrupt("block hash or token ids differ"));
        }
        let (at, end) = (self.offsets[slot], self.offsets[slot + 1]);
        let mut buf = vec![0u8; (end - at) as usize];
        self.file.read_exact_at(&mut buf, at).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => FileError::Corrupt("truncated"),
            _ => FileError::Io(e),
        })?;
        if h.checksums.get(slot) != Some(&crc32fast::hash(&buf)) {
            return Err(FileError::Corrupt("payload checksum"));
        }
        Ok((buf, h.states[slot]))
    }
}

/// Threads that read and check one run's blocks at most.
const READ_THREADS: usize = 8;

/// Read the blocks of `job` from the first: the files are opened and their headers checked in
/// order, then the blocks are read and checked by up to `READ_THREADS` threads (a long prefix is
/// gigabytes; one thread reads and checksums a few GB/s), and the run ends at the first block
/// that is missing or bad.
fn read_run(shared: &Shared, job: &ReadJob) -> Restored {
    let bs = shared.block_size;
    let mut out = Restored { first: job.first, blocks: Vec::new() };
    // Where each block is: an index into `files` and its slot there.
    let mut files: Vec<OpenRun> = Vec::new();
    let mut wanted: Vec<(usize, usize)> = Vec::new();
    for &hash in &job.hashes {
        let Some((name, slot)) = lock(&shared.index).locate(hash).map(|(n, s)| (n.to_string(), s as usize)) else {
            break;
        };
        if files.last().is_none_or(|r| r.name != name) {
            match open_run(shared, &name) {
                Ok((file, header)) => files.push(OpenRun { name, file, offsets: header.offsets(), header }),
                Err(e) => {
                    shared.failed(&name, &e);
                    break;
                }
            }
        }
        wanted.push((files.len() - 1, slot));
    }
    let threads = READ_THREADS.min(std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let per_thread = wanted.len().div_ceil(threads).max(1);
    let read = |first: usize, part: &[(usize, usize)]| -> Vec<Result<(Vec<u8>, bool), FileError>> {
        let mut got = Vec::with_capacity(part.len());
        for (k, &(file, slot)) in part.iter().enumerate() {
            let j = first + k;
            let r = files[file].block(slot, job.hashes[j], &job.tokens[j * bs..(j + 1) * bs]);
            let failed = r.is_err();
            got.push(r);
            if failed {
                break;
            }
        }
        got
    };
    let read = &read;
    let results: Vec<Result<(Vec<u8>, bool), FileError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (wanted.chunks(per_thread).enumerate())
            .map(|(t, part)| scope.spawn(move || read(t * per_thread, part)))
            .collect();
        let mut all = Vec::with_capacity(wanted.len());
        for h in handles {
            let part = h.join().unwrap_or_else(|_| vec![Err(FileError::Corrupt("a reader thread panicked"))]);
            let complete = part.iter().all(Result::is_ok);
            all.extend(part);
            if !complete {
                break;
            }
        }
        all
    });
    let mut used: Vec<usize> = Vec::new();
    for (r, &(file, _)) in results.into_iter().zip(&wanted) {
        match r {
            Ok((bytes, state)) => {
                shared.metrics.ssd_read_bytes.fetch_add(bytes.len() as u64, Relaxed);
                out.blocks.push(BlockData::Bytes { bytes, state });
                if used.last() != Some(&file) {
                    used.push(file);
                }
            }
            Err(e) => {
                shared.failed(&files[file].name, &e);
                break;
            }
        }
    }
    let used: Vec<String> = used.into_iter().map(|f| files[f].name.clone()).collect();
    // A hit refreshes the files' last use, on disk too (the LRU order outlives a restart).
    for name in used {
        lock(&shared.index).touch(&name);
        if let Ok(f) = File::options().append(true).open(shared.dir.join(&name)) {
            let _ = f.set_modified(SystemTime::now());
        }
    }
    out
}
