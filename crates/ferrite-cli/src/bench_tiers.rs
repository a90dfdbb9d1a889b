//! `ferrite bench tiers`: the prefix cache's tiers measured side by side in one run — time
//! to first token of a request whose long prefix is in the device pool, in host RAM (GPU
//! models: a pool just big enough for one request, so the next prompt evicts the prefix into
//! `--host-cache-memory`), in the SSD tier (a new engine over the same directory, as after a
//! restart: once with the files dropped from the page cache, read from the disk itself, then
//! again from the page cache) and nowhere (cold); a resumed generation against the same request restarted
//! from nothing; the SSD writer's throughput; and decode speed with the writer kept busy (a
//! checkpoint every token) against no tier.
//!
//! The SSD is filled with the prefix in slices that fit the writer's queue (each waited for),
//! so a long prefix is stored whole rather than dropped by the queue's backpressure.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrite_engine::{Engine, Request, RequestParams, SamplingParams};
use serde_json::json;

use crate::bench::{pct, Lcg};
use crate::session::{EngineArgs, ModelArgs};
use ferrite_runtime::cuda::Device;

/// Bytes of KV one slice of the prefix publishes at most while filling the SSD tier (the
/// writer's queue holds 256 MiB).
const SLICE_BYTES: usize = 64 << 20;

#[derive(Args)]
pub struct TiersArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Tokens of the shared prefix.
    #[arg(long, default_value_t = 2048)]
    pub prefix_len: usize,
    /// New tokens after the prefix in each request.
    #[arg(long, default_value_t = 16)]
    pub suffix_len: usize,
    /// Tokens generated before a generation is cut off (resume), and decoded (decode speed).
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// The SSD tier's directory (default: a fresh one in the system's temporary directory,
    /// removed at the end). Put it on the disk you mean to measure.
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Time of each streamed token of one request, from submission (seconds); the stream is
/// dropped — the client gone — after `cut` tokens when given.
fn token_times(engine: &Engine, prompt: Vec<u32>, params: RequestParams, cut: Option<usize>) -> Result<Vec<f64>> {
    let t0 = Instant::now();
    let mut stream = engine.submit(Request { prompt, params })?;
    let mut times = Vec::new();
    while let Some(o) = stream.blocking_next() {
        times.extend(o.token_ids.iter().map(|_| t0.elapsed().as_secs_f64()));
        if let Some(f) = o.finished {
            if let Some(e) = f.error {
                bail!("request failed: {e}");
            }
            break;
        }
        if cut.is_some_and(|k| times.len() >= k) {
            break;
        }
    }
    if times.is_empty() {
        bail!("the engine stopped");
    }
    Ok(times)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    pct(v, 0.5)
}

/// The median of `v` (seconds), in milliseconds.
fn ms(v: &mut [f64]) -> f64 {
    median(v) * 1e3
}

/// Drop the files under `dir` from the page cache (`posix_fadvise(DONTNEED)`; the writer
/// fsynced them), so that the next reads come from the disk itself.
fn drop_from_page_cache(dir: &std::path::Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    for entry in std::fs::read_dir(dir)? {
        let f = std::fs::File::open(entry?.path())?;
        // SAFETY: `f` is an open descriptor for the call's duration; the advice changes only
        // what the kernel caches.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            bail!("posix_fadvise on {}: error {rc}", dir.display());
        }
    }
    Ok(())
}

/// Wait until the SSD writer of `engine` has written everything queued.
fn drain_writes(engine: &Engine) -> Result<()> {
    let m = engine.metrics();
    let t0 = Instant::now();
    while m.ssd_write_queue_jobs.load(Relaxed) > 0 {
        if t0.elapsed() > Duration::from_secs(600) {
            bail!("the SSD writer did not finish in 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// Put `prefix` in `engine`'s pool and SSD tier: requests for ever longer slices of it, each
/// publishing at most `slice` new tokens, each waited for on the writer.
fn fill(engine: &Engine, prefix: &[u32], slice: usize) -> Result<()> {
    let mut end = 0;
    while end < prefix.len() {
        end = (end + slice).min(prefix.len());
        token_times(engine, prefix[..end].to_vec(), one(), None)?;
        drain_writes(engine)?;
    }
    Ok(())
}

/// One greedy token.
fn one() -> RequestParams {
    RequestParams { max_tokens: Some(1), ignore_eos: true, ..Default::default() }
}

pub fn tiers(a: TiersArgs) -> Result<()> {
    if a.reps == 0 || a.prefix_len == 0 || a.suffix_len == 0 || a.gen_tokens < 2 {
        bail!("--reps, --prefix-len and --suffix-len must be at least 1, --gen-tokens at least 2");
    }
    let temp = match &a.dir {
        Some(_) => None,
        None => Some(tempfile::tempdir().context("a temporary directory for the SSD tier")?),
    };
    let dir = a.dir.clone().or_else(|| temp.as_ref().map(|t| t.path().to_path_buf())).context("no directory")?;
    let (loaded, path, threads) = a.model.load()?;
    let vocab = loaded.model.config().vocab_size;
    let len = a.prefix_len + a.suffix_len + 2 * a.gen_tokens + 8;
    // Long prompts are prefilled in chunks (a 32k-token step would size every workspace for
    // it). Every engine's pool holds four requests: a GPU's default (most of its memory)
    // would leave the engines started next to the first one too little.
    let mut base = EngineArgs {
        max_num_seqs: 4,
        max_num_batched_tokens: len.min(8192),
        max_model_len: Some(len),
        ..EngineArgs::default()
    };
    let bytes_per_token = base.start(&loaded, &path)?.limits().kv_bytes_per_token.max(1);
    base.kv_cache_memory = Some(bytes_per_token * 4 * len);
    let tiered = |checkpoint| EngineArgs {
        prefix_cache_dir: Some(dir.clone()),
        generation_checkpoint: Some(checkpoint),
        ..base.clone()
    };
    let cold_args = EngineArgs { no_prefix_cache: true, ..base.clone() };
    let greedy = |n| RequestParams { max_tokens: Some(n), ignore_eos: true, ..Default::default() };
    let cold = cold_args.start(&loaded, &path)?;
    let slice = (SLICE_BYTES / bytes_per_token).max(1);
    // Host RAM (GPU models): a pool of one request's blocks, and host memory for two.
    let gpu = loaded.device != Device::Cpu;
    let host_args = EngineArgs {
        kv_cache_memory: Some(bytes_per_token * (len + 4 * base.block_size)),
        host_cache_memory: Some(bytes_per_token * 2 * len),
        ..base.clone()
    };
    let mut rng = Lcg(0x5EED);
    let (mut pool_t, mut host_t, mut ssd_t, mut cold_t) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut disk_t = Vec::new();
    let (mut written, mut write_us, mut ssd_tokens, mut host_tokens) = (0, 0, 0, 0);
    for _ in 0..a.reps {
        let shared = rng.ids(a.prefix_len, vocab);
        let mut with_suffix = || [shared.clone(), rng.ids(a.suffix_len, vocab)].concat();
        let (second, third, fourth, fifth) = (with_suffix(), with_suffix(), with_suffix(), with_suffix());
        cold_t.push(token_times(&cold, third.clone(), one(), None)?[0]);
        let writer = tiered(16).start(&loaded, &path)?;
        fill(&writer, &shared, slice)?;
        pool_t.push(token_times(&writer, second, one(), None)?[0]);
        let m = writer.metrics().clone();
        // Dropping the engine finishes its writes: the next one starts as after a restart.
        drop(writer);
        written += m.ssd_written_bytes.load(Relaxed);
        write_us += m.ssd_write_micros.load(Relaxed);
        // The first restart reads the files from the disk itself, the second from the page
        // cache the first one filled.
        drop_from_page_cache(&dir)?;
        let restarted = tiered(16).start(&loaded, &path)?;
        disk_t.push(token_times(&restarted, fifth, one(), None)?[0]);
        drop(restarted);
        let restarted = tiered(16).start(&loaded, &path)?;
        ssd_t.push(token_times(&restarted, third, one(), None)?[0]);
        ssd_tokens += restarted.metrics().ssd_hit_tokens.load(Relaxed);
        drop(restarted);
        if gpu {
            let engine = host_args.start(&loaded, &path)?;
            token_times(&engine, shared.clone(), one(), None)?;
            // Another prompt as long takes the pool: the prefix goes to host RAM.
            token_times(&engine, rng.ids(len - 2 * a.gen_tokens, vocab), one(), None)?;
            host_t.push(token_times(&engine, fourth, one(), None)?[0]);
            host_tokens += engine.metrics().host_hit_tokens.load(Relaxed);
        }
    }
    let host_ms = (!host_t.is_empty()).then(|| ms(&mut host_t));
    // A seeded generation cut off by its client after `gen_tokens`, then retried: the retry
    // replays what was generated and continues; the restarted run computes all of it again.
    let k = a.gen_tokens;
    let sampled = RequestParams {
        max_tokens: Some(2 * k),
        ignore_eos: true,
        sampling: SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, seed: 7, ..Default::default() },
        ..Default::default()
    };
    let prompt = [rng.ids(a.prefix_len, vocab), rng.ids(a.suffix_len, vocab)].concat();
    let engine = tiered(16).start(&loaded, &path)?;
    token_times(&engine, prompt.clone(), sampled.clone(), Some(k))?;
    let resumed = token_times(&engine, prompt.clone(), sampled.clone(), None)?;
    let replayed = engine.metrics().resumed_tokens.load(Relaxed) as usize;
    drop(engine);
    let restarted = token_times(&cold, prompt.clone(), sampled, None)?;
    let at = replayed.min(resumed.len() - 1);
    // Decode speed: no tier (the writer idle) against a checkpoint every token (the writer
    // busy with a record and its fsync per token, and a block every block_size tokens),
    // alternated `reps` times so that drift on a shared machine falls on both; medians.
    let decode = |args: &EngineArgs| -> Result<f64> {
        let engine = args.start(&loaded, &path)?;
        let t = token_times(&engine, rng_prompt(a.suffix_len, vocab), greedy(4 * k), None)?;
        Ok((t.len() - 1) as f64 / (t[t.len() - 1] - t[0]))
    };
    let (mut idle, mut busy) = (Vec::new(), Vec::new());
    for _ in 0..a.reps {
        idle.push(decode(&base)?);
        busy.push(decode(&tiered(1))?);
    }
    let (idle, busy) = (median(&mut idle), median(&mut busy));
    let (pool_ms, ssd_ms, cold_ms) = (ms(&mut pool_t), ms(&mut ssd_t), ms(&mut cold_t));
    let disk_ms = ms(&mut disk_t);
    let mb_s = if write_us > 0 { written as f64 / write_us as f64 } else { 0.0 };
    if a.json {
        let out = json!({
            "model": path.display().to_string(), "threads": threads, "prefix_len": a.prefix_len,
            "suffix_len": a.suffix_len, "reps": a.reps,
            "ttft_ms_pool": pool_ms, "ttft_ms_host": host_ms, "ttft_ms_ssd": ssd_ms, "ttft_ms_ssd_disk": disk_ms, "ttft_ms_cold": cold_ms,
            "host_hit_tokens_per_rep": host_tokens / a.reps as u64, "ssd_hit_tokens_per_rep": ssd_tokens / a.reps as u64,
            "resume": {"cut_after": k, "replayed": replayed, "resumed_first_token_ms": resumed[0] * 1e3,
                       "resumed_first_new_token_ms": resumed[at] * 1e3, "restarted_first_token_ms": restarted[0] * 1e3,
                       "restarted_token_ms_at_same_point": restarted[at] * 1e3},
            "ssd_write_mb_per_s": mb_s, "ssd_written_bytes": written,
            "decode_tok_s_writer_idle": idle, "decode_tok_s_writer_busy": busy, "decode_busy_over_idle": busy / idle,
        });
        println!("{out}");
    } else {
        println!(
            "model {} ({threads} threads): {} prefix + {} new tokens, medians of {}",
            path.display(),
            a.prefix_len,
            a.suffix_len,
            a.reps
        );
        let host = match host_ms {
            Some(t) => format!("{t:.1} ms ({} tokens restored)", host_tokens / a.reps as u64),
            None => "n/a (the CPU pool is host RAM)".into(),
        };
        println!(
            "TTFT pool {pool_ms:.1} ms | host RAM {host} | SSD {ssd_ms:.1} ms from the page cache, {disk_ms:.1} ms from the disk ({} tokens restored) | cold {cold_ms:.1} ms",
            ssd_tokens / a.reps as u64
        );
        println!(
            "resume after a cut at {k} tokens ({replayed} replayed): first token {:.1} ms, first new token {:.1} ms | restarted: first token {:.1} ms, token {} at {:.1} ms",
            resumed[0] * 1e3,
            resumed[at] * 1e3,
            restarted[0] * 1e3,
            at + 1,
            restarted[at] * 1e3
        );
        println!("SSD writes {:.1} MB in {:.0} ms: {mb_s:.0} MB/s", written as f64 / 1e6, write_us as f64 / 1e3);
        println!(
            "decode {idle:.1} tok/s writer idle, {busy:.1} tok/s writer busy ({:+.1} %)",
            (busy / idle - 1.0) * 100.0
        );
    }
    Ok(())
}

/// A short random prompt (decode speed is measured after it).
fn rng_prompt(len: usize, vocab: usize) -> Vec<u32> {
    Lcg(0xDEC0DE).ids(len, vocab)
}
