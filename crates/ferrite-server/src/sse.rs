//! Server-sent events: a stream of JSON events becomes a `text/event-stream` response
//! (`data: {...}\n\n`; named events add `Event::event`), with keep-alive comments while the
//! model is quiet. When the client goes away the response body — and with it the event stream and
//! the engine request inside it — is dropped, which aborts the request.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use ferrite_engine::Output;
use futures_util::{Stream, StreamExt};
use serde_json::Value;

/// A `data:` event carrying `value` as JSON.
pub fn json_event(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

/// An `event: NAME` event carrying `value` as JSON (Anthropic and Responses streams).
pub fn named_event(name: &str, value: &Value) -> Event {
    Event::default().event(name).data(value.to_string())
}

/// The OpenAI end-of-stream marker, `data: [DONE]`.
pub fn done_event() -> Event {
    Event::default().data("[DONE]")
}

/// An SSE response over `events`.
pub fn sse_response(events: impl Stream<Item = Event> + Send + 'static) -> Response {
    Sse::new(events.map(Ok::<Event, Infallible>))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

/// Turns engine outputs into the events of one API's stream.
pub trait StreamRenderer: Send + 'static {
    /// Events before the first output.
    fn start(&mut self) -> Vec<Event>;
    /// Events for one output.
    fn output(&mut self, out: Output) -> Vec<Event>;
    /// Events after the last output (usage, end markers, or an error when choices never
    /// finished).
    fn end(&mut self) -> Vec<Event>;
}

/// An SSE response rendering `outputs` with `renderer`.
pub fn sse_from_outputs(
    outputs: impl Stream<Item = Output> + Send + 'static,
    mut renderer: impl StreamRenderer,
) -> Response {
    let start = renderer.start();
    let rest = futures_util::stream::unfold(Some((Box::pin(outputs), renderer)), |state| async move {
        let (mut outputs, mut renderer) = state?;
        match outputs.next().await {
            Some(out) => Some((renderer.output(out), Some((outputs, renderer)))),
            None => Some((renderer.end(), None)),
        }
    });
    let events = futures_util::stream::iter(start).chain(rest.flat_map(futures_util::stream::iter));
    sse_response(events)
}
