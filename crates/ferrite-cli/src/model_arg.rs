//! The MODEL argument: a path to an HF directory or `.gguf` file, or a registry name.

use std::path::PathBuf;

use anyhow::{bail, Result};
use ferrite_models::{paths, registry};

pub fn resolve(model: &str) -> Result<PathBuf> {
    let path = PathBuf::from(model);
    if path.exists() {
        return Ok(path);
    }
    if registry::find(model).is_some() {
        return Ok(registry::resolve(model, &paths::models_dir())?);
    }
    let names: Vec<&str> = registry::named_models().iter().map(|m| m.name).collect();
    bail!("'{model}' is neither a model path nor a known model name ({})", names.join(", "))
}

pub fn list() -> Result<()> {
    for m in registry::named_models() {
        let path = paths::models_dir().join(m.name).join(m.file_name);
        let state = if path.is_file() { path.display().to_string() } else { "not fetched".into() };
        println!("{:<20} {:>6} MB  {state}", m.name, m.size / 1_000_000);
    }
    Ok(())
}

pub fn pull(name: &str) -> Result<()> {
    if registry::find(name).is_none() {
        bail!("unknown model name '{name}' (see `ferrite models`)");
    }
    println!("{}", registry::resolve(name, &paths::models_dir())?.display());
    Ok(())
}
