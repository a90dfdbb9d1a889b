//! The `ferrite` binary: `serve` the OpenAI-compatible API, `run` a prompt, `chat` in the
//! terminal, `fit` a model to a device's memory, `models` / `pull` for the named models and
//! the local Hugging Face cache.
//!
//! Generated text goes to stdout; load and speed statistics go to stderr. Every failure is a
//! one-line error and a non-zero exit.

mod bench;
mod bench_embed;
mod bench_lora;
mod bench_pool;
mod bench_serve;
mod bench_tiers;
mod chat;
mod fit;
mod model_arg;
mod models;
mod no_compute;
mod pool;
mod run;
mod sampling;
mod serve;
mod session;
mod synthetic_text;
mod worker;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "ferrite", version, about = "Fast local LLM inference")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP API (chat, completions, models, metrics).
    Serve(Box<serve::ServeArgs>),
    /// Generate a completion for one prompt, streamed to stdout.
    Run(run::RunArgs),
    /// An interactive multi-turn chat in the terminal (/exit, /reset).
    Chat(chat::ChatArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Whether a model fits a device's memory (weights, workspace, KV per token, tokens and
    /// sequences that fit), from its config without loading it.
    Fit(fit::FitArgs),
    /// List the named models and the models in the local Hugging Face cache, with size,
    /// architecture and whether ferrite can run each.
    Models,
    /// Fetch a named model into the local cache (verified by sha256).
    Pull {
        /// smollm2, gemma3-270m, qwen2.5-coder-0.5b or qwen2.5-coder-1.5b
        name: String,
    },
    /// One model's engine in a process of its own, for `serve --isolate`.
    #[command(name = worker::SUBCOMMAND, hide = true)]
    EngineWorker(worker::WorkerArgs),
}

/// When the process started (for start-up times).
pub(crate) static STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

fn main() {
    STARTED.get_or_init(std::time::Instant::now);
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve::serve(*args),
        Command::Run(args) => run::run(args),
        Command::Chat(args) => chat::chat(args),
        Command::Bench(cmd) => bench::bench(cmd),
        Command::Fit(args) => fit::fit(args),
        Command::Models => models::list(),
        Command::Pull { name } => model_arg::pull(&name),
        Command::EngineWorker(args) => worker::worker(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
