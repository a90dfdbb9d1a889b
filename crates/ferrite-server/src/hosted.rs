//! Tools that run on the provider's side — web search, web fetch, file search, code
//! interpreter / execution, image generation, remote MCP, tool search; dated variants like
//! `web_search_20250305` too. This server cannot run them, so the Anthropic and Responses
//! surfaces leave them out of the prompt instead of failing the request, and name their
//! types in the `x-ferrite-omitted-tools` response header (comma-separated).

use axum::http::HeaderValue;
use axum::response::Response;

/// The response header naming the tool types left out.
pub const OMITTED_TOOLS_HEADER: &str = "x-ferrite-omitted-tools";

const HOSTED: [&str; 8] = [
    "web_search",
    "web_fetch",
    "file_search",
    "code_interpreter",
    "code_execution",
    "image_generation",
    "mcp",
    "tool_search",
];

/// Whether a tool of this `type` runs on the provider's side.
pub fn is_hosted_tool(kind: &str) -> bool {
    HOSTED.iter().any(|h| kind == *h || kind.strip_prefix(h).is_some_and(|rest| rest.starts_with('_')))
}

/// `resp` with the omitted tool types named in its headers (unchanged when none were).
pub fn with_omitted_tools(mut resp: Response, omitted: &[String]) -> Response {
    if omitted.is_empty() {
        return resp;
    }
    if let Ok(value) = HeaderValue::from_str(&omitted.join(",")) {
        resp.headers_mut().insert(OMITTED_TOOLS_HEADER, value);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosted_types_and_their_dated_variants() {
        for kind in ["web_search", "web_search_20250305", "web_search_preview", "code_execution_20250825", "mcp"] {
            assert!(is_hosted_tool(kind), "{kind}");
        }
        for kind in ["function", "custom", "namespace", "web_searcher", "bash_20250124"] {
            assert!(!is_hosted_tool(kind), "{kind}");
        }
    }
}
