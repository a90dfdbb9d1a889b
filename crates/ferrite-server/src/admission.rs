//! The admission gate behind `--max-queue`: every engine request holds a `Permit` from
//! before it is submitted until its response is done (or its client went away), so the
//! count covers running, waiting and in-flight submissions alike. A request that would go
//! past the limit gets 429 with `Retry-After` instead of queueing without bound.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;

use crate::error::ApiError;

/// Seconds a rejected client is told to wait.
const RETRY_AFTER_SECS: u64 = 1;

pub struct Admission {
    active: Arc<AtomicUsize>,
    max: Option<usize>,
}

/// One admitted engine request; released on drop.
#[derive(Debug)]
pub struct Permit {
    active: Arc<AtomicUsize>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.active.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    pub fn new(max: Option<usize>) -> Admission {
        Admission { active: Arc::new(AtomicUsize::new(0)), max }
    }

    /// Engine requests admitted now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    /// Admit one engine request (429 past the limit).
    pub fn admit_one(&self) -> Result<Permit, ApiError> {
        let mut permits = self.admit(1)?;
        permits.pop().ok_or_else(|| ApiError::internal("admission returned no permit"))
    }

    /// Admit `count` engine requests at once (one permit each), or none (429).
    pub fn admit(&self, count: usize) -> Result<Vec<Permit>, ApiError> {
        let admitted = self.active.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| match self.max {
            Some(max) if now + count > max => None,
            _ => Some(now + count),
        });
        match admitted {
            Ok(_) => Ok((0..count).map(|_| Permit { active: self.active.clone() }).collect()),
            Err(now) => Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "the server is at capacity ({now} requests in progress, limit {}); retry later",
                    self.max.unwrap_or(0)
                ),
            )
            .with_code("queue_full")
            .with_retry_after(RETRY_AFTER_SECS)),
        }
    }
}
