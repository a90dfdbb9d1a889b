//! The local Hugging Face hub cache, read offline: `org/name[@revision][:FILE.gguf]` resolves
//! to a snapshot directory (or a GGUF file in it) as `huggingface_hub` lays them out —
//! `models--org--name/refs/<branch>` holding a commit hash, `snapshots/<commit>/` holding the
//! files as symlinks into `blobs/` — and `list` says what the cache holds.
//!
//! The cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
//! else `~/.cache/huggingface/hub` (the order `huggingface_hub` reads them in).

use std::path::{Component, Path, PathBuf};

/// Why a repo reference did not resolve; each message names where it looked.
#[derive(Debug, thiserror::Error)]
pub enum HfCacheError {
    #[error("'{repo}' is not in the Hugging Face cache ({} not found; fetch it with `huggingface-cli download {repo}`)", .dir.display())]
    NoRepo { repo: String, dir: PathBuf },
    #[error("revision '{revision}' of {repo} is not in the Hugging Face cache (no {} or {}; cached: {known})", .dir.join("refs").join(revision).display(), .dir.join("snapshots").join(revision).display())]
    NoRevision { repo: String, revision: String, dir: PathBuf, known: String },
    #[error("{repo} has no {file} in {}", .snapshot.display())]
    NoFile { repo: String, file: String, snapshot: PathBuf },
    #[error("{} is in the snapshot but its blob is missing (an interrupted download?)", .path.display())]
    MissingBlob { path: PathBuf },
    #[error("{repo}: {} holds no config.json and no .gguf file", .snapshot.display())]
    NoModel { repo: String, snapshot: PathBuf },
    #[error("{repo} holds several GGUF files; name one as {repo}:FILE ({files})")]
    ManyGguf { repo: String, files: String },
    #[error("'{0}' is not a repo reference (org/name, org/name@revision, org/name:FILE.gguf)")]
    BadReference(String),
    #[error("{}: {source}", .path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

type Result<T> = std::result::Result<T, HfCacheError>;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> HfCacheError + '_ {
    move |source| HfCacheError::Io { path: path.to_path_buf(), source }
}

/// The hub cache directory the environment names.
pub fn hub_dir() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = var("HF_HUB_CACHE").or_else(|| var("HUGGINGFACE_HUB_CACHE")) {
        return d;
    }
    if let Some(h) = var("HF_HOME") {
        return h.join("hub");
    }
    let cache = var("XDG_CACHE_HOME").unwrap_or_else(|| var("HOME").unwrap_or_else(|| ".".into()).join(".cache"));
    cache.join("huggingface").join("hub")
}

/// `org/name`, an optional revision (branch, tag or commit) and an optional file in the repo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoRef {
    pub repo: String,
    pub revision: Option<String>,
    pub file: Option<String>,
}

/// A path inside the repo that stays inside it (no `..`, not absolute).
fn is_inner_path(p: &str) -> bool {
    !p.is_empty() && Path::new(p).components().all(|c| matches!(c, Component::Normal(_)))
}

impl RepoRef {
    /// Parse `org/name[@revision][:FILE]`; None when `s` does not have that shape.
    pub fn parse(s: &str) -> Option<RepoRef> {
        let (head, file) = match s.split_once(':') {
            Some((h, f)) => (h, Some(f.to_string())),
            None => (s, None),
        };
        let (repo, revision) = match head.split_once('@') {
            Some((r, rev)) => (r, Some(rev.to_string())),
            None => (head, None),
        };
        let part_ok = |p: &str| {
            !p.is_empty() && !p.starts_with('.') && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        let (org, name) = repo.split_once('/')?;
        if !part_ok(org) || !part_ok(name) {
            return None;
        }
        if revision.as_deref().is_some_and(|r| !is_inner_path(r)) || file.as_deref().is_some_and(|f| !is_inner_path(f))
        {
            return None;
        }
        Some(RepoRef { repo: repo.to_string(), revision, file })
    }

    /// The repo's directory in the cache: `models--org--name`.
    pub fn dir(&self, hub: &Path) -> PathBuf {
        hub.join(format!("models--{}", self.repo.replace('/', "--")))
    }
}

/// The snapshot directory of `revision` (default `main`) of the repo at `dir`.
fn snapshot(repo: &str, dir: &Path, revision: Option<&str>) -> Result<PathBuf> {
    let snapshots = dir.join("snapshots");
    let rev = revision.unwrap_or("main");
    let commit = match std::fs::read_to_string(dir.join("refs").join(rev)) {
        Ok(hash) => hash.trim().to_string(),
        Err(_) => rev.to_string(),
    };
    let snap = snapshots.join(&commit);
    if snap.is_dir() {
        return Ok(snap);
    }
    let known = list_dir(&snapshots).unwrap_or_default();
    // A repo fetched at one pinned commit has no `refs/main`: its only snapshot is the one.
    if revision.is_none() && known.len() == 1 {
        return Ok(snapshots.join(&known[0]));
    }
    Err(HfCacheError::NoRevision {
        repo: repo.to_string(),
        revision: rev.to_string(),
        dir: dir.to_path_buf(),
        known: if known.is_empty() { "none".into() } else { known.join(", ") },
    })
}

fn list_dir(dir: &Path) -> Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    names.sort();
    Ok(names)
}

/// The `.gguf` files of a snapshot, relative to it (subdirectories included), sorted.
fn gguf_files(snap: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![snap.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x.eq_ignore_ascii_case("gguf")) {
                if let Ok(rel) = p.strip_prefix(snap) {
                    out.push(rel.to_string_lossy().into_owned());
                }
            }
        }
    }
    out.sort();
    out
}

/// The file `rel` of a snapshot, which must exist with its blob.
fn snapshot_file(repo: &str, snap: &Path, rel: &str) -> Result<PathBuf> {
    let path = snap.join(rel);
    if path.is_file() {
        return Ok(path);
    }
    if path.symlink_metadata().is_ok() {
        return Err(HfCacheError::MissingBlob { path });
    }
    Err(HfCacheError::NoFile { repo: repo.to_string(), file: rel.to_string(), snapshot: snap.to_path_buf() })
}

/// The local path `r` names in the cache at `hub`: a snapshot directory with a `config.json`,
/// or a `.gguf` file in it (the one named, or the only one).
pub fn resolve(hub: &Path, r: &RepoRef) -> Result<PathBuf> {
    let dir = r.dir(hub);
    if !dir.is_dir() {
        return Err(HfCacheError::NoRepo { repo: r.repo.clone(), dir });
    }
    let snap = snapshot(&r.repo, &dir, r.revision.as_deref())?;
    if let Some(file) = &r.file {
        if !file.to_ascii_lowercase().ends_with(".gguf") {
            return Err(HfCacheError::BadReference(format!("{}:{file}", r.repo)));
        }
        return snapshot_file(&r.repo, &snap, file);
    }
    if snap.join("config.json").symlink_metadata().is_ok() {
        snapshot_file(&r.repo, &snap, "config.json")?;
        return Ok(snap);
    }
    match gguf_files(&snap).as_slice() {
        [] => Err(HfCacheError::NoModel { repo: r.repo.clone(), snapshot: snap }),
        [one] => snapshot_file(&r.repo, &snap, one),
        many => Err(HfCacheError::ManyGguf { repo: r.repo.clone(), files: many.join(", ") }),
    }
}

/// One model in the cache: how to name it, where it is, and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedModel {
    /// `org/name` (a model directory) or `org/name:FILE.gguf`.
    pub id: String,
    /// The snapshot directory or the GGUF file; None when the repo holds neither.
    pub path: Option<PathBuf>,
    pub bytes: u64,
}

/// Bytes of the files under `dir`, following the snapshot's symlinks to their blobs.
fn tree_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                tree_bytes(&p)
            } else {
                std::fs::metadata(&p).map_or(0, |m| m.len())
            }
        })
        .sum()
}

/// Every model repo in the cache at `hub` (an absent cache holds none), at its `main`
/// revision: one entry for a model directory, one per `.gguf` file, one with no path for a
/// repo that holds neither.
pub fn list(hub: &Path) -> Result<Vec<CachedModel>> {
    if !hub.is_dir() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for name in list_dir(hub)? {
        let Some(repo) = name.strip_prefix("models--").map(|r| r.replacen("--", "/", 1)) else { continue };
        let dir = hub.join(&name);
        let Ok(snap) = snapshot(&repo, &dir, None) else { continue };
        let ggufs = gguf_files(&snap);
        let has_config = snap.join("config.json").is_file();
        if has_config {
            let gguf_bytes: u64 = ggufs.iter().map(|g| std::fs::metadata(snap.join(g)).map_or(0, |m| m.len())).sum();
            out.push(CachedModel {
                id: repo.clone(),
                path: Some(snap.clone()),
                bytes: tree_bytes(&snap).saturating_sub(gguf_bytes),
            });
        }
        for g in &ggufs {
            let path = snap.join(g);
            if let Ok(m) = std::fs::metadata(&path) {
                out.push(CachedModel { id: format!("{repo}:{g}"), path: Some(path), bytes: m.len() });
            }
        }
        if !has_config && ggufs.is_empty() {
            out.push(CachedModel { id: repo, path: None, bytes: tree_bytes(&snap) });
        }
    }
    Ok(out)
}
