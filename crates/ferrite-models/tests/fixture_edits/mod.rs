//! Shared by the load-error tests (`load_errors`, `mlx_load`, `fp8_load`, `hostile_models`):
//! copies of the model fixtures with their config or safetensors header edited, and the
//! one-line error a load gives.

#![allow(dead_code)] // each test binary uses its own part of these helpers

use std::path::{Path, PathBuf};

use serde_json::Value;

pub fn fixture_named(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

/// A copy of the fixture dir `name` in a temp dir.
pub fn copy_fixture_named(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_named(name).join(file), tmp.path().join(file)).expect("copy");
    }
    tmp
}

/// Edit the config.json of `dir` with `edit`.
pub fn edit_config(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    edit(&mut cfg);
    std::fs::write(&path, serde_json::to_string(&cfg).expect("json")).expect("write");
}

/// Rewrite the safetensors header with `edit` (data bytes kept as they are).
pub fn edit_header(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    edit(header.as_object_mut().expect("object"));
    let mut h = serde_json::to_vec(&header).expect("json");
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&path, out).expect("write");
}

/// The error loading `path` gives, checked to be one line (panics if it loads).
pub fn load_err(path: &Path) -> String {
    match ferrite_models::load(path) {
        Ok(_) => panic!("{} loaded but should not", path.display()),
        Err(e) => {
            let msg = e.to_string();
            assert!(!msg.contains('\n'), "error is not one line: {msg}");
            msg
        }
    }
}
