//! What `run` and `chat` share: loading a model with the common flags, turning text into
//! prompt ids (chat template or raw), and streaming a generation to stdout.

use std::io::Write;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use std::time::Instant;

use ferrite_engine::{Engine, EngineConfig, Request, RequestParams, SamplingParams};
use ferrite_models::chat_template::ChatRenderRequest;
use ferrite_models::tokenizer::Tokenizer;
use ferrite_models::LoadedModel;
use serde_json::Value;

#[derive(Args, Clone)]
pub struct ModelArgs {
    /// A model path (HF directory or .gguf) or a name: smollm2, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b
    pub model: String,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

impl ModelArgs {
    /// Size the thread pool, resolve the model and load it: (model, its path, threads).
    pub fn load(&self) -> Result<(LoadedModel, std::path::PathBuf, usize)> {
        let threads = ferrite_runtime::threads::init(self.threads)?;
        let path = crate::model_arg::resolve(&self.model)?;
        let loaded = ferrite_models::load(&path)?;
        Ok((loaded, path, threads))
    }
}

/// Engine settings shared by every command that runs one.
#[derive(Args, Clone)]
pub struct EngineArgs {
    /// Longest sequence, prompt + output (default: the model's context, at most 4096 for
    /// run/chat).
    #[arg(long, alias = "ctx-size")]
    pub max_model_len: Option<usize>,
    /// Query tokens per engine step.
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Sequences per engine step.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// KV cache size in bytes (default: max-model-len × max-num-seqs positions).
    #[arg(long)]
    pub kv_cache_memory: Option<usize>,
    /// Positions per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Turn the prefix cache off.
    #[arg(long)]
    pub no_prefix_cache: bool,
}

impl Default for EngineArgs {
    fn default() -> Self {
        let d = EngineConfig::default();
        EngineArgs {
            max_model_len: None,
            max_num_batched_tokens: d.max_num_batched_tokens,
            max_num_seqs: d.max_num_seqs,
            kv_cache_memory: None,
            block_size: d.block_size,
            no_prefix_cache: false,
        }
    }
}

impl EngineArgs {
    pub fn config(&self, path: &std::path::Path) -> EngineConfig {
        EngineConfig {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len,
            block_size: self.block_size,
            kv_cache_memory: self.kv_cache_memory,
            prefix_cache: !self.no_prefix_cache,
            namespace: model_namespace(path),
        }
    }

    pub fn start(&self, loaded: &LoadedModel, path: &std::path::Path) -> Result<Engine> {
        Ok(Engine::start(loaded.model.clone(), loaded.tokenizer.clone(), loaded.eos_token_ids(), &self.config(path))?)
    }
}

#[derive(Args, Clone)]
pub struct SamplingArgs {
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 512)]
    pub max_tokens: usize,
    /// 0 is greedy (default: the model's generation_config, else 0.8).
    #[arg(long)]
    pub temperature: Option<f32>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Random seed (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
}

pub struct Session {
    pub loaded: LoadedModel,
    pub engine: Engine,
}

/// Timing of one generation, measured from the caller's side of the engine.
#[derive(Debug, Clone)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Submit to first token: prompt processing.
    pub prompt_secs: f64,
    pub generated_tokens: usize,
    /// First token to last.
    pub decode_secs: f64,
}

impl Session {
    /// Load the model and start an engine for one conversation.
    pub fn open(args: &ModelArgs, engine: &EngineArgs) -> Result<Session> {
        let (loaded, path, threads) = args.load()?;
        let cfg = loaded.model.config();
        let engine_args = EngineArgs {
            max_model_len: Some(engine.max_model_len.unwrap_or(cfg.max_context().min(4096))),
            max_num_seqs: 1,
            ..engine.clone()
        };
        let engine = engine_args.start(&loaded, &path)?;
        eprintln!(
            "loaded {} ({} layers, {:.0} MB of weights) in {:.0} ms on {threads} threads",
            path.display(),
            cfg.num_layers,
            loaded.weight_bytes as f64 / 1e6,
            loaded.load_secs * 1e3
        );
        Ok(Session { loaded, engine })
    }

    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.loaded
            .tokenizer
            .as_deref()
            .ok_or_else(|| anyhow!("this model has no tokenizer (tokenizer.json is missing)"))
    }

    /// Prompt ids for a conversation through the chat template.
    pub fn chat_prompt(&self, messages: &[Value]) -> Result<Vec<u32>> {
        let tmpl =
            self.loaded.chat_template.as_ref().ok_or_else(|| anyhow!("this model has no chat template; use --raw"))?;
        let text = tmpl
            .render(&ChatRenderRequest {
                messages,
                tools: None,
                add_generation_prompt: true,
                extra: Default::default(),
            })
            .context("chat template")?;
        // The template writes every special token itself (BOS included, where the model uses one).
        Ok(self.tokenizer()?.encode(&text, false)?)
    }

    /// Prompt ids for raw text (BOS per the model's tokenizer config).
    pub fn raw_prompt(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tokenizer()?.encode(text, true)?)
    }

    /// Generate from `prompt`, streaming text to stdout; returns the text and the stats.
    pub fn stream(&mut self, prompt: Vec<u32>, s: &SamplingArgs) -> Result<(String, GenerationStats)> {
        let gd = &self.loaded.generation;
        let sampling = SamplingParams {
            temperature: s.temperature.or(gd.temperature).unwrap_or(0.8),
            top_k: s.top_k.or(gd.top_k).unwrap_or(40),
            top_p: s.top_p.or(gd.top_p).unwrap_or(0.95),
            min_p: s.min_p,
            seed: s.seed.unwrap_or_else(clock_seed),
            ..SamplingParams::default()
        };
        let prompt_tokens = prompt.len();
        let room = self.engine.limits().max_model_len.saturating_sub(prompt_tokens);
        let params = RequestParams { sampling, max_tokens: Some(s.max_tokens.min(room).max(1)), ..Default::default() };
        let t0 = Instant::now();
        let mut stream = self.engine.submit(Request { prompt, params })?;
        let mut text = String::new();
        let mut out = std::io::stdout().lock();
        let (mut first, mut generated) = (None, 0);
        loop {
            let Some(o) = stream.blocking_next() else { bail!("the engine stopped") };
            first.get_or_insert_with(Instant::now);
            generated += o.token_ids.len();
            text.push_str(&o.text);
            // A closed stdout (e.g. `| head`) ends the generation quietly: dropping the stream aborts it.
            if out.write_all(o.text.as_bytes()).and_then(|_| out.flush()).is_err() {
                break;
            }
            if let Some(f) = o.finished {
                if let Some(e) = f.error {
                    bail!("generation failed: {e}");
                }
                let first = first.unwrap_or(t0);
                let stats = GenerationStats {
                    prompt_tokens,
                    cached_tokens: f.usage.cached_tokens,
                    prompt_secs: (first - t0).as_secs_f64(),
                    generated_tokens: generated,
                    decode_secs: first.elapsed().as_secs_f64(),
                };
                return Ok((text, stats));
            }
        }
        bail!("stdout closed")
    }
}

/// The prefix-cache namespace of a model file: its path, size and modification time.
pub fn model_namespace(path: &std::path::Path) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    path.hash(&mut h);
    if let Ok(m) = std::fs::metadata(path) {
        m.len().hash(&mut h);
        m.modified().ok().hash(&mut h);
    }
    h.finish()
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

pub fn report(stats: &GenerationStats) {
    let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s",
        stats.prompt_tokens,
        rate(stats.prompt_tokens, stats.prompt_secs),
        stats.generated_tokens,
        rate(stats.generated_tokens.saturating_sub(1), stats.decode_secs)
    );
    if stats.cached_tokens > 0 {
        eprintln!("prefix cache: {} of {} prompt tokens reused", stats.cached_tokens, stats.prompt_tokens);
    }
}
