//! The web chat at `/`: one static page (`chat.html`, embedded at build time, no external
//! assets) that streams a conversation through `/v1/chat/completions`, shows reasoning in a
//! collapsible block, and stops a generation by aborting its request (which aborts it in the
//! engine). It asks for an API key when the server wants one.

use std::sync::Arc;

use axum::response::Html;
use axum::routing::get;
use axum::Router;

use crate::state::App;

const PAGE: &str = include_str!("chat.html");

pub fn routes() -> Router<Arc<App>> {
    Router::new().route("/", get(page))
}

async fn page() -> Html<&'static str> {
    Html(PAGE)
}
