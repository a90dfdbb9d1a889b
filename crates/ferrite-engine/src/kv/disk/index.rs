//! The SSD tier's in-memory index of its directory: which files exist, their bytes and last
//! use, and where each cached block lives (file and slot). It is rebuilt at start-up from the
//! file names and run headers alone (`scan`, no payload is read), and kept by the engine,
//! reader and writer threads behind one mutex.
//!
//! LRU by last use within the byte budget: `add` evicts the least recently used files until
//! the directory fits. Last use is the file's modification time, which a hit refreshes, so
//! the order survives a restart. Files of another namespace (another model or KV scheme
//! sharing the directory) count against the budget and age out like the rest, but are never
//! looked up.

use std::collections::HashMap;
use std::fs;
use std::path::Path;
use std::time::{Duration, SystemTime};

use super::file::{FileError, GenRecord, RunHeader};

pub(super) const RUN_EXT: &str = "kvrun";
pub(super) const GEN_EXT: &str = "kvgen";
pub(super) const TMP_EXT: &str = "tmp";
/// A temporary file older than this was left by a writer that died (a live one renames
/// within seconds).
const STALE_TMP: Duration = Duration::from_secs(600);

#[derive(Debug)]
pub(super) enum Kind {
    /// A run of this namespace: its blocks' chained hashes.
    Run(Vec<u64>),
    /// A generation record of this namespace.
    Generation(u64),
    /// Another namespace's file.
    Foreign,
}

#[derive(Debug)]
pub(super) struct Entry {
    pub bytes: u64,
    pub last_use: u64,
    pub kind: Kind,
}

/// What a scan found that was not usable.
#[derive(Debug, Default)]
pub(super) struct ScanReport {
    pub corrupt: u64,
}

#[derive(Debug)]
pub(super) struct Index {
    pub budget: u64,
    files: HashMap<String, Entry>,
    /// Chained hash → (file name, slot in the file).
    blocks: HashMap<u64, (String, u32)>,
    gens: HashMap<u64, String>,
    total: u64,
}

/// Nanoseconds since the epoch of `t` (0 before it).
pub(super) fn stamp(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

impl Index {
    pub fn new(budget: u64) -> Index {
        Index { budget, files: HashMap::new(), blocks: HashMap::new(), gens: HashMap::new(), total: 0 }
    }

    pub fn total_bytes(&self) -> u64 {
        self.total
    }
    pub fn num_files(&self) -> usize {
        self.files.len()
    }

    /// Read `dir`: index every run and record of `namespace`, count the rest against the
    /// budget, delete corrupt files and stale temporary files, then evict down to the budget.
    /// Returns the evicted file names (already deleted).
    pub fn scan(dir: &Path, namespace: u64, budget: u64) -> std::io::Result<(Index, ScanReport, Vec<String>)> {
        let mut index = Index::new(budget);
        let mut report = ScanReport::default();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let Ok(name) = entry.file_name().into_string() else { continue };
            let path = entry.path();
            let Ok(meta) = entry.metadata() else { continue };
            if !meta.is_file() {
                continue;
            }
            let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or_default();
            let kind = match ext {
                RUN_EXT => fs::File::open(&path).map_err(FileError::from).and_then(|mut f| {
                    let h = RunHeader::read(&mut std::io::BufReader::new(&mut f))?;
                    if h.file_len() != meta.len() {
                        return Err(FileError::Corrupt("truncated"));
                    }
                    Ok(if h.namespace == namespace { Kind::Run(h.hashes) } else { Kind::Foreign })
                }),
                GEN_EXT => fs::read(&path).map_err(FileError::from).and_then(|b| {
                    let r = GenRecord::decode(&b)?;
                    Ok(if r.namespace == namespace { Kind::Generation(r.key) } else { Kind::Foreign })
                }),
                TMP_EXT => {
                    if modified.elapsed().is_ok_and(|age| age > STALE_TMP) {
                        let _ = fs::remove_file(&path);
                    }
                    continue;
                }
                _ => continue,
            };
            match kind {
                Ok(kind) => index.insert(name, Entry { bytes: meta.len(), last_use: stamp(modified), kind }),
                Err(FileError::Corrupt(_)) => {
                    report.corrupt += 1;
                    let _ = fs::remove_file(&path);
                }
                // Unreadable now (permissions, a race with another server's eviction): skip.
                Err(FileError::Io(_)) => {}
            }
        }
        let evicted = index.evict(None);
        for name in &evicted {
            let _ = fs::remove_file(dir.join(name));
        }
        Ok((index, report, evicted))
    }

    fn insert(&mut self, name: String, entry: Entry) {
        self.remove(&name);
        match &entry.kind {
            Kind::Run(hashes) => {
                for (slot, &h) in hashes.iter().enumerate() {
                    self.blocks.entry(h).or_insert_with(|| (name.clone(), slot as u32));
                }
            }
            Kind::Generation(key) => {
                self.gens.insert(*key, name.clone());
            }
            Kind::Foreign => {}
        }
        self.total += entry.bytes;
        self.files.insert(name, entry);
    }

    /// Register a file just written, then evict others down to the budget; returns the names
    /// to delete.
    pub fn add(&mut self, name: String, entry: Entry) -> Vec<String> {
        let keep = name.clone();
        self.insert(name, entry);
        self.evict(Some(&keep))
    }

    /// Forget a file (deleted, corrupt or gone).
    pub fn remove(&mut self, name: &str) -> Option<Entry> {
        let entry = self.files.remove(name)?;
        self.total -= entry.bytes;
        match &entry.kind {
            Kind::Run(hashes) => {
                for h in hashes {
                    if self.blocks.get(h).is_some_and(|(n, _)| n == name) {
                        self.blocks.remove(h);
                    }
                }
            }
            Kind::Generation(key) => {
                self.gens.remove(key);
            }
            Kind::Foreign => {}
        }
        Some(entry)
    }

    /// Mark a file used now.
    pub fn touch(&mut self, name: &str) {
        if let Some(e) = self.files.get_mut(name) {
            e.last_use = stamp(SystemTime::now());
        }
    }

    /// Where block `hash` is stored.
    pub fn locate(&self, hash: u64) -> Option<(&str, u32)> {
        self.blocks.get(&hash).map(|(n, s)| (n.as_str(), *s))
    }

    pub fn generation(&self, key: u64) -> Option<&str> {
        self.gens.get(&key).map(String::as_str)
    }

    /// Remove least recently used files until the total fits the budget; `keep` (the file
    /// just written) goes last, only when it alone exceeds the budget.
    fn evict(&mut self, keep: Option<&str>) -> Vec<String> {
        let mut out = Vec::new();
        while self.total > self.budget {
            let victim = (self.files.iter())
                .filter(|(n, _)| Some(n.as_str()) != keep)
                .min_by_key(|(n, e)| (e.last_use, n.as_str()))
                .map(|(n, _)| n.clone())
                .or_else(|| keep.map(str::to_string));
            let Some(victim) = victim else { break };
            self.remove(&victim);
            out.push(victim);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(hashes: &[u64], bytes: u64, last_use: u64) -> Entry {
        Entry { bytes, last_use, kind: Kind::Run(hashes.to_vec()) }
    }

    #[test]
    fn the_least_recently_used_files_go_first_and_the_budget_holds() {
        let mut ix = Index::new(100);
        assert!(ix.add("a".into(), run(&[1, 2], 40, 1)).is_empty());
        assert!(ix.add("b".into(), run(&[3], 40, 2)).is_empty());
        ix.touch("a");
        // c does not fit beside both: b, now the least recently used, goes.
        assert_eq!(ix.add("c".into(), run(&[4], 40, 3)), vec!["b".to_string()]);
        assert_eq!(ix.total_bytes(), 80);
        assert_eq!(ix.locate(2), Some(("a", 1)));
        assert_eq!(ix.locate(3), None);
        // A file larger than the budget cannot stay either.
        assert_eq!(ix.add("d".into(), run(&[5], 150, 4)).len(), 3);
        assert_eq!((ix.num_files(), ix.total_bytes(), ix.locate(5)), (0, 0, None));
    }
}
