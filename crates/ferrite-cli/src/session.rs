//! What `run` and `chat` share: loading a model with the common flags, turning text into
//! prompt ids (chat template or raw), and streaming a generation to stdout.

use std::io::Write;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use std::time::Instant;

use ferrite_engine::fill::ToolScaffold;
use ferrite_engine::{Engine, EngineConfig, FillMode, Request, RequestParams, Speculation};
use ferrite_models::chat_template::ChatRenderRequest;
use ferrite_models::fit::{KvDtypeChoice, DEFAULT_KV_GROUP_SIZE};
use ferrite_models::tokenizer::Tokenizer;
use ferrite_models::LoadedModel;
use ferrite_runtime::cuda::{Device, DeviceChoice};
use ferrite_runtime::{DType, KvScheme, KvSkip};
use serde_json::Value;

#[derive(Args, Clone)]
pub struct ModelArgs {
    /// A model path (HF directory or .gguf), a name (smollm2, gemma3-270m, qwen2.5-coder-0.5b,
    /// qwen2.5-coder-1.5b) or a Hugging Face repo in the local cache (org/name[@rev][:FILE.gguf])
    /// (required, unless --synthetic or, for serve, --model NAME=PATH or --models-dir)
    pub model: Option<String>,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where the model runs: auto (a CUDA GPU when present), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Instead of a model file, a model of a real shape with random weights generated on the
    /// device (on the GPU, or in host memory on the CPU; for benchmarks): llama-3.1-8b,
    /// llama-3.2-1b, qwen2.5-1.5b, smollm2-135m, gemma-4-e4b, qwen3-30b-a3b, gemma-4-26b-a4b.
    /// It takes its family's tokenizer and chat template from the test assets
    /// when they are here (scripts/fetch_test_assets.sh), or from --tokenizer.
    #[arg(long, conflicts_with = "model")]
    pub synthetic: Option<String>,
    /// An HF directory or .gguf file whose tokenizer and chat template a synthetic model uses.
    #[arg(long, requires = "synthetic")]
    pub tokenizer: Option<std::path::PathBuf>,
    /// Weight dtype of a synthetic model: bf16, fp8 (GPU: e4m3 layer projections and routed
    /// experts with a scale per output channel), a GGUF block type (q4_0, q4_1, q5_0, q8_0, q4_k, q5_k, q6_k; q5_1
    /// and f16 on the CPU), or MLX affine 4/8-bit: mlx4 and mlx8 (groups of 64, bf16 scales)
    /// or a full name such as mlx4_g32_bf16 or mlx8_g128_f16.
    #[arg(long, default_value = "bf16", requires = "synthetic")]
    pub dtype: String,
    /// Seed of a synthetic model's weights.
    #[arg(long, default_value_t = 0, requires = "synthetic")]
    pub weight_seed: u64,
    /// Before loading, check the sha256 of the weight file(s) against `<file>.sha256` beside
    /// each, or a named model's known digest; a mismatch is an error.
    #[arg(long, conflicts_with = "synthetic")]
    pub verify_weights: bool,
    /// Convert a bf16/f16 checkpoint's weights at load: fp8 quantizes each layer projection
    /// and routed expert to e4m3 with a scale per output channel (activations per token at run time), on a CUDA GPU
    /// of compute capability 8.9+ (the embedding and LM head stay bf16). An FP8 checkpoint
    /// (compressed-tensors, transformers' fp8) needs no flag.
    #[arg(long, value_parser = ["fp8"], conflicts_with = "synthetic")]
    pub quantization: Option<String>,
}

impl ModelArgs {
    /// Size the thread pool, resolve the model and load it: (model, its path, threads). A
    /// synthetic model's path is `synthetic:NAME` (`synthetic:NAME:DTYPE` when quantized).
    pub fn load(&self) -> Result<(LoadedModel, std::path::PathBuf, usize)> {
        let threads = ferrite_runtime::threads::init(self.threads)?;
        if let Some(name) = &self.synthetic {
            let dtype = DType::parse(&self.dtype).ok_or_else(|| {
                anyhow!(
                    "unknown --dtype {} (bf16, fp8, q4_0, q4_1, q5_0, q8_0, q4_k, q5_k, q6_k, mlx4, mlx8)",
                    self.dtype
                )
            })?;
            let mut loaded = ferrite_models::synthetic(name, self.device, self.weight_seed, dtype)?;
            crate::synthetic_text::attach(&mut loaded, name, self.tokenizer.as_deref())?;
            let path = match dtype {
                DType::BF16 => format!("synthetic:{name}"),
                q => format!("synthetic:{name}:{}", q.name().to_lowercase()),
            };
            return Ok((loaded, path.into(), threads));
        }
        let Some(model) = &self.model else { bail!("a MODEL is required (a model path or name, or --synthetic NAME)") };
        let path = crate::model_arg::resolve(model)?;
        if self.verify_weights {
            for f in ferrite_models::verify::verify_weights(&path)? {
                eprintln!("verified {}: sha256 {} (from {})", f.path.display(), f.sha256, f.source);
            }
        }
        let loaded = ferrite_models::load_with(&path, self.device, &self.load_options())?;
        Ok((loaded, path, threads))
    }

    /// How a model file loads under these flags.
    pub fn load_options(&self) -> ferrite_models::LoadOptions {
        let quantization = match self.quantization.as_deref() {
            Some("fp8") => ferrite_models::gpu::UploadQuantization::Fp8,
            _ => ferrite_models::gpu::UploadQuantization::None,
        };
        ferrite_models::LoadOptions { quantization, ..Default::default() }
    }

    /// The MODEL argument as given (or `synthetic:NAME`).
    pub fn name(&self) -> &str {
        self.model.as_deref().or(self.synthetic.as_deref()).unwrap_or_default()
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
    #[command(flatten)]
    pub kv: KvArgs,
    /// Turn the prefix cache off.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Host RAM (bytes, page-locked) for the prefix-cache blocks a GPU's KV pool evicts,
    /// kept there instead of dropped and restored on a hit (GPU models only: on the CPU the
    /// pool already is RAM).
    #[arg(long)]
    pub host_cache_memory: Option<usize>,
    /// Directory of the prefix cache's SSD tier: full KV blocks are written there in the
    /// background and served after a restart (content-addressed, checksummed).
    #[arg(long)]
    pub prefix_cache_dir: Option<std::path::PathBuf>,
    /// Bytes the SSD tier's directory may hold; the least recently used files go beyond.
    #[arg(long, default_value_t = 10 << 30, requires = "prefix_cache_dir")]
    pub prefix_cache_disk_bytes: u64,
    /// Make generations resumable: record one's tokens every N generated tokens and when it
    /// is cut off (client gone, shutdown), so an identical retry continues where it stopped.
    #[arg(long)]
    pub generation_checkpoint: Option<usize>,
    /// Fraction of the GPU's free memory, after weights and workspaces, the KV cache takes
    /// (when --kv-cache-memory is not given).
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f32,
    /// LoRA adapters loaded at once, at most (`--lora-modules` and run-time loads).
    #[arg(long, default_value_t = 8)]
    pub max_loras: usize,
    /// Hybrid linear-attention models (Qwen3.5, Qwen3-Next): positions between the recurrent
    /// state snapshots the prefix cache keeps (rounded up to whole blocks). Default: a
    /// snapshot no bigger than the KV of the positions it covers.
    #[arg(long)]
    pub state_snapshot_interval: Option<usize>,
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// What the KV cache holds.
#[derive(Args, Clone)]
pub struct KvArgs {
    /// KV cache value type: auto (f16 on the CPU, bf16 on a GPU), f16 (CPU), bf16 (GPU),
    /// int8 or int4 (group-affine, CPU and GPU), fp8 (e4m3 with a scale per layer and KV head,
    /// GPU of compute capability 8.9+; refused on the CPU, where int8 takes the same bytes).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: KvDtypeChoice,
    /// Values per scale and bias of an int8/int4 KV cache: 16, 32, 64 or 128, dividing the
    /// head dim.
    #[arg(long, default_value_t = DEFAULT_KV_GROUP_SIZE)]
    pub kv_group_size: usize,
    /// Layers whose KV stays full precision (f16 on the CPU, bf16 on a GPU) under
    /// int8/int4/fp8: sliding, first:N, last:N or a list of KV-owning layer indices (0,1,29).
    #[arg(long)]
    pub kv_cache_skip_layers: Option<KvSkip>,
    /// Under int8/int4, each sequence keeps f16 KV for its first N positions and turns
    /// quantized past them (what it wrote is converted once). N > 0 adds f16 pools for
    /// `max-num-seqs × N` positions (at most half the KV memory), which also lets a request
    /// set its own `quantized_kv_start` or ask `kv_cache_dtype: f16`.
    #[arg(long, default_value_t = 0)]
    pub quantized_kv_start: usize,
}

impl Default for KvArgs {
    fn default() -> Self {
        KvArgs {
            kv_cache_dtype: KvDtypeChoice::Auto,
            kv_group_size: DEFAULT_KV_GROUP_SIZE,
            kv_cache_skip_layers: None,
            quantized_kv_start: 0,
        }
    }
}

impl KvArgs {
    /// The KV scheme of these flags on `device`; an error names a type the device cannot hold.
    pub fn scheme(&self, device: Device) -> Result<KvScheme> {
        let dtype = self.kv_cache_dtype.resolve(device, self.kv_group_size).map_err(|e| anyhow!(e))?.dtype;
        Ok(KvScheme { dtype, skip: self.kv_cache_skip_layers.clone().unwrap_or_default() })
    }
}

/// How the engine runs its steps: speculative decoding, fill, and overlap.
#[derive(Args, Clone)]
pub struct SpecArgs {
    /// Speculative decoding by prompt lookup over each request's prompt and output: off or
    /// ngram (for a draft model, give --draft-model).
    #[arg(long, default_value = "off", value_parser = ["off", "ngram"])]
    pub spec: String,
    /// A draft model (path or name) sharing the model's tokenizer; it gets its own KV cache.
    #[arg(long)]
    pub draft_model: Option<String>,
    /// Keep only the draft's first N layers (a deliberately weakened draft).
    #[arg(long, requires = "draft_model")]
    pub draft_layers: Option<usize>,
    /// Most tokens drafted per sequence per step.
    #[arg(long, default_value_t = 4)]
    pub num_draft_tokens: usize,
    /// Default fill mode of requests that set none: off, strict (assert the chat template's
    /// tool-call scaffolds and the tokens an output grammar forces, as in structured output and
    /// forced tool calls) or echo (strict, and verify spans echoed from the conversation).
    /// Strict by default: it never changes a greedy output and saves forward passes on tool
    /// calls and constrained output (BENCHMARKS.md, fill on tool calls).
    #[arg(long)]
    pub fill: Option<FillMode>,
    /// Wait for each step on the GPU before scheduling the next (by default the next decode
    /// step is queued while the device still runs this one).
    #[arg(long)]
    pub no_overlap: bool,
}

impl Default for SpecArgs {
    fn default() -> Self {
        SpecArgs {
            spec: "off".into(),
            draft_model: None,
            draft_layers: None,
            num_draft_tokens: 4,
            fill: None,
            no_overlap: false,
        }
    }
}

impl SpecArgs {
    /// The fill mode: `--fill`, strict when not given.
    pub fn fill_mode(&self) -> FillMode {
        self.fill.unwrap_or(FillMode::Strict)
    }

    /// The engine's speculation (loading the draft model) and the scaffold for fill.
    fn resolve(&self, loaded: &LoadedModel) -> Result<(Speculation, Option<std::sync::Arc<ToolScaffold>>)> {
        let speculation = match (&self.draft_model, self.spec.as_str()) {
            (Some(_), "ngram") => bail!("--spec ngram and --draft-model exclude each other"),
            (Some(name), _) => {
                let path = crate::model_arg::resolve(name)?;
                let opts = ferrite_models::LoadOptions { max_layers: self.draft_layers, ..Default::default() };
                // The draft runs on the CPU (speculation on the GPU path is not built yet).
                let draft = ferrite_models::load_with(&path, ferrite_runtime::cuda::DeviceChoice::Cpu, &opts)
                    .with_context(|| format!("draft model {name}"))?;
                Speculation::Draft(draft.model)
            }
            (None, "ngram") => Speculation::Ngram,
            (None, _) => Speculation::Off,
        };
        let scaffold = match (&loaded.chat_template, &loaded.tokenizer) {
            (Some(t), Some(tok)) => ToolScaffold::discover(t, tok, &loaded.eos_token_ids()).map(std::sync::Arc::new),
            _ => None,
        };
        // Only a fill the user asked for is worth a note; the default quietly asserts less.
        if self.fill.is_some_and(|f| f != FillMode::Off) && scaffold.is_none() {
            eprintln!(
                "note: this model's chat template has no tool-call scaffold; fill asserts only the tokens an output \
                 grammar forces"
            );
        }
        Ok((speculation, scaffold))
    }
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
            kv: KvArgs::default(),
            no_prefix_cache: false,
            host_cache_memory: None,
            prefix_cache_dir: None,
            prefix_cache_disk_bytes: 10 << 30,
            generation_checkpoint: None,
            gpu_memory_utilization: d.gpu_memory_utilization,
            max_loras: d.max_loras,
            state_snapshot_interval: None,
            spec: SpecArgs::default(),
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
            gpu_memory_utilization: self.gpu_memory_utilization,
            prefix_cache: !self.no_prefix_cache,
            namespace: model_namespace(path),
            host_cache_memory: self.host_cache_memory,
            disk_cache: (self.prefix_cache_dir.clone())
                .map(|d| ferrite_engine::kv::disk::DiskConfig::new(d, self.prefix_cache_disk_bytes)),
            generation_checkpoint: self.generation_checkpoint,
            num_draft_tokens: self.spec.num_draft_tokens,
            fill: self.spec.fill_mode(),
            overlap: !self.spec.no_overlap,
            max_loras: self.max_loras,
            state_snapshot_interval: self.state_snapshot_interval,
            ..EngineConfig::default()
        }
    }

    pub fn start(&self, loaded: &LoadedModel, path: &std::path::Path) -> Result<Engine> {
        if self.host_cache_memory.is_some() && loaded.device == Device::Cpu {
            bail!("--host-cache-memory is for GPU models: on the CPU the KV pool already is host RAM (use --kv-cache-memory)");
        }
        let (speculation, tool_scaffold) = self.spec.resolve(loaded)?;
        let kv_scheme = self.kv.scheme(loaded.device)?;
        let quantized_kv_start = self.kv.quantized_kv_start;
        let cfg = EngineConfig { speculation, tool_scaffold, kv_scheme, quantized_kv_start, ..self.config(path) };
        Ok(Engine::start(loaded.model.clone(), loaded.tokenizer.clone(), loaded.eos_token_ids(), &cfg)?)
    }
}

#[derive(Args, Clone)]
pub struct SamplingArgs {
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 512)]
    pub max_tokens: usize,
    /// 0 is greedy (default: the model's generation_config when it samples, else greedy).
    #[arg(long)]
    pub temperature: Option<f32>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Above 1 discourages repeating tokens of the prompt and output (default: the model's
    /// generation_config, else 1, off).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    #[arg(long)]
    pub min_p: Option<f32>,
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
            "loaded {} ({} layers, {:.0} MB of weights) in {:.0} ms on {}; {}",
            path.display(),
            cfg.num_layers,
            loaded.weight_bytes as f64 / 1e6,
            loaded.load_secs * 1e3,
            device_report(&loaded, threads),
            kv_report(engine.limits())
        );
        Ok(Session { loaded, engine })
    }

    /// Say on stderr which sampling flags the generation will ignore, if any.
    pub fn note_ignored_flags(&self, s: &SamplingArgs) {
        let resolved = crate::sampling::resolve(s, &self.loaded.generation, || 0);
        if let Some(note) = crate::sampling::ignored_flags_note(s, &resolved) {
            eprintln!("{note}");
        }
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
        let sampling = crate::sampling::resolve(s, &self.loaded.generation, clock_seed);
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

/// Where a loaded model runs, for the load line: the GPU and its kernels, or the CPU threads.
pub fn device_report(loaded: &LoadedModel, threads: usize) -> String {
    match loaded.device {
        Device::Cpu => format!("{threads} threads"),
        Device::Cuda(_) => loaded.device_note.clone(),
    }
}

/// The KV cache for the load line: its type, bytes a token and capacity in tokens.
pub fn kv_report(limits: &ferrite_engine::Limits) -> String {
    format!(
        "KV cache {}, {} bytes/token, {} tokens",
        limits.kv_scheme, limits.kv_bytes_per_token, limits.kv_capacity_tokens
    )
}

/// The prefix-cache namespace of a model: its path, size and modification time, and for a
/// directory those of each file in it (weights, config, tokenizer), so a changed tokenizer or
/// config is another namespace.
pub fn model_namespace(path: &std::path::Path) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let stamp = |p: &std::path::Path, h: &mut std::collections::hash_map::DefaultHasher| {
        if let Ok(m) = std::fs::metadata(p) {
            m.len().hash(h);
            m.modified().ok().hash(h);
        }
    };
    path.hash(&mut h);
    stamp(path, &mut h);
    if let Ok(dir) = std::fs::read_dir(path) {
        let mut files: Vec<_> = dir.filter_map(|e| e.ok().map(|e| e.path())).collect();
        files.sort();
        for f in files {
            f.hash(&mut h);
            stamp(&f, &mut h);
        }
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
