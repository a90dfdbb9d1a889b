//! `ferrite serve MODEL`: load the model, start its engine and serve the OpenAI-compatible
//! API on HOST:PORT (127.0.0.1 unless told otherwise) until SIGINT/SIGTERM, then drain. More
//! models (`--model NAME=PATH`, `--models-dir`) make a pool (`pool`) loaded on demand.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use ferrite_server::guard::GuardConfig;
use ferrite_server::pool::{ModelPool, PoolConfig, Served};
use ferrite_server::{App, ModelInfo, ServerConfig, Shutdown};

use crate::pool::PoolArgs;
use crate::session::{EngineArgs, ModelArgs};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub pool: PoolArgs,
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
    /// LoRA adapters to serve over the default model, as NAME=PATH (PEFT directories:
    /// adapter_config.json + adapter_model.safetensors); a request's `model` picks one.
    #[arg(long, value_name = "NAME=PATH", num_args = 1..)]
    pub lora_modules: Vec<String>,
    /// The largest LoRA rank an adapter may have (at most 64).
    #[arg(long, default_value_t = ferrite_models::lora::MAX_LORA_RANK, value_parser = parse_lora_rank)]
    pub max_lora_rank: usize,
}

/// A LoRA rank in 1..=64.
fn parse_lora_rank(s: &str) -> Result<usize, String> {
    let max = ferrite_models::lora::MAX_LORA_RANK;
    match s.parse::<usize>() {
        Ok(r) if (1..=max).contains(&r) => Ok(r),
        _ => Err(format!("'{s}' is not a rank in 1..={max}")),
    }
}

/// `--lora-modules` entries as (name, path).
pub fn lora_modules(args: &[String]) -> Result<Vec<(String, std::path::PathBuf)>> {
    args.iter()
        .map(|m| match m.split_once('=') {
            Some((name, path)) if !name.is_empty() && !path.is_empty() => Ok((name.to_string(), path.into())),
            _ => anyhow::bail!("--lora-modules takes NAME=PATH, got '{m}'"),
        })
        .collect()
}

pub fn serve(args: ServeArgs) -> Result<()> {
    let adapters = lora_modules(&args.lora_modules)?;
    let pool = match args.model.synthetic {
        // A synthetic model (random weights on the GPU, for benchmarks) is served alone.
        Some(_) => {
            let (loaded, path, threads) = args.model.load()?;
            let engine = crate::pool::start_engine(&loaded, &path, &args.engine, threads)?;
            let (name, aliases) = crate::pool::model_names(args.model.name(), &path, args.served_model_name.as_deref());
            ModelPool::single(Served::new(Box::new(engine), ModelInfo::new(&loaded, name, aliases)))
        }
        None => {
            let threads = ferrite_runtime::threads::init(args.model.threads)?;
            let serve_args: Vec<String> = std::env::args().skip(2).collect();
            let config = PoolConfig { max_lora_rank: Some(args.max_lora_rank), ..crate::pool::config(&args.pool) };
            ModelPool::new(crate::pool::models(&args, threads, &serve_args)?, config)
        }
    };
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
    let app = Arc::new(App::with_pool(pool, config));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("ferrite-http")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let ended = runtime.block_on(async {
        // The default model loads now, so a model that cannot load fails the start.
        drop(app.pool.acquire(None).await.map_err(|e| anyhow::anyhow!("{}", e.message))?);
        for (name, path) in &adapters {
            app.pool.load_adapter(name, path, None).await.map_err(|e| anyhow::anyhow!("{}", e.message))?;
        }
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
