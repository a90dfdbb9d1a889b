//! The prefix cache's SSD tier and resumable generations through the server: a server
//! restarted on the same directory serves a long prompt's prefix from disk (usage and
//! `/metrics` say so) with the same answer; a stream its client dropped is continued by an
//! identical retry, which reports the replayed tokens and gives the uninterrupted text.

use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;

use ferrite_engine::kv::disk::DiskConfig;
use ferrite_engine::{Engine, EngineConfig};
use ferrite_server::{App, ModelInfo, ServerConfig};
use serde_json::{json, Value};

use crate::common::*;

fn tiered_app(dir: &Path) -> App {
    let loaded = smollm2();
    let cfg = EngineConfig {
        max_model_len: Some(1024),
        max_num_seqs: 8,
        disk_cache: Some(DiskConfig::new(dir.to_path_buf(), 1 << 30)),
        generation_checkpoint: Some(8),
        ..EngineConfig::default()
    };
    let engine =
        Engine::start(loaded.model.clone(), loaded.tokenizer.clone(), loaded.eos_token_ids(), &cfg).expect("engine");
    App::new(engine, ModelInfo::new(loaded, "smollm2".into(), vec![]), ServerConfig::default())
}

fn metric(text: &str, line_start: &str) -> u64 {
    let line = text.lines().find(|l| l.starts_with(line_start)).unwrap_or_else(|| panic!("{line_start} in /metrics"));
    line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("a number")
}

#[tokio::test]
async fn a_restarted_server_serves_the_prefix_from_disk_with_the_same_answer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let system = "You are a careful assistant who answers in short plain sentences. ".repeat(24);
    let body = json!({
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Name three colours."}],
        "max_tokens": 16, "temperature": 0,
    });
    let first = start(tiered_app(dir.path()));
    let (status, a) = post(&first.at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{a}");
    assert!(a["usage"]["prompt_tokens"].as_u64().expect("prompt tokens") > 256);
    first.shutdown().await;
    // Stopping the engine finishes its writes.
    drop(first);
    let second = start(tiered_app(dir.path()));
    let (status, b) = post(&second.at("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["choices"][0]["message"]["content"], a["choices"][0]["message"]["content"]);
    let ssd = b["usage"]["cache"]["ssd_tokens"].as_u64().expect("usage.cache.ssd_tokens");
    assert!(ssd >= 256, "{}", b["usage"]);
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(ssd));
    let text = client().get(second.at("/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert_eq!(metric(&text, "ferrite_prefix_cache_hit_tokens_total{tier=\"ssd\"}"), ssd);
    assert_eq!(metric(&text, "ferrite_prefix_cache_ssd_corrupt_files_total"), 0);
    assert!(metric(&text, "ferrite_prefix_cache_ssd_files") > 0);
}

/// The text and usage of a streamed completion.
fn streamed(events: &[Value]) -> (String, Value) {
    let text = events.iter().filter_map(|e| e["choices"][0]["text"].as_str()).collect();
    let usage = events.iter().rev().find(|e| e["usage"].is_object()).map(|e| e["usage"].clone()).expect("usage");
    (text, usage)
}

#[tokio::test]
async fn a_stream_cut_by_its_client_is_continued_by_an_identical_retry() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(tiered_app(dir.path()));
    let url = server.at("/v1/completions");
    // Long enough that the client's drop lands mid-generation however busy the machine is (a
    // generation that ends first leaves no record, and the retry would replay nothing).
    let body = json!({
        "prompt": "The history of the printing press begins", "max_tokens": 400, "ignore_eos": true,
        "temperature": 0, "stream": true, "stream_options": {"include_usage": true},
    });
    let mut cut = client().post(&url).json(&body).send().await.expect("request");
    for _ in 0..6 {
        assert!(cut.chunk().await.expect("read").is_some());
    }
    drop(cut);
    let m = served(&server).await.engine.metrics().clone();
    while m.running.load(Relaxed) + m.waiting.load(Relaxed) > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let (resumed, usage) = streamed(&post_stream(&url, &body).await);
    let replayed = usage["cache"]["resumed_tokens"].as_u64().expect("usage.cache.resumed_tokens");
    assert!(replayed > 0, "{usage}");
    assert_eq!(m.resumed_tokens.load(Relaxed), replayed);
    // The retry finished, so its record is gone: the same request again runs afresh (its
    // prompt from the prefix cache) and gives the same text.
    let (again, usage) = streamed(&post_stream(&url, &body).await);
    assert_eq!(usage["cache"]["resumed_tokens"].as_u64().unwrap_or(0), 0, "{usage}");
    assert_eq!(resumed, again);
}
