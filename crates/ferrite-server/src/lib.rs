//! ferrite-server: the HTTP face of a pool of engines (`pool`: one per model, loaded on
//! demand, each in this process or in a child process of its own, `isolate`).
//!
//! `router` assembles the API surfaces — one module each (`openai`: chat, completions,
//! embeddings, models; `anthropic`: messages; `responses`: the Responses API; `ops`: health, metrics,
//! tokenize; `web`: the chat page at `/`) — over what they share: the app state (`state`),
//! typed errors (`error`), body extraction (`extract`), API-key checks (`auth`), `Host` and
//! `Origin` checks (`guard`), admission control (`admission`), CPU-heavy work off the async
//! workers (`offload`), engine requests with latency metrics (`generate`), conversations
//! with tools and tool choice (`conversation`) rendered through the chat template
//! (`prompt`), output parsers for reasoning and tool calls (`parser`), output blocks for
//! block-shaped replies (`blocks`) and SSE (`sse`). `serve` runs it on a listener (`listener`:
//! connection cap, header-read and keep-alive timeouts) until a shutdown signal, then drains
//! in-flight requests for a bounded time.
//!
//! A chat-shaped surface translates its request into a `conversation::Conversation`,
//! prepares it with `ModelInfo::prepare_chat` (prompt ids, parsers, special-token markers),
//! runs it with `App::generate`, streams with `sse::sse_from_outputs`, and renders
//! `ApiError`s in its own shape.

pub mod admission;
pub mod anthropic;
pub mod auth;
pub mod blocks;
pub mod conversation;
pub mod error;
pub mod extract;
pub mod generate;
pub mod guard;
pub mod hosted;
pub mod isolate;
pub mod listener;
pub mod metrics;
pub mod offload;
pub mod openai;
pub mod ops;
pub mod parser;
pub mod pool;
pub mod prompt;
pub mod responses;
pub mod sse;
pub mod state;
pub mod structured;
pub mod web;

use std::future::Future;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request};
use axum::http::StatusCode;
use axum::middleware::{from_fn, from_fn_with_state};
use axum::Router;
use tokio::net::TcpListener;

pub use error::ApiError;
pub use state::{App, ModelInfo, ServerConfig};

/// Every route, with the `Host`/`Origin` guard, authentication, request metrics and the body
/// limit.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .merge(openai::routes())
        .merge(anthropic::routes())
        .merge(responses::routes())
        .merge(ops::routes())
        .merge(web::routes())
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(from_fn_with_state(app.clone(), auth::require_api_key))
        .layer(from_fn_with_state(app.clone(), guard::check))
        .layer(from_fn(anthropic::error_shape))
        .layer(from_fn_with_state(app.clone(), metrics::count_requests))
        .layer(DefaultBodyLimit::max(app.config.body_limit))
        .with_state(app)
}

async fn no_route(req: Request) -> ApiError {
    ApiError::not_found(format!("no route for {} {}", req.method(), req.uri().path()))
}

async fn wrong_method(req: Request) -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, format!("{} is not allowed on {}", req.method(), req.uri().path()))
}

/// How `serve` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shutdown {
    /// Every in-flight request finished.
    Drained,
    /// The shutdown timeout passed with requests still in flight.
    TimedOut,
}

/// Serve `app` on `listener` until `shutdown` resolves; then stop accepting connections and
/// let in-flight requests finish, for at most `config.shutdown_timeout`.
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<Shutdown> {
    let _ = app.bound.set(listener.local_addr()?);
    let c = &app.config;
    let (timeout, bounds) = (
        c.shutdown_timeout,
        listener::Bounds {
            max_connections: c.max_connections,
            header_read_timeout: c.header_read_timeout,
            keep_alive_timeout: c.keep_alive_timeout,
        },
    );
    let (draining_tx, draining_rx) = tokio::sync::oneshot::channel::<()>();
    let unloader = app.clone();
    let idle = tokio::spawn(async move { unloader.pool.unload_idle().await });
    let server = listener::run(listener, router(app), bounds, async move {
        shutdown.await;
        let _ = draining_tx.send(());
    });
    let deadline = async move {
        match draining_rx.await {
            Ok(()) => tokio::time::sleep(timeout).await,
            Err(_) => std::future::pending().await,
        }
    };
    let ended = tokio::select! {
        done = server => done.map(|()| Shutdown::Drained),
        () = deadline => Ok(Shutdown::TimedOut),
    };
    idle.abort();
    ended
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}
