//! The admission gate behind `--max-queue`, counted in sequences (a request's choices times
//! its prompts: `n = 64` is 64 sequences). Every engine request holds a `Permit` for its
//! sequences from before it is submitted until its response is done (or its client went
//! away), so the count covers running, waiting and in-flight submissions alike. A request that
//! would go past the limit gets 429 with `Retry-After` instead of queueing without bound; one
//! that could never fit, even on an idle server, gets 400.

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

/// One admitted engine request (its `sequences`); released on drop.
#[derive(Debug)]
pub struct Permit {
    active: Arc<AtomicUsize>,
    sequences: usize,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.active.fetch_sub(self.sequences, Ordering::AcqRel);
    }
}

impl Admission {
    pub fn new(max: Option<usize>) -> Admission {
        Admission { active: Arc::new(AtomicUsize::new(0)), max }
    }

    /// Sequences admitted now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    /// Admit one engine request of `n` sequences.
    pub fn admit_one(&self, n: usize) -> Result<Permit, ApiError> {
        let mut permits = self.admit(1, n)?;
        permits.pop().ok_or_else(|| ApiError::internal("admission returned no permit"))
    }

    /// Admit `requests` engine requests of `n` sequences each at once (one permit each), or
    /// none: 429 past the limit, 400 when they could never fit.
    pub fn admit(&self, requests: usize, n: usize) -> Result<Vec<Permit>, ApiError> {
        let count = requests.saturating_mul(n);
        if let Some(max) = self.max.filter(|&max| count > max) {
            return Err(ApiError::invalid_param(
                "n",
                format!("the request needs {count} sequences ({requests} prompts × n = {n}); this server runs at most {max} at once (--max-queue)"),
            ));
        }
        let admitted = self.active.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| match self.max {
            Some(max) if now + count > max => None,
            _ => Some(now + count),
        });
        match admitted {
            Ok(_) => Ok((0..requests).map(|_| Permit { active: self.active.clone(), sequences: n }).collect()),
            Err(now) => Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "the server is at capacity ({now} sequences in progress, limit {}); retry later",
                    self.max.unwrap_or(0)
                ),
            )
            .with_code("queue_full")
            .with_retry_after(RETRY_AFTER_SECS)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_sequences_and_refuses_what_never_fits() {
        let gate = Admission::new(Some(4));
        let three = gate.admit_one(3).expect("fits");
        assert_eq!(gate.active(), 3);
        assert_eq!(gate.admit(2, 1).expect_err("full").status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(gate.admit(1, 5).expect_err("never fits").status, StatusCode::BAD_REQUEST);
        assert_eq!(gate.admit(3, 2).expect_err("never fits").status, StatusCode::BAD_REQUEST);
        drop(three);
        assert_eq!(gate.admit(2, 2).expect("fits now").len(), 2);
        assert_eq!(gate.active(), 0, "permits dropped at once");
    }
}
