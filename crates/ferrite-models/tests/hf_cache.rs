//! The local Hugging Face cache read offline: a hub tree laid out as `huggingface_hub` writes
//! it (refs holding commit hashes, snapshots of symlinks into content-addressed blobs), built
//! here from fixture models, resolves by repo id, branch, tag, commit and `:FILE.gguf`; the
//! resolved directory loads; and what is missing is an error naming where it looked.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use ferrite_models::hf_cache::{self, HfCacheError, RepoRef};

const MAIN: &str = "0123456789abcdef0123456789abcdef01234567";
const OLD: &str = "89abcdef0123456789abcdef0123456789abcdef";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

/// Add `files` (name in the snapshot, source file) to snapshot `commit` of the repo at `dir`:
/// each becomes a blob named by a digest of its name and size, and a relative symlink to it.
fn add_snapshot(dir: &Path, commit: &str, files: &[(&str, PathBuf)]) {
    let snap = dir.join("snapshots").join(commit);
    for (name, src) in files {
        let len = std::fs::metadata(src).unwrap().len();
        let blob = format!("{:x}{len:x}", name.len() * 7919 + commit.len());
        let blob_path = dir.join("blobs").join(&blob);
        std::fs::create_dir_all(blob_path.parent().unwrap()).unwrap();
        std::fs::copy(src, &blob_path).unwrap();
        let link = snap.join(name);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        let depth = name.matches('/').count() + 2;
        symlink(format!("{}blobs/{blob}", "../".repeat(depth)), link).unwrap();
    }
}

fn write_ref(dir: &Path, name: &str, commit: &str) {
    let path = dir.join("refs").join(name);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, commit).unwrap();
}

/// A hub with `test-org/tiny-llama` (main and an older commit tagged v1), `test-org/tiny-gguf`
/// (two GGUF files, one in a subfolder) and `test-org/no-model` (a README only).
fn hub() -> tempfile::TempDir {
    let hub = tempfile::tempdir().unwrap();
    let llama = fixture("llama");
    let files: Vec<(&str, PathBuf)> =
        ["config.json", "generation_config.json", "model.safetensors"].iter().map(|f| (*f, llama.join(f))).collect();
    let repo = hub.path().join("models--test-org--tiny-llama");
    add_snapshot(&repo, MAIN, &files);
    add_snapshot(&repo, OLD, &files[..1]);
    write_ref(&repo, "main", MAIN);
    write_ref(&repo, "v1", OLD);
    let gguf = hub.path().join("models--test-org--tiny-gguf");
    add_snapshot(
        &gguf,
        MAIN,
        &[("glm4.gguf", fixture("glm4").join("model.gguf")), ("q/phi3.gguf", fixture("phi3").join("model.gguf"))],
    );
    write_ref(&gguf, "main", MAIN);
    let none = hub.path().join("models--test-org--no-model");
    add_snapshot(&none, MAIN, &[("README.md", fixture("README.md"))]);
    write_ref(&none, "main", MAIN);
    hub
}

fn resolve(hub: &Path, s: &str) -> Result<PathBuf, HfCacheError> {
    hf_cache::resolve(hub, &RepoRef::parse(s).unwrap_or_else(|| panic!("{s} parses")))
}

#[test]
fn parses_references() {
    let r = RepoRef::parse("Qwen/Qwen3-8B@v1.0:q/model-Q4_K_M.gguf").unwrap();
    assert_eq!(
        (r.repo.as_str(), r.revision.as_deref(), r.file.as_deref()),
        ("Qwen/Qwen3-8B", Some("v1.0"), Some("q/model-Q4_K_M.gguf"))
    );
    assert_eq!(RepoRef::parse("a/b").unwrap().revision, None);
    for bad in
        ["smollm2", "a/b/c", "./a", "../a/b", "/abs/path", "a/", "a/b@", "a/b:../x.gguf", "a/b@../../etc", "a b/c"]
    {
        assert_eq!(RepoRef::parse(bad), None, "{bad}");
    }
}

#[test]
fn resolves_by_repo_branch_tag_and_commit() {
    let hub = hub();
    let main = resolve(hub.path(), "test-org/tiny-llama").unwrap();
    assert!(main.ends_with(format!("models--test-org--tiny-llama/snapshots/{MAIN}")), "{}", main.display());
    assert_eq!(resolve(hub.path(), "test-org/tiny-llama@main").unwrap(), main);
    assert_eq!(resolve(hub.path(), &format!("test-org/tiny-llama@{MAIN}")).unwrap(), main);
    assert!(resolve(hub.path(), "test-org/tiny-llama@v1").unwrap().ends_with(format!("snapshots/{OLD}")));
    // The snapshot's files are symlinks into blobs, and the model loads through them.
    assert!(main.join("model.safetensors").symlink_metadata().unwrap().file_type().is_symlink());
    let loaded = ferrite_models::load(&main).unwrap();
    assert_eq!(loaded.model.config().num_layers, 2);
}

#[test]
fn resolves_gguf_files() {
    let hub = hub();
    let glm = resolve(hub.path(), "test-org/tiny-gguf:glm4.gguf").unwrap();
    assert!(glm.ends_with("glm4.gguf") && glm.is_file());
    assert!(resolve(hub.path(), "test-org/tiny-gguf:q/phi3.gguf").unwrap().is_file());
    // Two GGUF files and no config: the user must pick one.
    let err = resolve(hub.path(), "test-org/tiny-gguf").unwrap_err().to_string();
    assert!(err.contains("glm4.gguf, q/phi3.gguf") && err.contains("test-org/tiny-gguf:FILE"), "{err}");
}

#[test]
fn what_is_missing_names_where_it_looked() {
    let hub = hub();
    let err = resolve(hub.path(), "nobody/nothing").unwrap_err().to_string();
    let dir = hub.path().join("models--nobody--nothing");
    assert!(
        err.contains(&dir.display().to_string()) && err.contains("huggingface-cli download nobody/nothing"),
        "{err}"
    );
    let err = resolve(hub.path(), "test-org/tiny-llama@v2").unwrap_err().to_string();
    assert!(
        err.contains("refs/v2") && err.contains("snapshots/v2") && err.contains(MAIN) && err.contains(OLD),
        "{err}"
    );
    let err = resolve(hub.path(), "test-org/tiny-gguf:absent.gguf").unwrap_err().to_string();
    assert!(err.contains("absent.gguf") && err.contains(MAIN), "{err}");
    let err = resolve(hub.path(), "test-org/tiny-llama:config.json").unwrap_err().to_string();
    assert!(err.contains("not a repo reference"), "{err}");
    let err = resolve(hub.path(), "test-org/no-model").unwrap_err().to_string();
    assert!(err.contains("no config.json and no .gguf"), "{err}");
    // An interrupted download: the snapshot's link is there, its blob is not.
    let repo = hub.path().join("models--test-org--tiny-llama");
    std::fs::remove_dir_all(repo.join("blobs")).unwrap();
    let err = resolve(hub.path(), "test-org/tiny-llama").unwrap_err().to_string();
    assert!(err.contains("config.json") && err.contains("blob is missing"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn lists_the_cache() {
    let hub = hub();
    let listed = hf_cache::list(hub.path()).unwrap();
    let ids: Vec<&str> = listed.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(
        ids,
        ["test-org/no-model", "test-org/tiny-gguf:glm4.gguf", "test-org/tiny-gguf:q/phi3.gguf", "test-org/tiny-llama"]
    );
    let llama = &listed[3];
    let want: u64 = ["config.json", "generation_config.json", "model.safetensors"]
        .iter()
        .map(|f| std::fs::metadata(fixture("llama").join(f)).unwrap().len())
        .sum();
    assert_eq!(llama.bytes, want);
    assert_eq!(listed[1].bytes, std::fs::metadata(fixture("glm4").join("model.gguf")).unwrap().len());
    assert_eq!(listed[0].path, None);
    assert!(hf_cache::list(&hub.path().join("absent")).unwrap().is_empty());
}
