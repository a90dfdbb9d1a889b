//! CPU-heavy request work — chat-template rendering, tokenizing, grammar compilation — runs
//! here, on tokio's blocking pool and at most one job per core at once, never on the async
//! workers: a 26 MB prompt being tokenized (or refused) must not stall `/health` or the
//! streams of other requests. Jobs past the limit wait their turn without holding a thread.

use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::error::ApiError;
use crate::state::App;

/// The slots of CPU-heavy request work.
pub struct Offload {
    slots: Semaphore,
}

impl Offload {
    /// One slot per core (at least one).
    pub fn per_core() -> Offload {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Offload { slots: Semaphore::new(cores) }
    }
}

impl App {
    /// Run `work` off the async workers, once a slot is free.
    pub async fn off_runtime<T, F>(self: &Arc<Self>, work: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce(&App) -> Result<T, ApiError> + Send + 'static,
    {
        let _slot =
            self.offload.slots.acquire().await.map_err(|_| ApiError::internal("the server is shutting down"))?;
        let app = self.clone();
        tokio::task::spawn_blocking(move || work(&app))
            .await
            .map_err(|_| ApiError::internal("preparing the request failed"))?
    }
}
