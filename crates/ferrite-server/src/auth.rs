//! API-key authentication: with `--api-key KEY`, every API route needs
//! `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients);
//! anything else is 401. `/health` and `/metrics` stay open for probes and scrapers, and so
//! do `/` and its assets (the web chat page, which asks for the key when the API wants one).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::App;

/// Paths served without a key.
const OPEN_PATHS: &[&str] = &["/health", "/metrics"];

pub async fn require_api_key(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let Some(key) = app.config.api_key.as_deref() else { return next.run(req).await };
    let path = req.uri().path();
    if OPEN_PATHS.contains(&path)
        || crate::web::is_open_path(path)
        || presented_key(req.headers()).is_some_and(|k| same(k, key))
    {
        return next.run(req).await;
    }
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "missing or invalid API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
    )
    .with_code("invalid_api_key")
    .into_response()
}

fn presented_key(headers: &HeaderMap) -> Option<&str> {
    let bearer = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer_token);
    bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim))
}

/// The credentials of an `Authorization: Bearer …` value; the scheme name is
/// case-insensitive (RFC 9110 §11.1).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Compare without an early exit, so the time taken does not reveal a matching prefix.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        for v in ["Bearer k", "bearer k", "BEARER k", "BeArEr  k "] {
            assert_eq!(bearer_token(v), Some("k"), "{v}");
        }
        assert_eq!(bearer_token("Basic k"), None);
        assert_eq!(bearer_token("Bearerk"), None);
    }
}
