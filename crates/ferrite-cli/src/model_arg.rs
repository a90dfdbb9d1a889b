//! The MODEL argument: a path to an HF directory or `.gguf` file, a registry name, or a
//! Hugging Face repo in the local hub cache (`org/name[@revision][:FILE.gguf]`).

use std::path::PathBuf;

use anyhow::{bail, Result};
use ferrite_models::hf_cache::{self, RepoRef};
use ferrite_models::{paths, registry};

pub fn resolve(model: &str) -> Result<PathBuf> {
    let path = PathBuf::from(model);
    if path.exists() {
        return Ok(path);
    }
    if registry::find(model).is_some() {
        return Ok(registry::resolve(model, &paths::models_dir())?);
    }
    if let Some(repo) = RepoRef::parse(model) {
        return Ok(hf_cache::resolve(&hf_cache::hub_dir(), &repo)?);
    }
    bail!(
        "'{model}' is not a model path, a named model ({}) or a Hugging Face repo id (org/name[@revision][:FILE.gguf])",
        named().join(", ")
    )
}

/// The registry's names.
pub fn named() -> Vec<&'static str> {
    registry::named_models().iter().map(|m| m.name).collect()
}

pub fn pull(name: &str) -> Result<()> {
    if registry::find(name).is_none() {
        bail!("unknown model name '{name}' (see `ferrite models`)");
    }
    println!("{}", registry::resolve(name, &paths::models_dir())?.display());
    Ok(())
}
