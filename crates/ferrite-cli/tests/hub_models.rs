//! `ferrite models` and `ferrite fit` on a model in a fake Hugging Face cache (`HF_HUB_CACHE`)
//! made from the `llama` fixture: listed with its size and architecture, resolved by repo id,
//! sized by hand-checked numbers; a repo that is not there, a GPU that is not there and
//! an fp8 KV cache on the CPU are one-line errors.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A hub holding `test-org/tiny-llama` at `main`: snapshot files are links into `blobs/`.
fn hub() -> tempfile::TempDir {
    let hub = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama");
    let repo = hub.path().join("models--test-org--tiny-llama");
    let commit = "a".repeat(40);
    let snap = repo.join("snapshots").join(&commit);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), &commit).unwrap();
    for (i, f) in ["config.json", "model.safetensors"].iter().enumerate() {
        std::fs::copy(src.join(f), repo.join("blobs").join(format!("blob{i}"))).unwrap();
        symlink(PathBuf::from("../../blobs").join(format!("blob{i}")), snap.join(f)).unwrap();
    }
    hub
}

fn ferrite(hub: &Path, home: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(args)
        .env("HF_HUB_CACHE", hub)
        .env("FERRITE_HOME", home)
        .output()
        .expect("run ferrite")
}

/// stderr of a run that failed with one `error:` line.
fn one_line_error(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    stderr
}

#[test]
fn lists_the_cache() {
    let (hub, home) = (hub(), tempfile::tempdir().unwrap());
    let out = ferrite(hub.path(), home.path(), &["models"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(&format!("Hugging Face cache ({}): 1 model", hub.path().display())), "{stdout}");
    let line = stdout.lines().find(|l| l.contains("test-org/tiny-llama")).expect("listed");
    assert!(line.contains("llama") && line.contains("runs (cpu"), "{line}");
    assert!(stdout.contains("smollm2") && stdout.contains("not fetched"), "{stdout}");
}

#[test]
fn fits_a_cached_repo() {
    let (hub, home) = (hub(), tempfile::tempdir().unwrap());
    let out = ferrite(hub.path(), home.path(), &["fit", "test-org/tiny-llama@main", "--device", "cpu"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // 116,416 f32 values; 256 bytes of f16 K and V per token (see ferrite-models' fit tests).
    assert!(stdout.contains("weights    455 KiB (as stored, memory-mapped)"), "{stdout}");
    assert!(stdout.contains("KV cache   f16: 256 B per token (full attention, 2 layers: 256 B)"), "{stdout}");
    assert!(stdout.contains("verdict    fits: 64 sequences of 256 tokens at once on cpu"), "{stdout}");
    let out = ferrite(
        hub.path(),
        home.path(),
        &["fit", "test-org/tiny-llama", "--max-num-seqs", "3", "--max-model-len", "100"],
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("fits: 3 sequences of 100 tokens"));
}

#[test]
fn missing_things_are_one_line_errors() {
    let (hub, home) = (hub(), tempfile::tempdir().unwrap());
    let err = one_line_error(&ferrite(hub.path(), home.path(), &["fit", "nobody/nothing"]));
    assert!(err.contains(&hub.path().join("models--nobody--nothing").display().to_string()), "{err}");
    let err = one_line_error(&ferrite(hub.path(), home.path(), &["fit", "test-org/tiny-llama@v9"]));
    assert!(err.contains("revision 'v9'"), "{err}");
    let err = one_line_error(&ferrite(hub.path(), home.path(), &["fit", "test-org/tiny-llama", "--device", "cuda:99"]));
    assert!(err.contains("cuda") || err.contains("NVIDIA"), "{err}");
    let out = ferrite(hub.path(), home.path(), &["fit", "test-org/tiny-llama", "--kv-cache-dtype", "fp8"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("an fp8 KV cache needs a GPU; on the CPU use int8"), "{stderr}");
    let err = one_line_error(&ferrite(hub.path(), home.path(), &["run", "no-such-thing", "-p", "hi"]));
    assert!(err.contains("not a model path, a named model") && err.contains("org/name"), "{err}");
}
