//! The SSE writer round trip: a JSON value written as a `data:` event (or a named event, as
//! the Anthropic and Responses streams send) through the real `text/event-stream` response
//! body, read back by an SSE reader as a client would (WHATWG rules: `data:` lines joined
//! with newlines, one optional space after the colon), must give the same event name and
//! the same JSON text.
#![no_main]

use std::sync::OnceLock;

use ferrite_server::sse::{done_event, json_event, named_event, sse_response};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const NAMES: [&str; 4] = ["message_start", "content_block_delta", "response.output_text.delta", "error"];

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime"))
}

/// (event name, data) of each event in an SSE body; comments and empty events skipped.
fn read_events(body: &str) -> Vec<(Option<String>, String)> {
    let mut events = Vec::new();
    let (mut name, mut data): (Option<String>, Option<String>) = (None, None);
    for line in body.split('\n') {
        if line.is_empty() {
            if let Some(d) = data.take() {
                events.push((name.take(), d));
            }
            name = None;
            continue;
        }
        if line.starts_with(':') {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => name = Some(value.to_string()),
            "data" => match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_string()),
            },
            _ => {}
        }
    }
    events
}

fuzz_target!(|data: &[u8]| {
    let [pick, json @ ..] = data else { return };
    let Ok(value) = serde_json::from_slice::<Value>(json) else { return };
    let name = (pick % 5 != 4).then(|| NAMES[*pick as usize % 5]);
    let event = match name {
        Some(n) => named_event(n, &value),
        None => json_event(&value),
    };
    // The keep-alive timer needs the runtime's clock: build the response inside it.
    let events = futures_util::stream::iter([event, done_event()]);
    let body = runtime().block_on(async move { sse_response(events).into_body().collect().await });
    let bytes = body.expect("body").to_bytes();
    let text = std::str::from_utf8(&bytes).expect("SSE body is UTF-8");
    let events = read_events(text);
    assert_eq!(events.len(), 2, "{text:?}");
    assert_eq!(events[0].0.as_deref(), name, "{text:?}");
    // The reader gets the writer's JSON text back exactly (comparing parsed values would test
    // serde_json's float parsing, which does not round-trip every f64).
    assert_eq!(events[0].1, value.to_string(), "{text:?}");
    serde_json::from_str::<Value>(&events[0].1).expect("data is JSON");
    assert_eq!(events[1], (None, "[DONE]".to_string()));
});
