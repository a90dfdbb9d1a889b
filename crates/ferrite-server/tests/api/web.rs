//! The web chat page at `/` (its behaviour in a browser is `scripts/web_chat_test.py`).

use ferrite_server::ServerConfig;

use crate::common::*;

#[tokio::test]
async fn the_chat_page_is_served_without_a_key() {
    let server = start(tiny_app("llama", ServerConfig { api_key: Some("k".into()), ..ServerConfig::default() }));
    let resp = client().get(server.at("/")).send().await.expect("request");
    assert_eq!(resp.status(), 200);
    let ctype = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    assert!(ctype.starts_with("text/html"), "{ctype}");
    let page = resp.text().await.expect("body");
    for needle in
        ["<title>ferrite chat</title>", "/v1/chat/completions", "AbortController", "reasoning_content", "id=\"stop\""]
    {
        assert!(page.contains(needle), "the page has {needle}");
    }
    assert!(!page.contains("http://") && !page.contains("https://"), "no external assets");
    // The API behind it still wants the key.
    assert_eq!(get(&server.at("/v1/models")).await.0, 401);
}
