//! The connection layer and the browser guard (issue 26): slow and idle connections are closed
//! and cannot starve `/health`; foreign `Host`s, cross-origin browser requests and non-JSON
//! bodies are refused, while the server's own origin and `--cors-allow-origin` pass.

use std::time::Duration;

use ferrite_server::guard::GuardConfig;
use ferrite_server::ServerConfig;
use serde_json::json;
use std::io::{Read, Write};
use std::net::TcpStream;

use crate::common::*;

fn quick_timeouts() -> ServerConfig {
    ServerConfig {
        max_connections: 4,
        header_read_timeout: Duration::from_secs(1),
        keep_alive_timeout: Duration::from_secs(1),
        ..ServerConfig::default()
    }
}

/// Connect, send `head`, and read until the server closes the connection (a blocking socket
/// on a blocking thread); the bytes it sent.
async fn sent_until_closed(addr: &str, head: &'static [u8]) -> Vec<u8> {
    let addr = addr.to_string();
    tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(&addr).expect("connect");
        stream.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
        stream.write_all(head).expect("write");
        let mut got = Vec::new();
        stream.read_to_end(&mut got).expect("the server closed the connection");
        got
    })
    .await
    .expect("reader")
}

#[tokio::test]
async fn slow_headers_and_idle_connections_are_closed() {
    let server = start(tiny_app("llama", quick_timeouts()));
    let addr = server.url.trim_start_matches("http://").to_string();
    // Slowloris: a request head that never ends.
    let answer = sent_until_closed(&addr, b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ").await;
    assert!(!answer.starts_with(b"HTTP/1.1 200"), "no response to a partial head");
    // Idle before any request, and idle after one (keep-alive).
    assert!(sent_until_closed(&addr, b"").await.is_empty());
    let answer = sent_until_closed(&addr, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n").await;
    assert!(answer.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&answer));
}

#[tokio::test]
async fn an_idle_flood_past_the_connection_cap_does_not_hang_health() {
    let server = start(tiny_app("llama", quick_timeouts()));
    let addr = server.url.trim_start_matches("http://").to_string();
    let mut flood = Vec::new();
    for _ in 0..40 {
        flood.push(tokio::net::TcpStream::connect(&addr).await.expect("connect"));
    }
    let (status, body) = get(&server.at("/health")).await;
    assert_eq!(status, 200, "{body}");
    drop(flood);
}

#[tokio::test]
async fn json_endpoints_need_a_json_content_type() {
    let url = tiny().at("/v1/completions");
    let body = json!({"prompt": [1, 2], "max_tokens": 1}).to_string();
    for ctype in [None, Some("text/plain"), Some("application/x-www-form-urlencoded"), Some("multipart/form-data")] {
        let mut req = client().post(&url).body(body.clone());
        if let Some(c) = ctype {
            req = req.header("content-type", c);
        }
        let resp = req.send().await.expect("request");
        assert_eq!(resp.status(), 415, "{ctype:?}");
    }
    let resp = client().post(&url).header("content-type", "application/json; charset=utf-8").body(body).send().await;
    assert_eq!(resp.expect("request").status(), 200);
}

#[tokio::test]
async fn foreign_hosts_and_origins_are_refused() {
    let server = tiny();
    let url = server.at("/v1/completions");
    let own = server.url.clone();
    let body = json!({"prompt": [1, 2], "max_tokens": 1});
    let send = |host: Option<&str>, origin: Option<&str>| {
        let mut req = client().post(&url).json(&body);
        if let Some(h) = host {
            req = req.header("host", h);
        }
        if let Some(o) = origin {
            req = req.header("origin", o);
        }
        req.send()
    };
    assert_eq!(send(Some("evil.example:8080"), None).await.expect("request").status(), 421, "DNS rebinding");
    assert_eq!(send(None, Some("http://evil.example")).await.expect("request").status(), 403, "cross-origin");
    assert_eq!(send(None, Some("null")).await.expect("request").status(), 403, "opaque origin");
    assert_eq!(send(Some("localhost"), None).await.expect("request").status(), 200);
    assert_eq!(send(None, Some(&own)).await.expect("request").status(), 200, "the web chat's own origin");
}

#[tokio::test]
async fn allowed_hosts_and_cors_origins_pass() {
    let guard = GuardConfig {
        allowed_hosts: vec!["llm.internal".into()],
        cors_allow_origins: vec!["https://app.example".into()],
    };
    let server = start(tiny_app("llama", ServerConfig { guard, ..ServerConfig::default() }));
    let url = server.at("/v1/completions");
    let body = json!({"prompt": [1, 2], "max_tokens": 1});
    let resp = client().post(&url).header("host", "llm.internal").json(&body).send().await.expect("request");
    assert_eq!(resp.status(), 200);
    let resp = client().post(&url).header("origin", "https://app.example").json(&body).send().await.expect("request");
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers().get("access-control-allow-origin").and_then(|v| v.to_str().ok()),
        Some("https://app.example")
    );
    let preflight = client()
        .request(reqwest::Method::OPTIONS, &url)
        .header("origin", "https://app.example")
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "content-type, authorization")
        .send()
        .await
        .expect("request");
    assert_eq!(preflight.status(), 204);
    let allowed = preflight.headers().get("access-control-allow-headers").and_then(|v| v.to_str().ok());
    assert_eq!(allowed, Some("content-type, authorization"));
    let other = client().post(&url).header("origin", "https://other.example").json(&body).send().await;
    assert_eq!(other.expect("request").status(), 403);
}
