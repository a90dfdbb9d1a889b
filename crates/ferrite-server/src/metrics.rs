//! Server metrics and their Prometheus text (`/metrics`): HTTP requests by endpoint and
//! status (counted by the `count_requests` middleware), TTFT / TPOT / end-to-end latency
//! histograms (recorded by `Generation`), prompt and generated token counters, and the
//! engine's gauges (running, waiting, KV blocks, prefix-cache hit rate, hits, misses and bytes
//! per KV tier) read at scrape time.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use ferrite_engine::Metrics as EngineMetrics;

use crate::state::App;

const TTFT_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const TPOT_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5];
const E2E_BUCKETS: &[f64] =
    &[0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0];

/// A Prometheus histogram with fixed bucket bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative counts per bucket; the last one is `+Inf`.
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let at = self.bounds.partition_point(|&b| b < secs);
        self.counts[at].fetch_add(1, Relaxed);
        self.sum_micros.fetch_add(d.as_micros() as u64, Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        header(out, name, help, "histogram");
        let mut cumulative = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c.load(Relaxed);
            let le = self.bounds.get(i).map_or_else(|| "+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_sum {}", self.sum_micros.load(Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {cumulative}");
    }
}

pub struct ServerMetrics {
    /// (endpoint, status) → responses.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub ttft: Histogram,
    pub tpot: Histogram,
    pub e2e: Histogram,
    pub prompt_tokens: AtomicU64,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        ServerMetrics {
            requests: Mutex::new(BTreeMap::new()),
            ttft: Histogram::new(TTFT_BUCKETS),
            tpot: Histogram::new(TPOT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            prompt_tokens: AtomicU64::new(0),
        }
    }
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, help: &str, kind: &str, value: impl std::fmt::Display) {
    header(out, name, help, kind);
    let _ = writeln!(out, "{name} {value}");
}

impl ServerMetrics {
    pub fn count_request(&self, endpoint: &str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((endpoint.to_string(), status)).or_insert(0) += 1;
        }
    }

    /// The Prometheus text exposition of these metrics and the engine's.
    pub fn render(&self, engine: &EngineMetrics) -> String {
        let mut out = String::new();
        header(&mut out, "ferrite_http_requests_total", "HTTP responses by endpoint and status.", "counter");
        if let Ok(m) = self.requests.lock() {
            for ((endpoint, status), n) in m.iter() {
                let _ = writeln!(out, "ferrite_http_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}");
            }
        }
        self.ttft.render(&mut out, "ferrite_time_to_first_token_seconds", "Time from request to first token.");
        self.tpot.render(
            &mut out,
            "ferrite_time_per_output_token_seconds",
            "Mean time per output token after the first.",
        );
        self.e2e.render(&mut out, "ferrite_e2e_request_latency_seconds", "Time from request to its last token.");
        let load = |a: &AtomicU64| a.load(Relaxed);
        let (free, total) = (load(&engine.kv_blocks_free), load(&engine.kv_blocks_total));
        let gauges: [(&str, &str, u64); 6] = [
            ("ferrite_num_requests_running", "Sequences in the running batch.", load(&engine.running)),
            ("ferrite_num_requests_waiting", "Sequences waiting to be scheduled.", load(&engine.waiting)),
            ("ferrite_kv_blocks_used", "KV cache blocks in use.", total.saturating_sub(free)),
            ("ferrite_kv_blocks_free", "KV cache blocks free.", free),
            (
                "ferrite_kv_bytes_per_token",
                "KV cache bytes a token of context takes (summed over the pool's models).",
                load(&engine.kv_bytes_per_token),
            ),
            ("ferrite_kv_capacity_tokens", "Tokens the KV cache holds.", load(&engine.kv_capacity_tokens)),
        ];
        for (name, help, v) in gauges {
            sample(&mut out, name, help, "gauge", v);
        }
        let hit = engine.prefix_hit_rate();
        sample(
            &mut out,
            "ferrite_prefix_cache_hit_rate",
            "Fraction of looked-up prompt tokens found cached.",
            "gauge",
            hit,
        );
        let counters: [(&str, &str, u64); 8] = [
            ("ferrite_prompt_tokens_total", "Prompt tokens submitted.", load(&self.prompt_tokens)),
            ("ferrite_generation_tokens_total", "Tokens generated.", load(&engine.generated_tokens)),
            ("ferrite_preemptions_total", "Sequences preempted for KV space.", load(&engine.preemptions)),
            ("ferrite_forward_passes_total", "Engine steps that ran the model.", load(&engine.steps)),
            (
                "ferrite_asserted_tokens_total",
                "Tokens appended by fill without sampling.",
                load(&engine.asserted_tokens),
            ),
            (
                "ferrite_overlapped_steps_total",
                "Steps queued on the device while the step before them still ran.",
                load(&engine.overlapped_steps),
            ),
            (
                "ferrite_kv_transitions_total",
                "Sequences whose KV turned quantized at their delayed start.",
                load(&engine.kv_transitions),
            ),
            (
                "ferrite_kv_converted_blocks_total",
                "Full-precision KV blocks converted into quantized ones at those transitions.",
                load(&engine.kv_converted_blocks),
            ),
        ];
        for (name, help, v) in counters {
            sample(&mut out, name, help, "counter", v);
        }
        render_tiers(&mut out, engine);
        out
    }
}

/// One metric with a sample per tier.
fn by_tier(out: &mut String, name: &str, help: &str, kind: &str, samples: &[(&str, u64)]) {
    header(out, name, help, kind);
    for (tier, v) in samples {
        let _ = writeln!(out, "{name}{{tier=\"{tier}\"}} {v}");
    }
}

/// The prefix cache's tiers (the device pool, host RAM and the SSD tier) and resumed
/// generations.
fn render_tiers(out: &mut String, e: &EngineMetrics) {
    let load = |a: &AtomicU64| a.load(Relaxed);
    let (queried, hit) = (load(&e.prefix_queried_tokens), load(&e.prefix_hit_tokens));
    let (host_hit, ssd_hit) = (load(&e.host_hit_tokens), load(&e.ssd_hit_tokens));
    let device_hit = hit.saturating_sub(ssd_hit + host_hit);
    let hits = [("device", device_hit), ("host", host_hit), ("ssd", ssd_hit)];
    by_tier(out, "ferrite_prefix_cache_hit_tokens_total", "Prompt tokens served from each tier.", "counter", &hits);
    let misses = [
        ("device", queried.saturating_sub(device_hit)),
        ("host", load(&e.host_lookup_tokens).saturating_sub(host_hit)),
        ("ssd", load(&e.ssd_lookup_tokens).saturating_sub(ssd_hit)),
    ];
    let help = "Prompt tokens looked up in each tier and not found there.";
    by_tier(out, "ferrite_prefix_cache_miss_tokens_total", help, "counter", &misses);
    let io = [
        ("host_read", load(&e.host_read_bytes)),
        ("host_written", load(&e.host_written_bytes)),
        ("ssd_read", load(&e.ssd_read_bytes)),
        ("ssd_written", load(&e.ssd_written_bytes)),
    ];
    let help = "Bytes read from (restored) and written to the host-RAM and SSD tiers.";
    by_tier(out, "ferrite_prefix_cache_bytes_total", help, "counter", &io);
    let gauges: [(&str, &str, u64); 7] = [
        ("ferrite_prefix_cache_host_bytes", "Bytes of KV blocks in the host-RAM tier.", load(&e.host_bytes)),
        ("ferrite_prefix_cache_host_blocks", "KV blocks in the host-RAM tier.", load(&e.host_blocks)),
        ("ferrite_prefix_cache_host_capacity_bytes", "The host-RAM tier's budget.", load(&e.host_capacity_bytes)),
        ("ferrite_prefix_cache_ssd_bytes", "Bytes of files in the SSD tier's directory.", load(&e.ssd_bytes)),
        ("ferrite_prefix_cache_ssd_files", "Files in the SSD tier's directory.", load(&e.ssd_files)),
        ("ferrite_prefix_cache_ssd_write_queue_depth", "Stores waiting for the writer.", load(&e.ssd_write_queue_jobs)),
        ("ferrite_prefix_cache_ssd_write_queue_bytes", "Bytes waiting for the writer.", load(&e.ssd_write_queue_bytes)),
    ];
    for (name, help, v) in gauges {
        sample(out, name, help, "gauge", v);
    }
    let counters: [(&str, &str, u64); 7] = [
        (
            "ferrite_prefix_cache_host_evictions_total",
            "KV blocks evicted (LRU) from the host-RAM tier.",
            load(&e.host_evicted_blocks),
        ),
        (
            "ferrite_prefix_cache_host_failed_saves_total",
            "Evicted KV blocks the host-RAM tier could not copy in (dropped).",
            load(&e.host_failed_saves),
        ),
        (
            "ferrite_prefix_cache_ssd_evictions_total",
            "Files evicted (LRU) from the SSD tier.",
            load(&e.ssd_evicted_files),
        ),
        (
            "ferrite_prefix_cache_ssd_corrupt_files_total",
            "Corrupt, truncated or replaced SSD tier files found and deleted.",
            load(&e.ssd_corrupt_files),
        ),
        (
            "ferrite_prefix_cache_ssd_dropped_writes_total",
            "Stores dropped because the writer was behind.",
            load(&e.ssd_writes_dropped),
        ),
        (
            "ferrite_resumed_generations_total",
            "Generations continued from an interrupted run.",
            load(&e.resumed_generations),
        ),
        ("ferrite_resumed_tokens_total", "Tokens replayed from interrupted runs.", load(&e.resumed_tokens)),
    ];
    for (name, help, v) in counters {
        sample(out, name, help, "counter", v);
    }
}

/// Middleware: count every response by its route (not its raw path, so labels stay
/// bounded) and status.
pub async fn count_requests(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let endpoint = req.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str()).to_string();
    let resp = next.run(req).await;
    app.metrics.count_request(&endpoint, resp.status().as_u16());
    resp
}
