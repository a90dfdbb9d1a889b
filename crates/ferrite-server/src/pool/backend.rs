//! `EngineBackend`: what the server needs of a running engine, whether it runs in this process
//! (`ferrite_engine::Engine`) or in a child process (`isolate::IsolatedEngine`): submit a
//! request and stream its outputs, its limits, its metrics, whether it is up, and LoRA
//! adapters loaded and unloaded at run time.

use std::sync::Arc;

use axum::http::StatusCode;
use ferrite_engine::{Engine, Limits, Metrics as EngineMetrics, Output, Request, RequestStream};
use ferrite_models::lora::LoraAdapter;

use crate::error::ApiError;
use crate::isolate::RemoteStream;

/// Whether an engine can take requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineHealth {
    Running,
    /// Its process crashed and is being started again; requests wait for it.
    Restarting,
    /// It crashed too often and is not restarted; the message says why.
    Down(String),
}

impl EngineHealth {
    /// The state's name, as `/v1/models` and `/health` show it.
    pub fn label(&self) -> &'static str {
        match self {
            EngineHealth::Running => "loaded",
            EngineHealth::Restarting => "restarting",
            EngineHealth::Down(_) => "down",
        }
    }
}

pub trait EngineBackend: Send + Sync {
    fn limits(&self) -> &Limits;
    /// The engine's counters and gauges (for a child process, as of its last report).
    fn metrics(&self) -> &Arc<EngineMetrics>;
    /// Validate and queue a request (blocking: run it off the async workers).
    fn submit(&self, req: Request) -> Result<EngineStream, ApiError>;
    fn health(&self) -> EngineHealth {
        EngineHealth::Running
    }
    /// The id of the process the engine runs in, when that is not this one.
    fn pid(&self) -> Option<u32> {
        None
    }
    /// Load `adapter` under `name` (blocking).
    fn load_adapter(&self, _name: &str, _adapter: Arc<LoraAdapter>) -> Result<(), ApiError> {
        Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, "this engine serves no LoRA adapters"))
    }
    /// Unload the adapter `name` (blocking); refused while a request runs through it.
    fn unload_adapter(&self, name: &str) -> Result<(), ApiError> {
        Err(ApiError::not_found(format!("the LoRA adapter '{name}' is not loaded")))
    }
}

impl EngineBackend for Engine {
    fn limits(&self) -> &Limits {
        Engine::limits(self)
    }

    fn metrics(&self) -> &Arc<EngineMetrics> {
        Engine::metrics(self)
    }

    fn submit(&self, req: Request) -> Result<EngineStream, ApiError> {
        Ok(EngineStream::Local(Engine::submit(self, req)?))
    }

    fn load_adapter(&self, name: &str, adapter: Arc<LoraAdapter>) -> Result<(), ApiError> {
        Ok(Engine::load_adapter(self, name, adapter)?)
    }

    fn unload_adapter(&self, name: &str) -> Result<(), ApiError> {
        Ok(Engine::unload_adapter(self, name)?)
    }
}

/// The outputs of one submitted request; dropping it cancels the request.
pub enum EngineStream {
    Local(RequestStream),
    Remote(RemoteStream),
}

impl EngineStream {
    /// The next output; `None` once the engine is gone.
    pub async fn next(&mut self) -> Option<Output> {
        match self {
            EngineStream::Local(s) => s.next().await,
            EngineStream::Remote(s) => s.next().await,
        }
    }
}
