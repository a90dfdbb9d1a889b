//! `App`: what every handler shares — the pool of served models (`pool`: each an engine and
//! its `ModelInfo`: names, tokenizer, chat template, sampling defaults), the server settings,
//! metrics, the admission gate, the output-parser factory, the stored responses, the slots for
//! CPU-heavy work and the bound address. Handlers receive it as `State<Arc<App>>` and take a
//! `pool::Lease` on the model a request names.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ferrite_engine::Engine;
use ferrite_models::chat_template::ChatTemplate;
use ferrite_models::load::GenerationDefaults;
use ferrite_models::tokenizer::Tokenizer;
use ferrite_models::{LoadedModel, ModelText};

use crate::admission::Admission;
use crate::error::ApiError;
use crate::guard::GuardConfig;
use crate::metrics::ServerMetrics;
use crate::offload::Offload;
use crate::parser::{ParserFactory, TemplateParsers};
use crate::pool::{ModelPool, Served};
use crate::responses::store::ResponseStore;

/// Server settings (the `ferrite serve` flags that are not about the engine).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Required as `Authorization: Bearer KEY` or `x-api-key: KEY` when set.
    pub api_key: Option<String>,
    /// Requests admitted at once (running + waiting + being submitted); more get 429.
    pub max_queue: Option<usize>,
    /// Largest request body in bytes; larger ones get 413.
    pub body_limit: usize,
    /// How long a shutdown waits for in-flight requests before dropping them.
    pub shutdown_timeout: Duration,
    /// Responses kept for `previous_response_id` and `GET /v1/responses/{id}` (0: none).
    pub response_store_capacity: usize,
    /// How long a stored response is kept.
    pub response_store_ttl: Duration,
    /// Bytes the stored responses may hold together (their JSON); past it the oldest go.
    pub response_store_bytes: usize,
    /// `Host` and `Origin` checks (`guard`).
    pub guard: GuardConfig,
    /// Connections served at once; more wait in the listen backlog (`listener`).
    pub max_connections: usize,
    /// How long a connection may take to send a request's headers once it is waiting for one.
    pub header_read_timeout: Duration,
    /// How long a connection may sit idle between requests before it is closed.
    pub keep_alive_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            api_key: None,
            max_queue: None,
            body_limit: 32 << 20,
            shutdown_timeout: Duration::from_secs(30),
            response_store_capacity: 1024,
            response_store_ttl: Duration::from_secs(3600),
            response_store_bytes: 256 << 20,
            guard: GuardConfig::default(),
            max_connections: crate::listener::default_max_connections(),
            header_read_timeout: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(5),
        }
    }
}

/// The model this server serves.
#[derive(Clone)]
pub struct ModelInfo {
    /// The name `/v1/models` lists.
    pub name: String,
    /// Other names requests may use (the file stem, the name it was started with).
    pub aliases: Vec<String>,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub chat_template: Option<ChatTemplate>,
    pub defaults: GenerationDefaults,
    /// Unix seconds when the server loaded it.
    pub created: u64,
    /// The longest text worth tokenizing: longer text cannot fit the context (`prompt`).
    pub max_text_bytes: usize,
}

impl ModelInfo {
    pub fn new(loaded: &LoadedModel, name: String, aliases: Vec<String>) -> ModelInfo {
        ModelInfo {
            name,
            aliases,
            tokenizer: loaded.tokenizer.clone(),
            chat_template: loaded.chat_template.clone(),
            defaults: loaded.generation.clone(),
            created: unix_now(),
            max_text_bytes: usize::MAX,
        }
    }

    /// The model described by `text` (a model whose weights another process holds).
    pub fn from_text(text: &ModelText, name: String, aliases: Vec<String>) -> ModelInfo {
        ModelInfo {
            name,
            aliases,
            tokenizer: text.tokenizer.clone(),
            chat_template: text.chat_template.clone(),
            defaults: text.generation.clone(),
            created: unix_now(),
            max_text_bytes: usize::MAX,
        }
    }

    /// The tokenizer, or a 400 saying the model has none.
    pub fn tokenizer(&self) -> Result<&Tokenizer, ApiError> {
        self.tokenizer.as_deref().ok_or_else(|| ApiError::bad_request("this model has no tokenizer; send token ids"))
    }
}

pub struct App {
    pub pool: ModelPool,
    pub config: ServerConfig,
    pub metrics: ServerMetrics,
    pub admission: Admission,
    pub parsers: Box<dyn ParserFactory>,
    /// Finished responses of `/v1/responses`.
    pub responses: ResponseStore,
    /// Slots for CPU-heavy request work off the async workers.
    pub offload: Offload,
    /// The address `serve` listens on (for the `Host` check), once it does.
    pub bound: OnceLock<SocketAddr>,
}

impl App {
    /// A server of one model, already loaded.
    pub fn new(engine: Engine, model: ModelInfo, config: ServerConfig) -> App {
        App::with_pool(ModelPool::single(Served::new(Box::new(engine), model)), config)
    }

    /// A server of the models of `pool`.
    pub fn with_pool(pool: ModelPool, config: ServerConfig) -> App {
        App {
            pool,
            admission: Admission::new(config.max_queue),
            responses: ResponseStore::new(
                config.response_store_capacity,
                config.response_store_bytes,
                config.response_store_ttl,
            ),
            offload: Offload::per_core(),
            bound: OnceLock::new(),
            config,
            metrics: ServerMetrics::default(),
            parsers: Box::new(TemplateParsers),
        }
    }

    /// Replace the output parsers (tool calls, reasoning) chat responses go through.
    pub fn with_parsers(mut self, parsers: Box<dyn ParserFactory>) -> App {
        self.parsers = parsers;
        self
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A fresh id: `prefix` then 24 random hex digits.
pub fn random_id(prefix: &str) -> String {
    format!("{prefix}{:024x}", rand::random::<u128>() >> 32)
}
