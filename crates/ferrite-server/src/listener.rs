//! The accept loop `serve` runs: HTTP/1.1 connections through hyper with three bounds a slow
//! or idle client cannot get around.
//!
//! - **Connections**: at most `max_connections` are served at once (default: below the
//!   process's open-file limit); past it the loop stops accepting and new ones wait in the
//!   listen backlog, so the process never runs out of file descriptors.
//! - **Header-read timeout**: a connection that started sending a request head must finish it
//!   within `header_read_timeout` (hyper's timer), or it is closed: slowloris.
//! - **Keep-alive timeout**: a connection with no request in progress and nothing received
//!   for `keep_alive_timeout` — before its first request or between two — is closed: idle
//!   floods. A request in progress (a long stream) is never cut.
//!
//! On shutdown it stops accepting, closes idle connections and lets requests in progress
//! finish; it reports when the last connection has closed.

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::Router;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tower_service::Service;

/// Descriptors kept free for everything else (model files, the KV spill, logs).
const SPARE_FILES: usize = 64;

/// The most connections `max_connections` may ask for.
const MAX_CONNECTIONS: usize = 1 << 20;

/// Connections served at once by default: the open-file limit less a margin, at least 16.
pub fn default_max_connections() -> usize {
    open_file_limit().map_or(1024, |limit| limit.saturating_sub(SPARE_FILES).max(16))
}

/// The soft `RLIMIT_NOFILE`, from `/proc/self/limits` (Linux).
fn open_file_limit() -> Option<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// The bounds of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub keep_alive_timeout: Duration,
}

/// Serve `router` on `listener` until `stop` resolves; then drain. Returns once every
/// connection has closed (the caller bounds the wait).
pub async fn run(
    listener: TcpListener,
    router: Router,
    bounds: Bounds,
    stop: impl std::future::Future<Output = ()>,
) -> io::Result<()> {
    let max = bounds.max_connections.clamp(1, MAX_CONNECTIONS);
    let slots = Arc::new(Semaphore::new(max));
    let (closing_tx, closing_rx) = watch::channel(false);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(bounds.header_read_timeout);
    let mut stop = std::pin::pin!(stop);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.map_err(io::Error::other)?,
            () = &mut stop => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of descriptors or a connection reset before it was accepted: the
                // listener itself is fine; back off briefly and go on.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let _ = stream.set_nodelay(true);
        let activity = Arc::new(Activity::new());
        let conn = http.serve_connection(
            TokioIo::new(Watched { inner: stream, activity: activity.clone() }),
            Tracker { router: router.clone(), activity: activity.clone() },
        );
        let closing = closing_rx.clone();
        tokio::spawn(async move {
            drive(conn, &activity, bounds.keep_alive_timeout, closing).await;
            drop(slot);
        });
    }
    drop(listener);
    let _ = closing_tx.send(true);
    // Every slot back: every connection has closed.
    let _all = slots.acquire_many(max as u32).await.map_err(io::Error::other)?;
    Ok(())
}

type Connection = hyper::server::conn::http1::Connection<TokioIo<Watched>, Tracker>;

/// Run one connection to its end; close it gracefully when it idles too long or the server
/// shuts down.
async fn drive(conn: Connection, activity: &Activity, keep_alive: Duration, mut closing: watch::Receiver<bool>) {
    let mut conn = std::pin::pin!(conn);
    let mut ending = false;
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            changed = closing.changed(), if !ending => {
                if changed.is_err() || *closing.borrow() {
                    conn.as_mut().graceful_shutdown();
                    ending = true;
                }
            }
            () = activity.idle_for(keep_alive), if !ending => {
                conn.as_mut().graceful_shutdown();
                ending = true;
            }
        }
    }
}

/// What one connection is doing: requests in progress, and whether anything arrived since
/// the last one ended.
struct Activity {
    in_flight: AtomicUsize,
    received: AtomicBool,
    idle_since: Mutex<Instant>,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            in_flight: AtomicUsize::new(0),
            received: AtomicBool::new(false),
            idle_since: Mutex::new(Instant::now()),
        }
    }

    /// Resolves once the connection has been idle — no request in progress, nothing
    /// received — for `limit`.
    async fn idle_for(&self, limit: Duration) {
        loop {
            let since = self.idle_since.lock().map_or_else(|_| Instant::now(), |t| *t);
            let idle = self.in_flight.load(Ordering::Acquire) == 0 && !self.received.load(Ordering::Acquire);
            match limit.checked_sub(since.elapsed()) {
                Some(left) if idle && !left.is_zero() => tokio::time::sleep(left).await,
                _ if idle => return,
                _ => tokio::time::sleep(limit).await,
            }
        }
    }

    fn request_started(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
    }

    fn request_ended(&self) {
        if let Ok(mut t) = self.idle_since.lock() {
            *t = Instant::now();
        }
        self.received.store(false, Ordering::Release);
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The socket, noting every byte that arrives.
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.received.store(true, Ordering::Release);
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The router as hyper's service, counting each request in progress until its response body
/// has been sent (or dropped).
#[derive(Clone)]
struct Tracker {
    router: Router,
    activity: Arc<Activity>,
}

impl hyper::service::Service<hyper::Request<Incoming>> for Tracker {
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, req: hyper::Request<Incoming>) -> Self::Future {
        self.activity.request_started();
        let guard = InFlight(self.activity.clone());
        let mut router = self.router.clone();
        Box::pin(async move {
            let resp = match router.call(req.map(Body::new)).await {
                Ok(resp) => resp,
                Err(never) => match never {},
            };
            Ok(resp.map(|inner| TrackedBody { inner, _in_flight: guard }))
        })
    }
}

/// Ends its request's count when dropped.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}

/// A response body that keeps its request counted as in progress.
struct TrackedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_connections_stay_below_the_file_limit() {
        let max = default_max_connections();
        if let Some(limit) = open_file_limit() {
            assert!(max < limit.max(17), "{max} connections against a limit of {limit} files");
        }
        assert!(max >= 16);
    }
}
