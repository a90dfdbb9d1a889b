//! The web chat at `/`: a page (`index.html`) and its stylesheet and ES modules under
//! `/web/`, embedded at build time (no build step, no external assets). In the browser it
//! streams a conversation through `/v1/chat/completions`, renders Markdown with highlighted
//! code (`markdown.js`, `highlight.js`, which build DOM nodes and never parse model output as
//! HTML), keeps conversations and settings in `localStorage` (`store.js`), and offers edit,
//! regenerate, stop and a model picker fed by `/v1/models` (`app.js`, `view.js`, `api.js`).
//! Every response carries a Content-Security-Policy that allows only this server's own
//! scripts, styles and API, as a second wall behind the escaping. The page and its assets are
//! served without an API key; the page asks for one when the API wants it.

use std::sync::Arc;

use axum::extract::Path;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::error::ApiError;
use crate::state::App;

/// Where the page's assets are served (open without an API key, like `/`).
pub const ASSET_PREFIX: &str = "/web/";

/// No inline script, no eval, no other origin: only this server's files and API.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

const INDEX: &str = include_str!("index.html");

/// The assets under [`ASSET_PREFIX`]: file name, content type, text.
const ASSETS: &[(&str, &str, &str)] = &[
    ("style.css", "text/css; charset=utf-8", include_str!("style.css")),
    ("app.js", "text/javascript; charset=utf-8", include_str!("app.js")),
    ("view.js", "text/javascript; charset=utf-8", include_str!("view.js")),
    ("api.js", "text/javascript; charset=utf-8", include_str!("api.js")),
    ("store.js", "text/javascript; charset=utf-8", include_str!("store.js")),
    ("markdown.js", "text/javascript; charset=utf-8", include_str!("markdown.js")),
    ("highlight.js", "text/javascript; charset=utf-8", include_str!("highlight.js")),
];

pub fn routes() -> Router<Arc<App>> {
    Router::new().route("/", get(page)).route("/web/{file}", get(asset))
}

/// Whether `path` is served without an API key.
pub fn is_open_path(path: &str) -> bool {
    path == "/" || path.strip_prefix(ASSET_PREFIX).is_some_and(|file| ASSETS.iter().any(|(name, ..)| *name == file))
}

fn static_response(content_type: &'static str, body: &'static str) -> Response {
    let mut resp = body.into_response();
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    // Revalidate every time, so a new binary's page is never mixed with an old cached module.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

async fn page() -> Response {
    static_response("text/html; charset=utf-8", INDEX)
}

async fn asset(Path(file): Path<String>) -> Result<Response, ApiError> {
    ASSETS
        .iter()
        .find(|(name, ..)| *name == file)
        .map(|(_, content_type, body)| static_response(content_type, body))
        .ok_or_else(|| ApiError::not_found(format!("no web asset '{file}'")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_page_and_its_assets_are_open() {
        assert!(is_open_path("/"));
        assert!(is_open_path("/web/app.js"));
        assert!(is_open_path("/web/style.css"));
        assert!(!is_open_path("/web/"));
        assert!(!is_open_path("/web/secret"));
        assert!(!is_open_path("/v1/models"));
    }

    #[test]
    fn every_module_the_page_imports_is_served() {
        for (name, ..) in ASSETS {
            let reference = format!("./{name}");
            let linked = INDEX.contains(&format!("{ASSET_PREFIX}{name}"));
            let imported = ASSETS.iter().any(|(_, _, text)| text.contains(&format!("from \"{reference}\"")));
            assert!(linked || imported, "{name} is neither linked from the page nor imported");
        }
        for (_, _, text) in ASSETS {
            for import in text.split("from \"./").skip(1) {
                let file = import.split('"').next().unwrap_or_default();
                assert!(ASSETS.iter().any(|(name, ..)| *name == file), "'{file}' is imported but not served");
            }
        }
    }
}
