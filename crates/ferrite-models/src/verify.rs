//! `--verify-weights`: the sha256 of each weight file against the digest it should have — a
//! `<file>.sha256` sidecar beside it, else the known digest of a named model (`registry`) —
//! so a file with flipped bytes, a shifted data region or a damaged header is refused
//! before it serves. Loading alone checks structure and metadata ranges, not the data.

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{LoadError, Result};

/// Where a file's expected digest came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DigestSource {
    /// A `<file>.sha256` file (`sha256sum` output or the bare hex digest).
    Sidecar(PathBuf),
    /// The registry entry of a named model.
    Registry(&'static str),
}

impl std::fmt::Display for DigestSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DigestSource::Sidecar(p) => write!(f, "{}", p.display()),
            DigestSource::Registry(name) => write!(f, "the named model '{name}'"),
        }
    }
}

/// One weight file whose digest matched.
#[derive(Debug, Clone)]
pub struct VerifiedFile {
    pub path: PathBuf,
    pub sha256: String,
    pub source: DigestSource,
}

/// Check every weight file of the model at `path` (a `.gguf` file or an HF directory's
/// safetensors files); an error names the first file without a digest or whose digest
/// differs.
pub fn verify_weights(path: &Path) -> Result<Vec<VerifiedFile>> {
    let files = if path.is_dir() { crate::safetensors::shard_files(path)? } else { vec![path.to_path_buf()] };
    files.into_iter().map(|f| verify_file(&f)).collect()
}

fn verify_file(path: &Path) -> Result<VerifiedFile> {
    let (expected, source) = expected_digest(path)?.ok_or_else(|| {
        LoadError::format(
            path,
            format!(
                "no digest to verify the weights against: write {}.sha256 (e.g. with sha256sum) or use a named model",
                path.display()
            ),
        )
    })?;
    let got = sha256_file(path)?;
    if got != expected {
        return Err(LoadError::format(
            path,
            format!("sha256 {got} does not match {expected} from {source}: the weights are corrupt or not that file"),
        ));
    }
    Ok(VerifiedFile { path: path.to_path_buf(), sha256: got, source })
}

/// The digest `path` should have: its sidecar, else that of the named model whose file name
/// it has.
pub fn expected_digest(path: &Path) -> Result<Option<(String, DigestSource)>> {
    let mut sidecar = path.as_os_str().to_os_string();
    sidecar.push(".sha256");
    let sidecar = PathBuf::from(sidecar);
    if sidecar.is_file() {
        let text = std::fs::read_to_string(&sidecar).map_err(|e| LoadError::io(&sidecar, e))?;
        let digest = text.split_whitespace().next().unwrap_or_default().to_ascii_lowercase();
        if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(LoadError::format(&sidecar, "does not start with a sha256 digest (64 hex digits)"));
        }
        return Ok(Some((digest, DigestSource::Sidecar(sidecar))));
    }
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    Ok(crate::registry::named_models()
        .into_iter()
        .find(|m| m.file_name == name)
        .map(|m| (m.sha256.to_string(), DigestSource::Registry(m.name))))
}

/// The sha256 of the file at `path`, as lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| LoadError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}
