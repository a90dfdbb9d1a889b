//! `ferrite serve MODEL`: load the model, start its engine and serve the OpenAI-compatible
//! API on HOST:PORT (127.0.0.1 unless told otherwise) until SIGINT/SIGTERM, then drain.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use ferrite_models::fit::{FitOptions, KvDtypeChoice};
use ferrite_runtime::cuda::Device;
use ferrite_server::guard::GuardConfig;
use ferrite_server::{App, ModelInfo, ServerConfig, Shutdown};

use crate::session::{EngineArgs, ModelArgs};

/// The KV cache `serve` allocates unless `--kv-cache-memory` says otherwise (a server's
/// max-model-len × max-num-seqs positions would be far more than a CPU host should hold).
const DEFAULT_KV_BYTES: usize = 2 << 30;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on API routes.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Sequences in progress at once (running + waiting; a request counts its `n` times its
    /// prompts); more get 429, a request that could never fit gets 400.
    #[arg(long, default_value_t = 1024)]
    pub max_queue: usize,
    /// Host names requests may be addressed to besides localhost and the bound IP (for a
    /// proxy in front; comma-separated; `*` allows any).
    #[arg(long, value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// Origins whose browser requests are allowed, with CORS headers (comma-separated; `*`
    /// allows any). Without it cross-origin browser requests get 403.
    #[arg(long, value_delimiter = ',')]
    pub cors_allow_origin: Vec<String>,
    /// Connections served at once (default: the open-file limit less a margin).
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Seconds a connection may take to send a request's headers.
    #[arg(long, default_value_t = 10)]
    pub header_read_timeout: u64,
    /// Seconds an idle connection (no request in progress) is kept open.
    #[arg(long, default_value_t = 5)]
    pub keep_alive_timeout: u64,
    /// The model name `/v1/models` lists (default: the name or file stem it was started with).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Seconds a shutdown waits for in-flight requests.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
}

/// The listed name and the other names requests may use.
fn model_names(arg: &str, path: &Path, served: Option<&str>) -> (String, Vec<String>) {
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

/// The memory fit of the model `serve` is about to load, with the engine settings it will run
/// (on the CPU the KV cache is `DEFAULT_KV_BYTES` unless told otherwise).
fn fit_summary(args: &ServeArgs) -> Result<String> {
    let path = crate::model_arg::resolve(args.model.name())?;
    let e = &args.engine;
    let opts = FitOptions {
        max_model_len: e.max_model_len,
        max_num_seqs: e.max_num_seqs,
        max_num_batched_tokens: e.max_num_batched_tokens,
        block_size: e.block_size,
        kv_dtype: KvDtypeChoice::Auto,
        kv_cache_memory: e.kv_cache_memory,
        gpu_memory_utilization: e.gpu_memory_utilization,
    };
    Ok(crate::fit::estimate(&path, args.model.device, opts, Some(DEFAULT_KV_BYTES))?.to_string())
}

pub fn serve(args: ServeArgs) -> Result<()> {
    if args.model.synthetic.is_none() {
        // The load below reports a model that cannot be read; the summary is only said when it can be.
        if let Ok(summary) = fit_summary(&args) {
            eprintln!("{summary}");
        }
    }
    let (loaded, path, threads) = args.model.load()?;
    let mut engine_args = args.engine.clone();
    if loaded.device == Device::Cpu {
        engine_args.kv_cache_memory.get_or_insert(DEFAULT_KV_BYTES);
    }
    let mut engine = engine_args.start(&loaded, &path)?;
    let kv_tokens = engine.limits().kv_capacity_tokens;
    if engine_args.max_model_len.is_none() && kv_tokens < engine.limits().max_model_len {
        // A request without max_tokens may run to the context's end: fit the context to the cache.
        drop(engine);
        engine_args.max_model_len = Some(kv_tokens);
        engine = engine_args.start(&loaded, &path)?;
    }
    let limits = engine.limits().clone();
    eprintln!(
        "loaded {} in {:.0} ms on {}; context {} tokens, KV cache {} tokens",
        path.display(),
        loaded.load_secs * 1e3,
        crate::session::device_report(&loaded, threads),
        limits.max_model_len,
        limits.kv_capacity_tokens
    );
    let (name, aliases) = model_names(args.model.name(), &path, args.served_model_name.as_deref());
    let defaults = ServerConfig::default();
    let config = ServerConfig {
        api_key: args.api_key.clone(),
        max_queue: Some(args.max_queue),
        shutdown_timeout: Duration::from_secs(args.shutdown_timeout),
        guard: GuardConfig {
            allowed_hosts: args.allowed_hosts.clone(),
            cors_allow_origins: args.cors_allow_origin.clone(),
        },
        max_connections: args.max_connections.unwrap_or(defaults.max_connections),
        header_read_timeout: Duration::from_secs(args.header_read_timeout),
        keep_alive_timeout: Duration::from_secs(args.keep_alive_timeout),
        ..defaults
    };
    let app = Arc::new(App::new(engine, ModelInfo::new(&loaded, name, aliases), config));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("ferrite-http")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let ended = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
        eprintln!("listening on http://{}", listener.local_addr()?);
        anyhow::Ok(ferrite_server::serve(listener, app, ferrite_server::shutdown_signal()).await?)
    })?;
    match ended {
        Shutdown::Drained => eprintln!("shut down"),
        Shutdown::TimedOut => eprintln!("shut down with requests still in flight after {} s", args.shutdown_timeout),
    }
    Ok(())
}
