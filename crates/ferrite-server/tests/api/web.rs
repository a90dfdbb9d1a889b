//! The web chat page at `/` and its assets under `/web/` (its behaviour in a browser is
//! `scripts/web_chat_test.py`).

use ferrite_server::ServerConfig;

use crate::common::*;

async fn fetch(url: &str) -> (u16, String, String, String) {
    let resp = client().get(url).send().await.expect("request");
    let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let (ctype, csp) = (header("content-type"), header("content-security-policy"));
    (resp.status().as_u16(), ctype, csp, resp.text().await.expect("body"))
}

#[tokio::test]
async fn the_chat_page_and_its_assets_are_served_without_a_key() {
    let server = start(tiny_app("llama", ServerConfig { api_key: Some("k".into()), ..ServerConfig::default() }));
    let (status, ctype, csp, page) = fetch(&server.at("/")).await;
    assert_eq!(status, 200);
    assert!(ctype.starts_with("text/html"), "{ctype}");
    assert!(csp.contains("script-src 'self'") && csp.contains("default-src 'none'"), "{csp}");
    for needle in ["<title>ferrite chat</title>", "/web/app.js", "/web/style.css", "id=\"stop\"", "id=\"model-picker\""]
    {
        assert!(page.contains(needle), "the page has {needle}");
    }
    assert!(!page.contains("<script>") && !page.contains("style="), "nothing inline (the CSP forbids it)");
    let assets = [
        ("style.css", "text/css", "hl-kw"),
        ("app.js", "text/javascript", "AbortController"),
        ("api.js", "text/javascript", "/v1/chat/completions"),
        ("view.js", "text/javascript", "reasoning"),
        ("store.js", "text/javascript", "localStorage"),
        ("markdown.js", "text/javascript", "renderMarkdown"),
        ("highlight.js", "text/javascript", "hl-"),
    ];
    for (file, want_type, needle) in assets {
        let (status, ctype, csp, text) = fetch(&server.at(&format!("/web/{file}"))).await;
        assert_eq!(status, 200, "{file}");
        assert!(ctype.starts_with(want_type), "{file}: {ctype}");
        assert!(!csp.is_empty(), "{file} has the CSP");
        assert!(text.contains(needle), "{file} has {needle}");
        assert!(!text.contains("innerHTML"), "{file} never parses text as HTML");
        assert!(!text.contains("from \"http") && !text.contains("url(http"), "{file}: no external assets");
    }
    // Other paths under /web/ are not open, and the API behind the page still wants the key.
    assert_eq!(fetch(&server.at("/web/secret.js")).await.0, 401);
    assert_eq!(get(&server.at("/v1/models")).await.0, 401);
}

#[tokio::test]
async fn an_unknown_asset_is_a_404_with_an_error_body() {
    let (status, body) = get(&tiny().at("/web/nope.js")).await;
    assert_eq!(status, 404);
    assert!(body.contains("no web asset 'nope.js'"), "{body}");
}
