//! Crash isolation (`ferrite serve --isolate`): each engine runs in a child process — the same
//! binary, started with a hidden subcommand that loads the model and calls
//! `worker::serve_engine` — and the HTTP process talks to it over a Unix socket with the framed
//! messages of `protocol` (submit, accepted/rejected, streamed outputs, cancel, metrics).
//!
//! `proxy::IsolatedEngine` is the HTTP process's side: an `EngineBackend` like an in-process
//! engine. When the child dies (a panic, which the worker turns into an abort; a CUDA fault; a
//! `kill -9`), every in-flight request of that engine ends with an error output naming how
//! it died, and the child is started again — at most `MAX_RESTARTS` times in
//! `RESTART_WINDOW`, after which the engine is reported down on `/health` and its requests
//! get 503. Other models' engines run in their own processes and are not affected.

pub mod protocol;
pub mod proxy;
pub mod worker;

use std::time::Duration;

pub use proxy::{IsolatedEngine, RemoteStream, WorkerCommand};

/// Restarts allowed within `RESTART_WINDOW`; one crash more and the engine stays down.
pub const MAX_RESTARTS: usize = 3;
pub const RESTART_WINDOW: Duration = Duration::from_secs(60);
