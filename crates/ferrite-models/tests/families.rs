//! The architecture table covers every family the README lists: each has a row, and a tiny
//! fixture of that `model_type` under `tests/fixtures/models/` loads through its plan (the
//! loader checks every tensor name and shape the plan asks for). Unknown architectures are
//! refused with the supported list.

use std::collections::BTreeSet;
use std::path::Path;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// The `model_type`s in the first column of the README's "Supported models" table.
fn readme_families() -> BTreeSet<String> {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let table = readme.split("## Supported models").nth(1).expect("a Supported models section");
    let mut names = BTreeSet::new();
    for line in table.lines().skip_while(|l| !l.starts_with('|')).take_while(|l| l.starts_with('|')).skip(2) {
        let first = line.split('|').nth(1).unwrap_or("");
        names.extend(first.split('`').skip(1).step_by(2).map(String::from));
    }
    names
}

#[test]
fn every_readme_family_has_a_row_and_a_loading_fixture() {
    let listed = readme_families();
    assert!(listed.len() >= 14, "README lists {listed:?}");
    let mut fixtures = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(root().join("tests/fixtures/models")).expect("fixtures") {
        let dir = entry.expect("entry").path();
        let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else { continue };
        let json: serde_json::Value = serde_json::from_str(&text).expect("config json");
        if let Some(t) = json["model_type"].as_str() {
            fixtures.entry(t.to_string()).or_insert(dir);
        }
    }
    for name in &listed {
        assert!(ferrite_models::families::from_hf(name).is_some(), "README lists {name}, the table has no row");
        let dir = fixtures.get(name).unwrap_or_else(|| panic!("no fixture of model_type {name}"));
        ferrite_models::load(dir).unwrap_or_else(|e| panic!("{name} ({}): {e}", dir.display()));
    }
    for f in ferrite_models::families::FAMILIES {
        assert!(listed.contains(f.name), "the table has {}, the README does not list it", f.name);
    }
}

#[test]
fn unknown_architectures_name_the_supported_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("config.json"), r#"{"model_type": "mamba9", "hidden_size": 8}"#).expect("write");
    let err = ferrite_models::load(dir.path()).err().expect("refused").to_string();
    assert!(err.contains("mamba9") && err.contains("starcoder2") && err.contains("gemma4_text"), "{err}");
}
