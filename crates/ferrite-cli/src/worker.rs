//! The hidden `engine-worker` subcommand: the child process of `serve --isolate`. It parses
//! the `serve` arguments it was given, loads the one pool model it was named, starts its
//! engine as `serve` would and serves it over the socket (`ferrite_server::isolate::worker`).
//! A panic anywhere aborts the process, so the server sees a crash and restarts it rather
//! than talking to an engine whose thread died.

use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use anyhow::{anyhow, Context, Result};
use clap::{Args, Parser};

use crate::serve::ServeArgs;

/// The subcommand's name, as the server starts it.
pub const SUBCOMMAND: &str = "engine-worker";

#[derive(Args)]
pub struct WorkerArgs {
    /// The pool model to serve.
    pub name: String,
    /// The `serve` arguments, as a JSON array of strings.
    pub serve_args: String,
    /// The server's socket.
    #[arg(long)]
    pub socket: PathBuf,
}

#[derive(Parser)]
struct Serve {
    #[command(flatten)]
    args: ServeArgs,
}

pub fn worker(w: WorkerArgs) -> Result<()> {
    std::panic::set_hook(Box::new(|info| {
        eprintln!("ferrite engine process: {info}");
        std::process::abort();
    }));
    let serve_args: Vec<String> = serde_json::from_str(&w.serve_args).context("the serve arguments")?;
    let args = Serve::try_parse_from(std::iter::once("serve".to_string()).chain(serve_args))?.args;
    let entry = crate::pool::entries(&args)?
        .into_iter()
        .find(|e| e.name == w.name)
        .ok_or_else(|| anyhow!("the serve arguments name no model '{}'", w.name))?;
    let threads = ferrite_runtime::threads::init(args.model.threads)?;
    let loaded = ferrite_models::load_with(&entry.path, args.model.device, &args.model.load_options())?;
    let engine = crate::pool::start_engine(&loaded, &entry.path, &args.engine, threads)?;
    let socket = UnixStream::connect(&w.socket).with_context(|| format!("cannot connect to {}", w.socket.display()))?;
    ferrite_server::isolate::worker::serve_engine(engine, socket).context("serving the engine")?;
    Ok(())
}
