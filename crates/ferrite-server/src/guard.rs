//! Browser-borne attacks on a keyless local server (CSRF, DNS rebinding): every request's
//! `Host` must name this server — a localhost name, a loopback IP, the bound IP (any IP when
//! bound to all interfaces) or one of `--allowed-hosts` (for proxies; `*` allows any) — else
//! 421; a request with an `Origin` other than the server's own (`http://` + its `Host`) is
//! refused with 403 unless `--cors-allow-origin` lists that origin (or `*`), in which case it
//! gets CORS headers and its preflight (`OPTIONS`) is answered. JSON endpoints also require
//! `Content-Type: application/json` (`extract`), which a form or `text/plain` post cannot set
//! without a preflight.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::App;

/// What the guard lets through, beyond the server's own names.
#[derive(Debug, Clone, Default)]
pub struct GuardConfig {
    /// Host names (no port) that requests may be addressed to; `*` allows any.
    pub allowed_hosts: Vec<String>,
    /// Origins (`scheme://host[:port]`) whose browser requests are allowed; `*` allows any.
    pub cors_allow_origins: Vec<String>,
}

pub async fn check(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let cfg = &app.config.guard;
    let bound = app.bound.get().copied();
    let headers = req.headers();
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    if let Some(host) = host {
        if !host_allowed(host, bound, &cfg.allowed_hosts) {
            return ApiError::new(
                StatusCode::MISDIRECTED_REQUEST,
                format!("the Host '{host}' is not this server's (add it with --allowed-hosts)"),
            )
            .with_code("host_not_allowed")
            .into_response();
        }
    }
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()).map(str::to_string) else {
        return next.run(req).await;
    };
    if host.is_some_and(|h| origin.eq_ignore_ascii_case(&format!("http://{h}"))) {
        return next.run(req).await;
    }
    if !cfg.cors_allow_origins.iter().any(|o| o == "*" || o.eq_ignore_ascii_case(&origin)) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            format!("cross-origin requests from '{origin}' are not allowed (see --cors-allow-origin)"),
        )
        .with_code("origin_not_allowed")
        .into_response();
    }
    let mut resp = if req.method() == Method::OPTIONS {
        let mut r = StatusCode::NO_CONTENT.into_response();
        preflight_headers(req.headers(), r.headers_mut());
        r
    } else {
        next.run(req).await
    };
    if let Ok(v) = HeaderValue::from_str(&origin) {
        resp.headers_mut().insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
        resp.headers_mut().insert(header::VARY, HeaderValue::from_static("Origin"));
    }
    resp
}

fn preflight_headers(req: &HeaderMap, out: &mut HeaderMap) {
    out.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, OPTIONS"));
    let asked = req.get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned();
    out.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        asked.unwrap_or_else(|| HeaderValue::from_static("authorization, content-type, x-api-key")),
    );
    out.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
}

/// The host part of a `Host` value (`name`, `name:port`, `[v6]:port`), lowercased.
fn host_name(host: &str) -> String {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => host.rsplit_once(':').map_or(host, |(name, port)| match port.parse::<u16>() {
            Ok(_) => name,
            Err(_) => host,
        }),
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

fn host_allowed(host: &str, bound: Option<SocketAddr>, allowed: &[String]) -> bool {
    let name = host_name(host);
    if name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    if allowed.iter().any(|a| a == "*" || host_name(a) == name) {
        return true;
    }
    match name.parse::<IpAddr>() {
        // A rebinding attack needs a name; an IP literal names the machine itself.
        Ok(ip) => ip.is_loopback() || bound.is_none_or(|b| b.ip().is_unspecified() || b.ip() == ip),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        let local: SocketAddr = "127.0.0.1:8080".parse().expect("addr");
        let lan: SocketAddr = "192.168.1.5:8080".parse().expect("addr");
        let any: SocketAddr = "0.0.0.0:8080".parse().expect("addr");
        for h in ["localhost:8080", "LOCALHOST", "127.0.0.1:8080", "[::1]:8080", "app.localhost"] {
            assert!(host_allowed(h, Some(local), &[]), "{h}");
        }
        for h in ["evil.example:8080", "evil.example", "10.0.0.1:8080", "localhost.evil.example"] {
            assert!(!host_allowed(h, Some(local), &[]), "{h}");
        }
        assert!(host_allowed("192.168.1.5:8080", Some(lan), &[]));
        assert!(host_allowed("10.1.2.3", Some(any), &[]));
        assert!(!host_allowed("evil.example", Some(any), &[]));
        assert!(host_allowed("llm.corp:443", Some(local), &["llm.corp".into()]));
        assert!(host_allowed("whatever", Some(local), &["*".into()]));
    }
}
