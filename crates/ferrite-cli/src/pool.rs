//! The model pool of `ferrite serve`: which models it serves (MODEL, `--model NAME=PATH`,
//! `--models-dir`), its limits, and how each is loaded — in this process, or with
//! `--isolate` in a child process of its own (`worker`). A load's memory estimate is its
//! weight files plus the KV cache its engine will allocate.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrite_engine::Engine;
use ferrite_models::fit::FitOptions;
use ferrite_models::LoadedModel;
use ferrite_runtime::cuda::{resolve_device, Device, DeviceChoice};
use ferrite_server::isolate::{IsolatedEngine, WorkerCommand};
use ferrite_server::pool::{ModelLoader, PoolConfig, PoolModel, Served};
use ferrite_server::ModelInfo;

use crate::serve::ServeArgs;
use crate::session::EngineArgs;

/// The KV cache `serve` allocates on the CPU unless `--kv-cache-memory` says otherwise (a
/// server's max-model-len × max-num-seqs positions would be far more than a CPU host should
/// hold).
const DEFAULT_KV_BYTES: usize = 2 << 30;

#[derive(Args, Clone)]
pub struct PoolArgs {
    /// Another model to serve, as NAME=PATH (PATH: a model path or a named model); repeat
    /// for more. A request's `model` picks one; MODEL, when given, is the default.
    #[arg(long = "model", value_name = "NAME=PATH")]
    pub models: Vec<String>,
    /// Serve every model in DIR too (HF directories and .gguf files, named after the
    /// directory or the file stem).
    #[arg(long, value_name = "DIR")]
    pub models_dir: Option<PathBuf>,
    /// Models resident at once; past it the least recently used idle one is unloaded.
    #[arg(long, value_name = "N")]
    pub max_loaded_models: Option<usize>,
    /// Unload a model no request has used for this many seconds.
    #[arg(long, value_name = "SECS")]
    pub idle_unload: Option<u64>,
    /// Memory the resident CPU models may take together (weights + KV cache; bytes, or with
    /// a K/M/G/T suffix; default: the memory available at start-up).
    #[arg(long, value_parser = parse_bytes)]
    pub memory_budget: Option<u64>,
    /// Run each model's engine in a child process: the server survives its crash, fails its
    /// in-flight requests with an error and restarts it (at most 3 times a minute).
    #[arg(long)]
    pub isolate: bool,
}

/// `8G`, `512M`, `1.5G` or plain bytes.
fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, unit) = match t.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => t.split_at(i),
        None => (t, ""),
    };
    let scale = match unit.to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
        "" => 1u64,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        "T" => 1 << 40,
        _ => return Err(format!("'{s}' is not a size (bytes, or a number with K, M, G or T)")),
    };
    let n: f64 =
        num.trim().parse().map_err(|_| format!("'{s}' is not a size (bytes, or a number with K, M, G or T)"))?;
    if !(n.is_finite() && n >= 0.0) {
        return Err(format!("'{s}' is not a size"));
    }
    Ok((n * scale as f64) as u64)
}

/// One model the server was asked to serve.
#[derive(Debug, Clone)]
pub struct PoolEntry {
    pub name: String,
    pub aliases: Vec<String>,
    pub path: PathBuf,
}

/// The listed name and the other names requests may use, for the MODEL argument.
pub fn model_names(arg: &str, path: &Path, served: Option<&str>) -> (String, Vec<String>) {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let given = if Path::new(arg).exists() { stem.clone() } else { arg.to_string() };
    let name = served.map_or_else(|| given.clone(), str::to_string);
    let mut aliases: Vec<String> = Vec::new();
    for a in [given, stem, arg.to_string()] {
        if !a.is_empty() && a != name && !aliases.contains(&a) {
            aliases.push(a);
        }
    }
    (name, aliases)
}

/// Every model of `args`, the default first; a name given twice is an error.
pub fn entries(args: &ServeArgs) -> Result<Vec<PoolEntry>> {
    let mut out: Vec<PoolEntry> = Vec::new();
    if let Some(model) = &args.model.model {
        let path = crate::model_arg::resolve(model)?;
        let (name, aliases) = model_names(model, &path, args.served_model_name.as_deref());
        out.push(PoolEntry { name, aliases, path });
    }
    for spec in &args.pool.models {
        let Some((name, path)) = spec.split_once('=').filter(|(n, p)| !n.is_empty() && !p.is_empty()) else {
            bail!("--model takes NAME=PATH, got '{spec}'");
        };
        out.push(PoolEntry { name: name.to_string(), aliases: Vec::new(), path: crate::model_arg::resolve(path)? });
    }
    if let Some(dir) = &args.pool.models_dir {
        let mut found: Vec<PoolEntry> = std::fs::read_dir(dir)
            .with_context(|| format!("cannot read --models-dir {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join("config.json").is_file() || p.extension().is_some_and(|x| x == "gguf"))
            .filter_map(|p| {
                let name = if p.is_dir() { p.file_name() } else { p.file_stem() }?.to_string_lossy().into_owned();
                Some(PoolEntry { name, aliases: Vec::new(), path: p })
            })
            .collect();
        if found.is_empty() {
            bail!("--models-dir {} holds no model (HF directories with config.json, .gguf files)", dir.display());
        }
        found.sort_by(|a, b| a.name.cmp(&b.name));
        out.extend(found);
    }
    if out.is_empty() {
        bail!("no model to serve: give MODEL, --model NAME=PATH or --models-dir DIR");
    }
    for (i, e) in out.iter().enumerate() {
        let names = || std::iter::once(&e.name).chain(&e.aliases);
        if out[..i].iter().any(|o| names().any(|n| *n == o.name || o.aliases.contains(n))) {
            bail!("the model name '{}' is given twice", e.name);
        }
    }
    Ok(out)
}

/// The pool's limits from the flags; the memory budget defaults to what is available now.
pub fn config(args: &PoolArgs) -> PoolConfig {
    PoolConfig {
        max_loaded: args.max_loaded_models,
        idle_unload: args.idle_unload.map(Duration::from_secs),
        memory_budget: args.memory_budget.or_else(available_memory),
        max_lora_rank: None,
    }
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Start the engine `serve` runs for `loaded`: the CPU's default KV cache, and a context
/// fitted to the cache when the flags leave it to the model.
pub fn start_engine(loaded: &LoadedModel, path: &Path, args: &EngineArgs, threads: usize) -> Result<Engine> {
    let mut engine_args = args.clone();
    if loaded.device == Device::Cpu {
        engine_args.kv_cache_memory.get_or_insert(DEFAULT_KV_BYTES);
    }
    let mut engine = engine_args.start(loaded, path)?;
    let kv_tokens = engine.limits().kv_capacity_tokens;
    if engine_args.max_model_len.is_none() && kv_tokens < engine.limits().max_model_len {
        // A request without max_tokens may run to the context's end: fit the context to the cache.
        drop(engine);
        engine_args.max_model_len = Some(kv_tokens);
        engine = engine_args.start(loaded, path)?;
    }
    let limits = engine.limits();
    eprintln!(
        "loaded {} in {:.0} ms on {}; context {} tokens, {}",
        path.display(),
        loaded.load_secs * 1e3,
        crate::session::device_report(loaded, threads),
        limits.max_model_len,
        crate::session::kv_report(limits)
    );
    Ok(engine)
}

/// The memory fit of the model at `path` with the engine settings `serve` runs it with (on
/// the CPU the KV cache is `DEFAULT_KV_BYTES` unless told otherwise).
fn fit_summary(path: &Path, args: &ServeArgs) -> Result<String> {
    let e = &args.engine;
    let opts = FitOptions {
        max_model_len: e.max_model_len,
        max_num_seqs: e.max_num_seqs,
        max_num_batched_tokens: e.max_num_batched_tokens,
        block_size: e.block_size,
        kv_dtype: e.kv.kv_cache_dtype,
        kv_group_size: e.kv.kv_group_size,
        kv_cache_memory: e.kv_cache_memory,
        gpu_memory_utilization: e.gpu_memory_utilization,
    };
    Ok(crate::fit::estimate(path, args.model.device, opts, Some(DEFAULT_KV_BYTES))?.to_string())
}

/// Bytes of a model's weight files.
fn weight_file_bytes(path: &Path) -> std::io::Result<u64> {
    if path.is_file() {
        return Ok(path.metadata()?.len());
    }
    let mut total = 0;
    for e in std::fs::read_dir(path)? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            total += p.metadata()?.len();
        }
    }
    Ok(total)
}

/// How the pool's models load: the flags they share.
struct Loader {
    entry: PoolEntry,
    device: DeviceChoice,
    options: ferrite_models::LoadOptions,
    engine: EngineArgs,
    threads: usize,
    /// `--verify-weights`: check the weight files' sha256 before each load.
    verify: bool,
    /// With `--isolate`: the child process to start.
    worker: Option<WorkerCommand>,
}

impl ModelLoader for Loader {
    fn estimate(&self) -> Result<Option<u64>, String> {
        let on_cpu = match self.device {
            DeviceChoice::Cpu => true,
            DeviceChoice::Auto => !matches!(resolve_device(DeviceChoice::Auto), Ok(Device::Cuda(_))),
            DeviceChoice::Cuda(_) => false,
        };
        if !on_cpu {
            return Ok(None);
        }
        let weights = weight_file_bytes(&self.entry.path)
            .map_err(|e| format!("cannot read {}: {e}", self.entry.path.display()))?;
        Ok(Some(weights + self.engine.kv_cache_memory.unwrap_or(DEFAULT_KV_BYTES) as u64))
    }

    fn load(&self) -> Result<Served, String> {
        let PoolEntry { name, aliases, path } = self.entry.clone();
        if self.verify {
            ferrite_models::verify::verify_weights(&path).map_err(|e| e.to_string())?;
        }
        match &self.worker {
            Some(command) => {
                let text = ferrite_models::load_text(&path).map_err(|e| e.to_string())?;
                let engine = IsolatedEngine::spawn(&name, command.clone())?;
                Ok(Served::new(Box::new(engine), ModelInfo::from_text(&text, name, aliases)))
            }
            None => {
                let loaded = ferrite_models::load_with(&path, self.device, &self.options).map_err(|e| e.to_string())?;
                let engine = start_engine(&loaded, &path, &self.engine, self.threads).map_err(|e| format!("{e:#}"))?;
                Ok(Served::new(Box::new(engine), ModelInfo::new(&loaded, name, aliases)))
            }
        }
    }
}

/// The pool's models, each with its loader. `serve_args` are the `serve` command's own
/// arguments, which an isolated model's child process parses again.
pub fn models(args: &ServeArgs, threads: usize, serve_args: &[String]) -> Result<Vec<PoolModel>> {
    let program = std::env::current_exe().context("cannot find this program to start engine processes")?;
    let serve_args = serde_json::to_string(serve_args)?;
    entries(args)?
        .into_iter()
        .map(|entry| {
            // The load reports a model that cannot be read; the fit is only said when it can be.
            if let Ok(summary) = fit_summary(&entry.path, args) {
                eprintln!("{}: {summary}", entry.name);
            }
            let worker = args.pool.isolate.then(|| WorkerCommand {
                program: program.clone(),
                args: vec![crate::worker::SUBCOMMAND.into(), entry.name.clone(), serve_args.clone()],
            });
            let (name, aliases) = (entry.name.clone(), entry.aliases.clone());
            let loader = Loader {
                entry,
                device: args.model.device,
                options: args.model.load_options(),
                engine: args.engine.clone(),
                threads,
                verify: args.model.verify_weights,
                worker,
            };
            Ok(PoolModel { name, aliases, loader: Arc::new(loader) })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("8G"), Ok(8 << 30));
        assert_eq!(parse_bytes("1.5k"), Ok(1536));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("-1G").is_err());
        assert!(parse_bytes("3X").is_err());
    }
}
