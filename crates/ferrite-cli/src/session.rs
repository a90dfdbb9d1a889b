//! What `run` and `chat` share: loading a model with the common flags, turning text into
//! prompt ids (chat template or raw), and streaming a generation to stdout.

use std::io::Write;

use anyhow::{anyhow, Context, Result};
use clap::Args;
use ferrite_engine::{GenerateRequest, GenerationStats, Generator, SamplingParams};
use ferrite_models::chat_template::ChatRenderRequest;
use ferrite_models::tokenizer::{IncrementalDecoder, Tokenizer};
use ferrite_models::LoadedModel;
use serde_json::Value;

#[derive(Args, Clone)]
pub struct ModelArgs {
    /// A model path (HF directory or .gguf) or a name: smollm2, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b
    pub model: String,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Context length (default: the model's, at most 4096).
    #[arg(long)]
    pub ctx_size: Option<usize>,
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
    pub generator: Generator,
}

impl Session {
    pub fn open(args: &ModelArgs) -> Result<Session> {
        let threads = ferrite_runtime::threads::init(args.threads)?;
        let path = crate::model_arg::resolve(&args.model)?;
        let loaded = ferrite_models::load(&path)?;
        let cfg = loaded.model.config();
        let ctx = args.ctx_size.unwrap_or(cfg.max_position_embeddings.min(4096)).min(cfg.max_position_embeddings);
        let generator = Generator::new(loaded.model.clone(), ctx, 16, 512)?;
        eprintln!(
            "loaded {} ({} layers, {:.0} MB of weights) in {:.0} ms on {threads} threads",
            path.display(),
            cfg.num_layers,
            loaded.weight_bytes as f64 / 1e6,
            loaded.load_secs * 1e3
        );
        Ok(Session { loaded, generator })
    }

    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.loaded.tokenizer.as_ref().ok_or_else(|| anyhow!("this model has no tokenizer (tokenizer.json is missing)"))
    }

    /// Prompt ids for a conversation through the chat template.
    pub fn chat_prompt(&self, messages: &[Value]) -> Result<Vec<u32>> {
        let tmpl = self.loaded.chat_template.as_ref().ok_or_else(|| anyhow!("this model has no chat template; use --raw"))?;
        let text = tmpl
            .render(&ChatRenderRequest { messages, tools: None, add_generation_prompt: true, extra: Default::default() })
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
        };
        let req = GenerateRequest {
            prompt,
            max_tokens: s.max_tokens,
            sampling,
            stop_token_ids: self.loaded.eos_token_ids(),
            ignore_eos: false,
        };
        let tok = self.loaded.tokenizer.as_ref().ok_or_else(|| anyhow!("this model has no tokenizer"))?;
        let mut decoder = IncrementalDecoder::new(true);
        let mut text = String::new();
        let mut out = std::io::stdout().lock();
        let mut failure = None;
        let stats = self.generator.generate(&req, &mut |id| match decoder.push(tok, id) {
            Ok(piece) => {
                text.push_str(&piece);
                // A closed stdout (e.g. `| head`) ends the generation quietly.
                out.write_all(piece.as_bytes()).and_then(|_| out.flush()).is_ok()
            }
            Err(e) => {
                failure = Some(e);
                false
            }
        })?;
        if let Some(e) = failure {
            return Err(e.into());
        }
        let rest = decoder.finish(tok)?;
        text.push_str(&rest);
        let _ = out.write_all(rest.as_bytes()).and_then(|_| out.flush());
        Ok((text, stats))
    }
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
}
