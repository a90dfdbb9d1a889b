//! Where ferrite keeps its files: `$FERRITE_HOME` (default `~/.cache/ferrite`) holds the
//! model cache (`models/`) and, for the test suite, third-party assets (`test-assets/`).

use std::path::PathBuf;

pub fn ferrite_home() -> PathBuf {
    if let Some(h) = std::env::var_os("FERRITE_HOME") {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("ferrite")
}

/// The directory of the models fetched by name (`ferrite run smollm2`).
pub fn models_dir() -> PathBuf {
    ferrite_home().join("models")
}

/// Third-party test assets fetched by `scripts/fetch_test_assets.sh`
/// (`$FERRITE_TEST_ASSETS`, default `$FERRITE_HOME/test-assets`).
pub fn test_assets_dir() -> PathBuf {
    std::env::var_os("FERRITE_TEST_ASSETS").map(PathBuf::from).unwrap_or_else(|| ferrite_home().join("test-assets"))
}
