//! `ferrite bench serve`: a load generator for any OpenAI-compatible server (ferrite,
//! llama.cpp's llama-server, vLLM). Each request is a streaming `/v1/completions` call with a
//! text prompt of about `--input-len` tokens (random common words, fitted exactly with the
//! server's `/tokenize` where it has one) and `max_tokens` = `--output-len` with `ignore_eos`.
//! Requests go out from `--concurrency` clients or at Poisson arrivals of `--request-rate`
//! per second; each one's SSE chunks are timed to give TTFT, TPOT, ITL and end-to-end latency
//! percentiles, request and token throughput, and the error count.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{ArgGroup, Args};
use serde_json::{json, Value};

use crate::bench::{pct, read_prompts_file, Lcg};

#[derive(Args)]
#[command(group(ArgGroup::new("load").required(true).args(["concurrency", "request_rate"])))]
pub struct ServeBenchArgs {
    /// The server's base URL, e.g. http://127.0.0.1:8080 (plain HTTP).
    #[arg(long)]
    pub url: String,
    /// The model name to send (default: the first one `/v1/models` lists).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, default_value_t = 100)]
    pub num_requests: usize,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Generated tokens per request (`max_tokens`, EOS ignored).
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// Requests in flight at once.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Requests per second, arriving as a Poisson process (no cap on those in flight).
    #[arg(long)]
    pub request_rate: Option<f64>,
    /// Draw each length uniformly from [len × (1 − r), len × (1 + r)].
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// JSONL prompts ({"prompt": "...", "max_tokens": N}) instead of random words.
    #[arg(long)]
    pub prompts_file: Option<PathBuf>,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Seconds one request may take before it counts as an error.
    #[arg(long, default_value_t = 600)]
    pub request_timeout: u64,
    /// Seed of the prompts and arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Common English words, space-separated: random prompts made of them tokenize to about one
/// token a word.
const WORDS: &str = "the of and to in is was for that with as on by at from his it an were are which this also be \
    has or had first one their its new after but who not they have her she two been other when there all during into \
    school time may years more most only over city some world would where later up such used many can state about \
    national out known university united then made three while family river long house water music game line light \
    small great old day year work part place people number name team war book film road north south early high life \
    second group";

/// One request to send: the prompt, its token count (as best known) and `max_tokens`.
struct Job {
    prompt: String,
    prompt_tokens: usize,
    max_tokens: usize,
}

/// What one request measured.
#[derive(Default)]
struct Outcome {
    error: Option<String>,
    prompt_tokens: usize,
    output_tokens: usize,
    ttft: f64,
    e2e: f64,
    /// Gaps between successive content chunks (s).
    itl: Vec<f64>,
}

struct Client {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
    /// Which `/tokenize` body form the server took last (0: vLLM/ferrite, 1: llama.cpp).
    tokenize_form: AtomicUsize,
}

impl Client {
    fn post(&self, path: &str, body: &Value) -> reqwest::RequestBuilder {
        let req = self.http.post(format!("{}{path}", self.base)).json(body);
        match &self.api_key {
            Some(k) => req.bearer_auth(k),
            None => req,
        }
    }

    /// The first model `/v1/models` lists.
    async fn first_model(&self) -> Result<String> {
        let mut req = self.http.get(format!("{}/v1/models", self.base));
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await.with_context(|| format!("cannot reach {}", self.base))?;
        let status = resp.status();
        let body: Value = resp.json().await.context("/v1/models: not JSON")?;
        if !status.is_success() {
            bail!("/v1/models answered {status}: {body}");
        }
        body["data"][0]["id"].as_str().map(str::to_string).context("/v1/models lists no model; pass --model")
    }

    /// The token count of `text` from the server's `/tokenize` (vLLM/ferrite `prompt` or
    /// llama.cpp `content` form), or None when it has none.
    async fn count_tokens(&self, model: &str, text: &str) -> Option<usize> {
        let first = self.tokenize_form.load(Relaxed);
        for form in [first, 1 - first] {
            let body = match form {
                0 => json!({"model": model, "prompt": text}),
                _ => json!({"content": text, "add_special": true}),
            };
            let Ok(resp) = self.post("/tokenize", &body).send().await else { return None };
            if !resp.status().is_success() {
                continue;
            }
            if let Some(n) = resp.json::<Value>().await.ok().and_then(|v| v["tokens"].as_array().map(Vec::len)) {
                self.tokenize_form.store(form, Relaxed);
                return Some(n);
            }
        }
        None
    }
}

/// `n` words of the seeded random word stream `seed`.
fn words(seed: u64, n: usize) -> String {
    let vocab: Vec<&str> = WORDS.split_whitespace().collect();
    let mut rng = Lcg(seed);
    let mut s = String::with_capacity(n * 6);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(vocab[rng.next(vocab.len() as u64) as usize]);
    }
    s
}

/// A random-word prompt of `target` tokens: fitted with `/tokenize` when the server has it
/// (`exact` stays true), else one word a token.
async fn word_prompt(client: &Client, model: &str, seed: u64, target: usize, exact: &mut bool) -> (String, usize) {
    let guess = || (words(seed, target), target);
    if !*exact {
        return guess();
    }
    // Word counts map to token counts almost one to one; a few rounds of rescaling land on it.
    let (mut n, mut best) = (target, None::<(String, usize)>);
    for _ in 0..6 {
        let text = words(seed, n);
        let Some(count) = client.count_tokens(model, &text).await else {
            *exact = false;
            return guess();
        };
        if best.as_ref().is_none_or(|b| count.abs_diff(target) < b.1.abs_diff(target)) {
            best = Some((text, count));
        }
        let next = if count > target { n - (count - target).min(n - 1) } else { n + (target - count) };
        if count == target || next == n {
            break;
        }
        n = next;
    }
    best.unwrap_or_else(guess)
}

/// The requests of the run, in order.
async fn jobs(a: &ServeBenchArgs, client: &Client, model: &str) -> Result<Vec<Job>> {
    if let Some(file) = &a.prompts_file {
        let prompts = read_prompts_file(file, a.output_len)?;
        let mut counted = Vec::with_capacity(prompts.len());
        for (prompt, max_tokens) in prompts {
            let prompt_tokens = match client.count_tokens(model, &prompt).await {
                Some(n) => n,
                None => prompt.split_whitespace().count(),
            };
            counted.push((prompt, prompt_tokens, max_tokens));
        }
        return Ok((0..a.num_requests)
            .map(|i| {
                let (prompt, prompt_tokens, max_tokens) = counted[i % counted.len()].clone();
                Job { prompt, prompt_tokens, max_tokens }
            })
            .collect());
    }
    let mut rng = Lcg(a.seed ^ 0xB3E7_5E4F);
    let mut exact = true;
    let mut out = Vec::with_capacity(a.num_requests);
    for i in 0..a.num_requests {
        let (input, max_tokens) =
            (rng.around(a.input_len, a.random_range_ratio), rng.around(a.output_len, a.random_range_ratio));
        let seed = a.seed.wrapping_mul(1_000_003).wrapping_add(i as u64 + 1);
        let (prompt, prompt_tokens) = word_prompt(client, model, seed, input, &mut exact).await;
        out.push(Job { prompt, prompt_tokens, max_tokens });
    }
    if !exact {
        eprintln!("note: the server has no /tokenize; prompts are sized at one token a word");
    }
    Ok(out)
}

/// Send one streaming completion and time its chunks.
async fn run_one(client: &Client, model: &str, job: &Job, timeout: Duration) -> Outcome {
    let mut o = Outcome { prompt_tokens: job.prompt_tokens, ..Outcome::default() };
    let t0 = Instant::now();
    match tokio::time::timeout(timeout, stream_one(client, model, job, t0, &mut o)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => o.error = Some(format!("{e:#}")),
        Err(_) => o.error = Some(format!("no end after {} s", timeout.as_secs())),
    }
    o.e2e = t0.elapsed().as_secs_f64();
    o
}

async fn stream_one(client: &Client, model: &str, job: &Job, t0: Instant, o: &mut Outcome) -> Result<()> {
    let body = json!({
        "model": model, "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0.0,
        "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
    });
    let mut resp = client.post("/v1/completions", &body).send().await.context("sending")?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        bail!("HTTP {status}: {}", text.chars().take(300).collect::<String>());
    }
    let (mut buf, mut last, mut chunks, mut usage_tokens) = (Vec::<u8>::new(), None::<Instant>, 0usize, None);
    let mut done = false;
    while let Some(bytes) = resp.chunk().await.context("reading the stream")? {
        let now = Instant::now();
        buf.extend_from_slice(&bytes);
        // Complete events end in a blank line; a trailing partial one waits for more bytes.
        while let Some(end) = find_event_end(&buf) {
            let event: Vec<u8> = buf.drain(..end).collect();
            for line in event.split(|&b| b == b'\n') {
                let Some(data) = line.strip_prefix(b"data:") else { continue };
                let data = data.trim_ascii();
                if data == b"[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_slice(data).context("a stream event is not JSON")?;
                if let Some(e) = v.get("error") {
                    bail!("error event: {e}");
                }
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    usage_tokens = Some(n as usize);
                    if let Some(p) = v["usage"]["prompt_tokens"].as_u64() {
                        o.prompt_tokens = p as usize;
                    }
                }
                let text = v["choices"][0]["text"].as_str().or_else(|| v["content"].as_str()).unwrap_or("");
                if !text.is_empty() {
                    match last {
                        None => o.ttft = (now - t0).as_secs_f64(),
                        Some(prev) => o.itl.push((now - prev).as_secs_f64()),
                    }
                    last = Some(now);
                    chunks += 1;
                }
            }
        }
    }
    if !done {
        bail!("the stream ended without data: [DONE]");
    }
    if last.is_none() {
        bail!("no tokens came back");
    }
    o.output_tokens = usage_tokens.unwrap_or(chunks);
    Ok(())
}

/// The byte offset just past the first complete SSE event (`\n\n` or `\r\n\r\n`) in `buf`.
fn find_event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Run every job: `concurrency` clients, or Poisson arrivals at `rate` per second.
async fn drive(client: Arc<Client>, model: Arc<str>, jobs: Vec<Job>, a: &ServeBenchArgs) -> Result<Vec<Outcome>> {
    let timeout = Duration::from_secs(a.request_timeout);
    let jobs = Arc::new(jobs);
    let mut tasks = tokio::task::JoinSet::new();
    if let Some(c) = a.concurrency {
        let next = Arc::new(AtomicUsize::new(0));
        for _ in 0..c.min(jobs.len()) {
            let (client, model, jobs, next) = (client.clone(), model.clone(), jobs.clone(), next.clone());
            tasks.spawn(async move {
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Relaxed);
                    let Some(job) = jobs.get(i) else { return out };
                    out.push(run_one(&client, &model, job, timeout).await);
                }
            });
        }
    } else {
        let rate = a.request_rate.unwrap_or(1.0);
        let mut rng = Lcg(a.seed ^ 0xA771_7A15);
        let start = tokio::time::Instant::now();
        let mut at = 0.0f64;
        for i in 0..jobs.len() {
            tokio::time::sleep_until(start + Duration::from_secs_f64(at)).await;
            let (client, model, jobs) = (client.clone(), model.clone(), jobs.clone());
            tasks.spawn(async move { vec![run_one(&client, &model, &jobs[i], timeout).await] });
            // Exponential inter-arrival gaps: -ln(1 − u) / rate.
            let u = rng.next(1 << 30) as f64 / (1u64 << 30) as f64;
            at += -(1.0 - u).ln() / rate;
        }
    }
    let mut all = Vec::with_capacity(jobs.len());
    while let Some(r) = tasks.join_next().await {
        all.extend(r.context("a client task panicked")?);
    }
    Ok(all)
}

/// Sorted values in milliseconds.
fn ms(mut v: Vec<f64>) -> Vec<f64> {
    v.iter_mut().for_each(|x| *x *= 1e3);
    v.sort_by(f64::total_cmp);
    v
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

pub fn bench_serve(a: ServeBenchArgs) -> Result<()> {
    if a.num_requests == 0 || a.input_len == 0 || a.output_len == 0 || a.concurrency == Some(0) {
        bail!("--num-requests, --concurrency, --input-len and --output-len must be at least 1");
    }
    if a.request_rate.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
        bail!("--request-rate must be a positive number");
    }
    let base = a.url.trim_end_matches('/').trim_end_matches("/v1").to_string();
    if !base.starts_with("http://") {
        bail!("--url must be a plain http:// URL, got {}", a.url);
    }
    let http = reqwest::Client::builder()
        // A fresh connection per request: servers close idle keep-alive connections on their
        // own schedules (llama-server after 5 s), and a reused closed one would count as an error.
        .pool_max_idle_per_host(0)
        .tcp_nodelay(true)
        .build()
        .context("cannot build the HTTP client")?;
    let client = Arc::new(Client { http, base, api_key: a.api_key.clone(), tokenize_form: AtomicUsize::new(0) });
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("async runtime")?;
    runtime.block_on(async {
        let model: Arc<str> = match &a.model {
            Some(m) => m.as_str().into(),
            None => client.first_model().await?.into(),
        };
        let jobs = jobs(&a, &client, &model).await?;
        // One unmeasured request warms the server up and fails fast on a wrong setup.
        let warm = Job { prompt: words(a.seed ^ 0x77, 16), prompt_tokens: 16, max_tokens: 4 };
        let w = run_one(&client, &model, &warm, Duration::from_secs(a.request_timeout)).await;
        if let Some(e) = w.error {
            bail!("the warm-up request failed: {e}");
        }
        let t0 = Instant::now();
        let outcomes = drive(client.clone(), model.clone(), jobs, &a).await?;
        report(&a, &model, &outcomes, t0.elapsed().as_secs_f64());
        Ok(())
    })
}

fn report(a: &ServeBenchArgs, model: &str, outcomes: &[Outcome], wall: f64) {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
    let errors = outcomes.len() - ok.len();
    let mut seen = std::collections::BTreeSet::new();
    for e in outcomes.iter().filter_map(|o| o.error.as_deref()) {
        if seen.insert(e) && seen.len() <= 3 {
            eprintln!("request error: {e}");
        }
    }
    let out_tokens: usize = ok.iter().map(|o| o.output_tokens).sum();
    let in_tokens: usize = ok.iter().map(|o| o.prompt_tokens).sum();
    let ttft = ms(ok.iter().map(|o| o.ttft).collect());
    let e2e = ms(ok.iter().map(|o| o.e2e).collect());
    let decoding: Vec<&&Outcome> = ok.iter().filter(|o| o.output_tokens > 1).collect();
    let tpot = ms(decoding.iter().map(|o| (o.e2e - o.ttft) / (o.output_tokens - 1) as f64).collect());
    let itl = ms(ok.iter().flat_map(|o| o.itl.iter().copied()).collect());
    let mut decode_rate: Vec<f64> = tpot.iter().map(|t| 1e3 / t.max(1e-9)).collect();
    decode_rate.sort_by(f64::total_cmp);
    let stats = |name: &str, v: &[f64], out: &mut serde_json::Map<String, Value>| {
        out.insert(format!("{name}_ms_mean"), json!(mean(v)));
        for (q, label) in [(0.5, "p50"), (0.9, "p90"), (0.99, "p99")] {
            out.insert(format!("{name}_ms_{label}"), json!(pct(v, q)));
        }
    };
    let mut out = serde_json::Map::new();
    for (k, v) in [
        ("url", json!(a.url)),
        ("model", json!(model)),
        ("num_requests", json!(outcomes.len())),
        ("completed", json!(ok.len())),
        ("errors", json!(errors)),
        ("input_len", json!(a.input_len)),
        ("output_len", json!(a.output_len)),
        ("concurrency", json!(a.concurrency)),
        ("request_rate", json!(a.request_rate)),
        ("duration_s", json!(wall)),
        ("input_tokens", json!(in_tokens)),
        ("output_tokens", json!(out_tokens)),
        ("request_s", json!(ok.len() as f64 / wall)),
        ("output_tok_s", json!(out_tokens as f64 / wall)),
        ("total_tok_s", json!((in_tokens + out_tokens) as f64 / wall)),
        ("decode_tok_s_p50", json!(pct(&decode_rate, 0.5))),
    ] {
        out.insert(k.to_string(), v);
    }
    for (name, v) in [("ttft", &ttft), ("tpot", &tpot), ("itl", &itl), ("e2e", &e2e)] {
        stats(name, v, &mut out);
    }
    if a.json {
        println!("{}", Value::Object(out));
        return;
    }
    let load = match (a.concurrency, a.request_rate) {
        (Some(c), _) => format!("concurrency {c}"),
        (_, Some(r)) => format!("{r} req/s (Poisson)"),
        _ => String::new(),
    };
    println!(
        "{} at {}: {} requests of ~{} in / {} out, {load}",
        model,
        a.url,
        outcomes.len(),
        a.input_len,
        a.output_len
    );
    println!("completed {}, errors {errors}, {wall:.2} s", ok.len());
    println!(
        "throughput  {:.2} req/s, output {:.1} tok/s, total {:.1} tok/s",
        ok.len() as f64 / wall,
        out_tokens as f64 / wall,
        (in_tokens + out_tokens) as f64 / wall
    );
    println!("{:<6} {:>9} {:>9} {:>9} {:>9}   (ms)", "", "mean", "p50", "p90", "p99");
    for (name, v) in [("TTFT", &ttft), ("TPOT", &tpot), ("ITL", &itl), ("E2E", &e2e)] {
        println!("{name:<6} {:>9.1} {:>9.1} {:>9.1} {:>9.1}", mean(v), pct(v, 0.5), pct(v, 0.9), pct(v, 0.99));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_ends_at_the_first_blank_line_either_style() {
        assert_eq!(find_event_end(b"data: {}\n\ndata: x"), Some(10));
        assert_eq!(find_event_end(b"data: {}\r\n\r\n"), Some(12));
        assert_eq!(find_event_end(b"data: {}\n"), None);
    }

    #[test]
    fn word_prompts_are_deterministic_prefixes() {
        let (short, long) = (words(3, 5), words(3, 9));
        assert_eq!(short.split(' ').count(), 5);
        assert!(long.starts_with(&short));
        assert_ne!(words(4, 5), short);
    }
}
