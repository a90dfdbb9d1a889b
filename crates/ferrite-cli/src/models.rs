//! `ferrite models`: the named models (fetched or not) and every model in the local Hugging
//! Face cache, each with its size, architecture and whether ferrite can run it (its config
//! and plan are read, not its weights).

use std::path::Path;

use anyhow::Result;
use ferrite_models::fit::human_bytes;
use ferrite_models::{hf_cache, inspect, paths, registry};

/// (architecture, whether ferrite runs it and where) of the model at `path`.
fn describe(path: &Path) -> (String, String) {
    match inspect::inspect(path) {
        Ok(m) => {
            let where_ = match ferrite_models::gpu::unsupported(&m.plan) {
                None => "runs (cpu, cuda)".to_string(),
                Some(why) => format!("runs (cpu; not on cuda: {why})"),
            };
            (m.cfg.arch.name.to_string(), where_)
        }
        Err(e) => {
            let arch = inspect::architecture_name(path).unwrap_or_else(|| "?".into());
            (arch, format!("cannot run: {e}"))
        }
    }
}

pub fn list() -> Result<()> {
    let dir = paths::models_dir();
    println!("named models ({}):", dir.display());
    for m in registry::named_models() {
        let path = dir.join(m.name).join(m.file_name);
        let size = human_bytes(m.size as usize);
        if path.is_file() {
            let (arch, runs) = describe(&path);
            println!("  {:<22} {size:>9}  {arch:<12} {runs}  {}", m.name, path.display());
        } else {
            println!("  {:<22} {size:>9}  not fetched (`ferrite pull {}`)", m.name, m.name);
        }
    }
    let hub = hf_cache::hub_dir();
    let cached = hf_cache::list(&hub)?;
    println!(
        "Hugging Face cache ({}): {} model{}",
        hub.display(),
        cached.len(),
        if cached.len() == 1 { "" } else { "s" }
    );
    for c in cached {
        let size = human_bytes(c.bytes as usize);
        let (arch, runs) = match &c.path {
            Some(p) => describe(p),
            None => ("-".into(), "cannot run: no config.json or .gguf file".into()),
        };
        println!("  {:<40} {size:>9}  {arch:<12} {runs}", c.id);
    }
    Ok(())
}
