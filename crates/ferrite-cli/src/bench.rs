//! `ferrite bench`: `decode` measures one sequence's prompt and decode speed the way
//! llama-bench does (random prompt ids, a fixed number of generated tokens, EOS ignored) —
//! with `--json-schema`, also constrained to a JSON schema, side by side with unconstrained;
//! `throughput` drives many concurrent requests through the engine and reports output and
//! total tokens per second with TTFT and TPOT percentiles (with `--lora N`, against N
//! synthetic adapters, in `bench_lora`); `tiers` (in `bench_tiers`) the
//! prefix cache's tiers and resumed generations; `serve` (in `bench_serve`) drives
//! an OpenAI-compatible server over HTTP; `switch` and `respawn` (in `bench_pool`) time a
//! pool's model switch and an isolated engine's restart; `embed` (in `bench_embed`) an
//! embedding model's embeddings per second. Each can print one JSON object.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use ferrite_engine::{Constraint, Engine, Request, RequestParams, SamplingParams};
use serde_json::{json, Value};

use crate::session::{EngineArgs, KvArgs, ModelArgs, SpecArgs};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Single-sequence prompt and decode tokens per second.
    Decode(DecodeArgs),
    /// Aggregate throughput and latency of many concurrent requests.
    Throughput(ThroughputArgs),
    /// Time to first token of a request whose long prefix a finished request left in the
    /// prefix cache, against the same request cold.
    Prefix(PrefixArgs),
    /// Time to first token with a long prefix in the device pool, in host RAM (GPU), in the
    /// SSD tier (after a restart) and cold; a resumed generation against a restarted one; SSD write throughput;
    /// decode speed with the SSD writer busy against idle.
    Tiers(crate::bench_tiers::TiersArgs),
    /// Load-test an OpenAI-compatible server (ferrite, llama-server, vLLM) over HTTP with
    /// streaming /v1/completions: TTFT, TPOT, ITL and latency percentiles, throughput.
    Serve(crate::bench_serve::ServeBenchArgs),
    /// Model switch time of a pool on the CPU: unload one model, load the other, each way.
    Switch(crate::bench_pool::SwitchArgs),
    /// Restart time of an isolated engine (`serve --isolate`) after a kill -9.
    Respawn(crate::bench_pool::RespawnArgs),
    /// Embeddings per second of an embedding model at given batch sizes.
    Embed(crate::bench_embed::EmbedArgs),
}

#[derive(Args)]
pub struct PrefixArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, default_value_t = 1000)]
    pub prefix_len: usize,
    #[arg(long, default_value_t = 24)]
    pub suffix_len: usize,
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length, i.e. the context decode starts from (8192, 32768, 131072 for long
    /// contexts).
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Prefill the prompt in chunks of at most this many tokens (default: the whole prompt in
    /// one step); bounds the step workspace of a long context.
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// A text file sent as one user message through the chat template instead of random
    /// prompt ids; generation then stops at the end of the answer (or --gen-tokens).
    #[arg(long)]
    pub prompt_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    /// Also decode constrained to this JSON schema (a file), and report the speed ratio.
    #[arg(long)]
    pub json_schema: Option<std::path::PathBuf>,
    /// Sample at this temperature (seeded) instead of greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus cut of the sampled decode.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct ThroughputArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, default_value_t = 64)]
    pub num_requests: usize,
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Draw each length uniformly from [len × (1 − r), len × (1 + r)].
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// JSONL prompts ({"prompt": "...", "max_tokens": N}) instead of random ids.
    #[arg(long)]
    pub prompts_file: Option<std::path::PathBuf>,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
    /// LoRA adapters (NAME=PATH, PEFT directories) the requests run through, in turn.
    #[arg(long, value_name = "NAME=PATH", num_args = 1..)]
    pub lora_modules: Vec<String>,
    /// Replace the model's compute by instant greedy picks (`no_compute.rs`): what is left
    /// is the engine's own time per step (greedy requests only).
    #[arg(long)]
    pub no_compute: bool,
    /// Run the workload on the base model, then spread over N synthetic random LoRA adapters
    /// (rank --lora-rank, all seven projections of every layer), and report the ratio.
    #[arg(long, value_name = "N")]
    pub lora: Option<usize>,
    /// Rank of the synthetic adapters of --lora.
    #[arg(long, default_value_t = 16)]
    pub lora_rank: usize,
}

pub fn bench(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Decode(a) => decode(a),
        BenchCommand::Throughput(a) => throughput(a),
        BenchCommand::Prefix(a) => prefix(a),
        BenchCommand::Tiers(a) => crate::bench_tiers::tiers(a),
        BenchCommand::Serve(a) => crate::bench_serve::bench_serve(a),
        BenchCommand::Switch(a) => crate::bench_pool::switch(a),
        BenchCommand::Respawn(a) => crate::bench_pool::respawn(a),
        BenchCommand::Embed(a) => crate::bench_embed::embed(a),
    }
}

/// A deterministic pseudo-random stream (an LCG), for prompt ids and lengths.
pub(crate) struct Lcg(pub(crate) u64);

impl Lcg {
    pub(crate) fn next(&mut self, below: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % below.max(1)
    }
    pub(crate) fn ids(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.next(vocab as u64) as u32).collect()
    }
    /// A length drawn uniformly from [base × (1 − ratio), base × (1 + ratio)], at least 1.
    pub(crate) fn around(&mut self, base: usize, ratio: f64) -> usize {
        let spread = (base as f64 * ratio) as u64;
        (base as u64 - spread.min(base as u64 - 1) + self.next(2 * spread + 1)) as usize
    }
}

/// The prompts of a JSONL file (`{"prompt": "...", "max_tokens": N}` a line), each with its
/// `max_tokens` or `default_max`.
pub(crate) fn read_prompts_file(file: &std::path::Path, default_max: usize) -> Result<Vec<(String, usize)>> {
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).with_context(|| format!("{} line {}", file.display(), i + 1))?;
        let prompt =
            v["prompt"].as_str().with_context(|| format!("{} line {}: no \"prompt\" string", file.display(), i + 1))?;
        out.push((prompt.to_string(), v["max_tokens"].as_u64().map_or(default_max, |m| m as usize)));
    }
    if out.is_empty() {
        bail!("{} holds no prompts", file.display());
    }
    Ok(out)
}

/// The value at quantile `q` of sorted `v` (nearest rank).
pub(crate) fn pct(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

/// One request through `engine` (end tokens ignored unless `stop_at_eos`): (ttft s, tpot s,
/// output tokens).
fn timed_request(engine: &Engine, prompt: Vec<u32>, max_tokens: usize, stop_at_eos: bool) -> Result<(f64, f64, usize)> {
    timed_constrained(engine, prompt, max_tokens, stop_at_eos, None, SamplingParams::default(), None)
}

/// `timed_request` under an output constraint (which may end it before `max_tokens`), with
/// `sampling`, through the LoRA adapter `adapter` if given.
fn timed_constrained(
    engine: &Engine,
    prompt: Vec<u32>,
    max_tokens: usize,
    stop_at_eos: bool,
    constraint: Option<Constraint>,
    sampling: SamplingParams,
    adapter: Option<String>,
) -> Result<(f64, f64, usize)> {
    let params = RequestParams {
        sampling,
        max_tokens: Some(max_tokens),
        ignore_eos: !stop_at_eos,
        constraint,
        adapter,
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut stream = engine.submit(Request { prompt, params })?;
    let (mut first, mut n) = (None, 0);
    while let Some(o) = stream.blocking_next() {
        first.get_or_insert_with(Instant::now);
        n += o.token_ids.len();
        if let Some(f) = o.finished {
            if let Some(e) = f.error {
                bail!("request failed: {e}");
            }
            break;
        }
    }
    let first = first.context("the engine stopped")?;
    let ttft = (first - t0).as_secs_f64();
    let tpot = if n > 1 { first.elapsed().as_secs_f64() / (n - 1) as f64 } else { 0.0 };
    Ok((ttft, tpot, n))
}

fn decode(a: DecodeArgs) -> Result<()> {
    if a.reps == 0 || a.prompt_tokens == 0 || a.gen_tokens == 0 {
        bail!("--reps, --prompt-tokens and --gen-tokens must be at least 1");
    }
    let (loaded, path, threads) = a.model.load()?;
    let vocab = loaded.model.config().vocab_size;
    let prompt = match &a.prompt_file {
        Some(file) => {
            let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
            let tmpl = loaded.chat_template.as_ref().context("--prompt-file needs a model with a chat template")?;
            let tok = loaded.tokenizer.as_ref().context("--prompt-file needs a model with a tokenizer")?;
            let messages = [json!({"role": "user", "content": text})];
            let rendered = tmpl.render(&ferrite_models::chat_template::ChatRenderRequest::new(&messages))?;
            tok.encode(&rendered, false)?
        }
        None => Lcg(0x2545_F491_4F6C_DD1D).ids(a.prompt_tokens, vocab),
    };
    let prompt_tokens = prompt.len();
    let engine_args = EngineArgs {
        max_num_seqs: 1,
        max_num_batched_tokens: a.prefill_chunk.unwrap_or(prompt_tokens).clamp(1, prompt_tokens),
        max_model_len: Some(prompt_tokens + a.gen_tokens + 1),
        no_prefix_cache: true,
        spec: a.spec.clone(),
        kv: a.kv.clone(),
        ..EngineArgs::default()
    };
    let engine = engine_args.start(&loaded, &path)?;
    let ready_ms = crate::STARTED.get().map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3);
    let device = crate::session::device_report(&loaded, threads);
    let schema = match &a.json_schema {
        Some(file) => {
            let text = std::fs::read_to_string(file).with_context(|| format!("read {}", file.display()))?;
            let schema = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", file.display()))?;
            Some(Constraint::JsonSchema(schema))
        }
        None => None,
    };
    let (mut pp, mut tg, mut tg_json, mut json_tokens, mut generated) = (Vec::new(), Vec::new(), Vec::new(), 0, 0);
    // One warm-up run (pages in the weights), then the measured repetitions; constrained and
    // free runs alternate, so both see the same machine load.
    let sampling = SamplingParams { temperature: a.temperature, top_p: a.top_p, seed: 7, ..Default::default() };
    sampling.validate(vocab)?;
    for rep in 0..=a.reps {
        let stop = a.prompt_file.is_some();
        let (ttft, tpot, n) =
            timed_constrained(&engine, prompt.clone(), a.gen_tokens, stop, None, sampling.clone(), None)?;
        if rep > 0 {
            pp.push(prompt_tokens as f64 / ttft);
            tg.push(1.0 / tpot.max(1e-9));
            generated = n;
        }
        if let Some(c) = &schema {
            let constraint = Some(c.clone());
            let (_, tpot, n) =
                timed_constrained(&engine, prompt.clone(), a.gen_tokens, false, constraint, sampling.clone(), None)?;
            if rep > 0 {
                tg_json.push(1.0 / tpot.max(1e-9));
                json_tokens = n;
            }
        }
    }
    let m = engine.metrics();
    let (proposed, accepted) =
        (m.verify_proposed_tokens.load(Ordering::Relaxed), m.verify_accepted_tokens.load(Ordering::Relaxed));
    let acceptance = if proposed > 0 { accepted as f64 / proposed as f64 } else { 0.0 };
    let steps = m.steps.load(Ordering::Relaxed) as f64 / (a.reps + 1) as f64;
    pp.sort_by(f64::total_cmp);
    tg.sort_by(f64::total_cmp);
    tg_json.sort_by(f64::total_cmp);
    let (pmed, dmed) = (pct(&pp, 0.5), pct(&tg, 0.5));
    let jmed = (!tg_json.is_empty()).then(|| pct(&tg_json, 0.5));
    if a.json {
        let out = json!({
            "model": path.display().to_string(), "threads": threads, "device": device,
            "prompt_tokens": prompt_tokens, "gen_tokens": generated, "reps": a.reps,
            "temperature": a.temperature, "top_p": a.top_p,
            "spec": a.spec.spec, "draft_model": a.spec.draft_model, "num_draft_tokens": a.spec.num_draft_tokens,
            "fill": format!("{:?}", a.spec.fill_mode()).to_lowercase(),
            "acceptance": acceptance, "proposed_tokens": proposed, "accepted_tokens": accepted,
            "forward_passes_per_run": steps, "draft_forwards": m.draft_forwards.load(Ordering::Relaxed),
            "load_ms": loaded.load_secs * 1e3, "ready_ms": ready_ms,
            "weight_bytes": loaded.weight_bytes,
            "kv_cache": engine.limits().kv_scheme, "kv_bytes_per_token": engine.limits().kv_bytes_per_token,
            "kv_capacity_tokens": engine.limits().kv_capacity_tokens,
            "prompt_tok_s": pmed, "prompt_tok_s_min": pp[0], "prompt_tok_s_max": pp[pp.len() - 1],
            "decode_tok_s": dmed, "decode_tok_s_min": tg[0], "decode_tok_s_max": tg[tg.len() - 1],
            "json_schema_decode_tok_s": jmed, "json_schema_tokens": jmed.map(|_| json_tokens),
            "json_schema_ratio": jmed.map(|j| j / dmed),
        });
        println!("{out}");
    } else {
        println!(
            "model   {}  ({device}, load {:.0} ms, ready {ready_ms:.0} ms after start; {})",
            path.display(),
            loaded.load_secs * 1e3,
            crate::session::kv_report(engine.limits())
        );
        println!("test          min      median   max   (tok/s, {} reps)", a.reps);
        println!("pp{:<8} {:>8.1} {pmed:>8.1} {:>8.1}", prompt_tokens, pp[0], pp[pp.len() - 1]);
        println!("tg{:<8} {:>8.1} {dmed:>8.1} {:>8.1}", generated, tg[0], tg[tg.len() - 1]);
        if let Some(j) = jmed {
            let (lo, hi) = (tg_json[0], tg_json[tg_json.len() - 1]);
            println!(
                "tg json    {lo:>8.1} {j:>8.1} {hi:>8.1}   ({json_tokens} tokens; {:.3} × unconstrained)",
                j / dmed
            );
        }
        if proposed > 0 {
            println!(
                "acceptance {:.1} % ({accepted} of {proposed} proposed tokens), {steps:.0} forward passes a run",
                acceptance * 100.0
            );
        }
    }
    Ok(())
}

/// The (prompt ids, max_tokens) of every request.
pub(crate) fn workload(a: &ThroughputArgs, loaded: &ferrite_models::LoadedModel) -> Result<Vec<(Vec<u32>, usize)>> {
    let vocab = loaded.model.config().vocab_size;
    if let Some(file) = &a.prompts_file {
        let tok = loaded.tokenizer.as_ref().context("--prompts-file needs a model with a tokenizer")?;
        let mut out = Vec::new();
        for (prompt, max) in read_prompts_file(file, a.output_len)? {
            out.push((tok.encode(&prompt, true)?, max));
        }
        return Ok((0..a.num_requests).map(|i| out[i % out.len()].clone()).collect());
    }
    let mut rng = Lcg(0x5EED);
    let r = a.random_range_ratio;
    Ok((0..a.num_requests)
        .map(|_| {
            let (i, o) = (rng.around(a.input_len, r), rng.around(a.output_len, r));
            (rng.ids(i, vocab), o)
        })
        .collect())
}

/// What one pass of a throughput workload measured: its wall time and, per request, (prompt
/// tokens, (ttft s, tpot s, output tokens)).
pub(crate) struct Pass {
    pub wall: f64,
    results: Vec<(usize, (f64, f64, usize))>,
}

impl Pass {
    pub fn output_tok_s(&self) -> f64 {
        self.results.iter().map(|(_, r)| r.2).sum::<usize>() as f64 / self.wall
    }

    /// Throughput and latency percentiles (ms) as JSON fields.
    pub fn stats(&self) -> serde_json::Map<String, Value> {
        let out_tokens: usize = self.results.iter().map(|(_, r)| r.2).sum();
        let in_tokens: usize = self.results.iter().map(|(p, _)| p).sum();
        let mut ttft: Vec<f64> = self.results.iter().map(|(_, r)| r.0 * 1e3).collect();
        let mut tpot: Vec<f64> = self.results.iter().filter(|(_, r)| r.2 > 1).map(|(_, r)| r.1 * 1e3).collect();
        ttft.sort_by(f64::total_cmp);
        tpot.sort_by(f64::total_cmp);
        let v = json!({
            "duration_s": self.wall,
            "output_tok_s": out_tokens as f64 / self.wall, "total_tok_s": (in_tokens + out_tokens) as f64 / self.wall,
            "request_s": self.results.len() as f64 / self.wall,
            "ttft_ms_p50": pct(&ttft, 0.5), "ttft_ms_p90": pct(&ttft, 0.9), "ttft_ms_p99": pct(&ttft, 0.99),
            "tpot_ms_p50": pct(&tpot, 0.5), "tpot_ms_p90": pct(&tpot, 0.9), "tpot_ms_p99": pct(&tpot, 0.99),
        });
        v.as_object().cloned().unwrap_or_default()
    }
}

/// Drive `work` (prompt, max tokens) through `engine` from `concurrency` client threads,
/// request i through `adapters[i % len]` (the base model when there are none).
pub(crate) fn drive(
    engine: &Arc<Engine>,
    work: &Arc<Vec<(Vec<u32>, usize)>>,
    concurrency: usize,
    adapters: &Arc<Vec<String>>,
) -> Result<Pass> {
    let next = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let clients: Vec<_> = (0..concurrency.min(work.len()))
        .map(|_| {
            let (engine, work, next, results) = (engine.clone(), work.clone(), next.clone(), results.clone());
            let adapters = adapters.clone();
            std::thread::spawn(move || -> Result<()> {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((prompt, max)) = work.get(i) else { return Ok(()) };
                    let adapter = (!adapters.is_empty()).then(|| adapters[i % adapters.len()].clone());
                    let r = timed_constrained(&engine, prompt.clone(), *max, false, None, Default::default(), adapter)?;
                    results.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.push((prompt.len(), r));
                }
            })
        })
        .collect();
    for c in clients {
        c.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
    }
    let wall = t0.elapsed().as_secs_f64();
    let results = std::mem::take(&mut *results.lock().map_err(|_| anyhow::anyhow!("poisoned"))?);
    Ok(Pass { wall, results })
}

fn throughput(a: ThroughputArgs) -> Result<()> {
    if a.num_requests == 0 || a.concurrency == 0 || a.input_len == 0 || a.output_len == 0 {
        bail!("--num-requests, --concurrency, --input-len and --output-len must be at least 1");
    }
    let (mut loaded, path, threads) = a.model.load()?;
    if a.no_compute {
        if a.lora.is_some() {
            bail!("--no-compute and --lora measure different things: pass one");
        }
        loaded.model = crate::no_compute::NoCompute::wrap(loaded.model.clone());
    }
    let work = Arc::new(workload(&a, &loaded)?);
    let mut engine_args = a.engine.clone();
    engine_args.max_num_seqs = engine_args.max_num_seqs.max(a.concurrency);
    let engine = Arc::new(engine_args.start(&loaded, &path)?);
    let device = crate::session::device_report(&loaded, threads);
    if let Some(n) = a.lora {
        return crate::bench_lora::compare(&a, n, &loaded, &path, &device, &engine, &work);
    }
    let mut adapters = Vec::new();
    for (name, dir) in crate::serve::lora_modules(&a.lora_modules)? {
        let lora = ferrite_models::lora::LoraAdapter::load(&dir, ferrite_models::lora::MAX_LORA_RANK)?;
        engine.load_adapter(&name, Arc::new(lora))?;
        adapters.push(name);
    }
    let pass = drive(&engine, &work, a.concurrency, &Arc::new(adapters.clone()))?;
    let m = engine.metrics();
    let mut out = json!({
        "model": path.display().to_string(), "threads": threads, "device": device,
        "num_requests": a.num_requests, "input_len": a.input_len, "output_len": a.output_len,
        "concurrency": a.concurrency, "lora_adapters": adapters.len(), "no_compute": a.no_compute,
        "prefix_cache_hit_rate": m.prefix_hit_rate(),
        "preemptions": m.preemptions.load(Ordering::Relaxed),
        "kv_cache": engine.limits().kv_scheme, "kv_bytes_per_token": engine.limits().kv_bytes_per_token,
        "kv_capacity_tokens": engine.limits().kv_capacity_tokens,
    });
    let stats = pass.stats();
    if let Some(o) = out.as_object_mut() {
        o.extend(stats.clone());
    }
    if a.json {
        println!("{out}");
    } else {
        println!(
            "model {} ({device}; {}), {} requests of {} in / {} out at concurrency {}",
            path.display(),
            crate::session::kv_report(engine.limits()),
            a.num_requests,
            a.input_len,
            a.output_len,
            a.concurrency
        );
        print_pass(&stats);
    }
    Ok(())
}

/// A pass's throughput and latency lines.
pub(crate) fn print_pass(stats: &serde_json::Map<String, Value>) {
    let f = |k: &str| stats.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    println!(
        "output {:.1} tok/s, total {:.1} tok/s, {:.2} req/s over {:.1} s",
        f("output_tok_s"),
        f("total_tok_s"),
        f("request_s"),
        f("duration_s")
    );
    println!("TTFT ms p50 {:.1} p90 {:.1} p99 {:.1}", f("ttft_ms_p50"), f("ttft_ms_p90"), f("ttft_ms_p99"));
    println!("TPOT ms p50 {:.1} p90 {:.1} p99 {:.1}", f("tpot_ms_p50"), f("tpot_ms_p90"), f("tpot_ms_p99"));
}

fn prefix(a: PrefixArgs) -> Result<()> {
    if a.reps == 0 || a.prefix_len == 0 || a.suffix_len == 0 {
        bail!("--reps, --prefix-len and --suffix-len must be at least 1");
    }
    let (loaded, path, threads) = a.model.load()?;
    let vocab = loaded.model.config().vocab_size;
    let len = a.prefix_len + a.suffix_len + 2;
    let args = |no_prefix_cache| EngineArgs {
        max_num_seqs: 1,
        max_num_batched_tokens: len,
        max_model_len: Some(len),
        no_prefix_cache,
        ..EngineArgs::default()
    };
    let warm = args(false).start(&loaded, &path)?;
    let cold = args(true).start(&loaded, &path)?;
    let mut rng = Lcg(0xCAFE);
    let (mut hit_ms, mut cold_ms) = (Vec::new(), Vec::new());
    for _ in 0..a.reps {
        let shared = rng.ids(a.prefix_len, vocab);
        let with_suffix = |rng: &mut Lcg| [shared.clone(), rng.ids(a.suffix_len, vocab)].concat();
        // A first request leaves the prefix in the cache; the second reuses it.
        timed_request(&warm, with_suffix(&mut rng), 1, false)?;
        let second = with_suffix(&mut rng);
        hit_ms.push(timed_request(&warm, second.clone(), 1, false)?.0 * 1e3);
        cold_ms.push(timed_request(&cold, second, 1, false)?.0 * 1e3);
    }
    hit_ms.sort_by(f64::total_cmp);
    cold_ms.sort_by(f64::total_cmp);
    let (hit, cold_med) = (pct(&hit_ms, 0.5), pct(&cold_ms, 0.5));
    let hit_rate = warm.metrics().prefix_hit_rate();
    if a.json {
        let out = json!({
            "model": path.display().to_string(), "threads": threads,
            "prefix_len": a.prefix_len, "suffix_len": a.suffix_len, "reps": a.reps,
            "ttft_ms_cold": cold_med, "ttft_ms_prefix_hit": hit, "speedup": cold_med / hit.max(1e-9),
            "prefix_cache_hit_rate": hit_rate,
        });
        println!("{out}");
    } else {
        println!(
            "model {} ({threads} threads): {} shared + {} new prompt tokens",
            path.display(),
            a.prefix_len,
            a.suffix_len
        );
        println!(
            "TTFT cold {cold_med:.1} ms, prefix hit {hit:.1} ms ({:.1}x), medians of {}",
            cold_med / hit.max(1e-9),
            a.reps
        );
    }
    Ok(())
}
