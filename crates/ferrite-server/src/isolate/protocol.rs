//! The messages between the HTTP process and an engine's child process, each one frame: a
//! little-endian `u32` byte length, then that many bytes of JSON. The child sends `Ready`
//! (with its limits) once its model is loaded, answers each `Submit` with `Accepted` or
//! `Rejected`, streams `Output`s, and reports its metrics every `METRICS_EVERY`; a `Cancel`
//! (or the HTTP process closing the socket) aborts requests. `LoadAdapter` and
//! `UnloadAdapter` change the child's LoRA adapters (it reads the PEFT directory itself; the
//! matrices never cross the socket), each answered by `AdapterDone`.

use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::http::StatusCode;
use ferrite_engine::{Limits, Metrics as EngineMetrics, Output, Request, RequestId};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;

/// The largest frame either side accepts.
const MAX_FRAME: usize = 256 << 20;

/// How often the child reports its metrics.
pub const METRICS_EVERY: Duration = Duration::from_millis(250);

#[derive(Debug, Serialize, Deserialize)]
pub enum ToWorker {
    Submit {
        id: RequestId,
        request: Box<Request>,
    },
    Cancel {
        id: RequestId,
    },
    /// Load the PEFT adapter in `path` under `name` (`id` names the answer).
    LoadAdapter {
        id: u64,
        name: String,
        path: PathBuf,
    },
    UnloadAdapter {
        id: u64,
        name: String,
    },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum FromWorker {
    Ready {
        limits: Limits,
    },
    Accepted {
        id: RequestId,
    },
    Rejected {
        id: RequestId,
        error: WireError,
    },
    Output {
        id: RequestId,
        output: Output,
    },
    Metrics {
        values: Vec<u64>,
    },
    /// The answer to `LoadAdapter` or `UnloadAdapter` `id`: done, or why not.
    AdapterDone {
        id: u64,
        error: Option<WireError>,
    },
}

/// An `ApiError` as it crosses the socket (a request the child's engine refused).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireError {
    pub status: u16,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

/// The machine-readable codes engine refusals carry (`error::ApiError::from(EngineError)`).
const ENGINE_CODES: [&str; 5] =
    ["context_length_exceeded", "invalid_constraint", "invalid_adapter", "adapter_in_use", "model_not_found"];

impl From<ApiError> for WireError {
    fn from(e: ApiError) -> WireError {
        WireError { status: e.status.as_u16(), message: e.message, param: e.param, code: e.code.map(str::to_string) }
    }
}

impl From<WireError> for ApiError {
    fn from(w: WireError) -> ApiError {
        let status = StatusCode::from_u16(w.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut e = ApiError::new(status, w.message);
        e.param = w.param;
        e.code = w.code.and_then(|c| ENGINE_CODES.into_iter().find(|k| *k == c));
        e
    }
}

/// Write `msg` as one frame.
pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    if body.len() > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("a {} byte frame is too large", body.len())));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame)?;
    w.flush()
}

/// Read one frame; `None` when the other side closed the stream between frames.
pub fn read_frame<T: DeserializeOwned>(r: &mut impl Read) -> io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a {len} byte frame is too large")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body).map(Some).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Every counter and gauge of an engine's metrics, in a fixed order (the `Metrics` message's
/// values, and what `/metrics` adds up over a pool's engines).
pub fn metric_fields(m: &EngineMetrics) -> [&AtomicU64; 35] {
    [
        &m.requests_added,
        &m.requests_finished,
        &m.running,
        &m.waiting,
        &m.kv_blocks_free,
        &m.kv_blocks_total,
        &m.prefix_queried_tokens,
        &m.prefix_hit_tokens,
        &m.generated_tokens,
        &m.batched_tokens,
        &m.steps,
        &m.preemptions,
        &m.draft_forwards,
        &m.verify_proposed_tokens,
        &m.verify_accepted_tokens,
        &m.asserted_tokens,
        &m.overlapped_steps,
        &m.kv_transitions,
        &m.kv_converted_blocks,
        &m.ssd_lookup_tokens,
        &m.ssd_hit_tokens,
        &m.ssd_read_bytes,
        &m.ssd_written_bytes,
        &m.ssd_write_micros,
        &m.ssd_bytes,
        &m.ssd_files,
        &m.ssd_write_queue_jobs,
        &m.ssd_write_queue_bytes,
        &m.ssd_writes_dropped,
        &m.ssd_evicted_files,
        &m.ssd_corrupt_files,
        &m.resumed_generations,
        &m.resumed_tokens,
        &m.kv_bytes_per_token,
        &m.kv_capacity_tokens,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrite_engine::sampling::TokenLogprob;
    use ferrite_engine::{FinishReason, Finished, Usage};

    #[test]
    fn frames_round_trip_with_infinite_logprobs_and_stop_at_a_clean_end() {
        let output = Output {
            choice: 1,
            token_ids: vec![7, 8],
            text: "hé".into(),
            logprobs: vec![TokenLogprob { token: 7, logprob: -0.25, top: vec![(7, -0.25), (3, f32::NEG_INFINITY)] }],
            finished: Some(Finished {
                reason: FinishReason::Length,
                stop_string: None,
                stop_token: None,
                error: None,
                usage: Usage { prompt_tokens: 3, completion_tokens: 2, ..Usage::default() },
            }),
            cached_tokens: 0,
            embedding: Some(vec![0.5, -0.25]),
        };
        let mut buf = Vec::new();
        write_frame(&mut buf, &FromWorker::Output { id: 9, output: output.clone() }).expect("write");
        write_frame(&mut buf, &FromWorker::Accepted { id: 10 }).expect("write");
        let mut r = buf.as_slice();
        match read_frame::<FromWorker>(&mut r).expect("read") {
            Some(FromWorker::Output { id: 9, output: got }) => assert_eq!(got, output),
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(read_frame::<FromWorker>(&mut r).expect("read"), Some(FromWorker::Accepted { id: 10 })));
        assert!(read_frame::<FromWorker>(&mut r).expect("clean end").is_none());
        let mut cut = &buf[..6];
        assert!(read_frame::<FromWorker>(&mut cut).is_err(), "a frame cut short is an error, not an end");
    }

    #[test]
    fn refusals_keep_their_status_field_and_engine_code() {
        let e = ApiError::bad_request("too long").with_param("messages").with_code("context_length_exceeded");
        let back: ApiError = WireError::from(e.clone()).into();
        assert_eq!(back, e);
    }
}
