//! `load`: from a path (HF model directory or `.gguf` file) to a ready model with its
//! tokenizer, chat template and generation defaults, on the CPU or a CUDA device; and
//! `synthetic`: a model of a named real shape with random weights made on the device.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use crate::chat_template::{ChatTemplate, ModelChatTemplates};
use crate::config::{ConfigSource, ModelConfig};
use crate::decoder::Decoder;
use crate::embedding::EmbeddingHead;
use crate::error::{LoadError, Result};
use crate::fp8::Fp8Quantization;
use crate::gguf::GgufFile;
use crate::mlx::MlxQuantization;
use crate::model::CausalLm;
use crate::plan::DecoderPlan;
use crate::random_weights::RandomWeights;
use crate::safetensors::SafetensorsDir;
use crate::tokenizer::Tokenizer;
use crate::weights::{WeightLayout, WeightSource, Weights};
use ferrite_runtime::cuda::{resolve_device, Device, DeviceChoice, Gpu};
use ferrite_runtime::DType;

/// Sampling defaults a model ships in `generation_config.json`.
#[derive(Debug, Clone, Default)]
pub struct GenerationDefaults {
    /// `do_sample`: false (or absent, transformers' default) means greedy decoding whatever
    /// the other values say.
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
    pub eos_token_ids: Vec<u32>,
}

impl GenerationDefaults {
    /// The temperature a request that names none takes from the model, read as transformers
    /// reads the config: the config's temperature (1.0 when it gives none) only when
    /// `do_sample` is true, none otherwise (a greedy config's temperature is never used).
    /// Its top-k, top-p and repetition penalty apply as they stand; the first two matter only
    /// when sampling.
    pub fn sampling_temperature(&self) -> Option<f32> {
        (self.do_sample == Some(true)).then(|| self.temperature.unwrap_or(1.0))
    }
}

pub struct LoadedModel {
    pub model: Arc<dyn CausalLm>,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub chat_template: Option<ChatTemplate>,
    pub generation: GenerationDefaults,
    /// Bytes of the weight files (mapped, not copied), or of the weights on the device.
    pub weight_bytes: usize,
    pub load_secs: f64,
    /// Where the model runs.
    pub device: Device,
    /// How the device was set up (its name and how the kernels were obtained), for reports.
    pub device_note: String,
}

impl LoadedModel {
    /// Every token id that ends generation: config, generation_config and tokenizer EOS sets.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let mut ids = self.model.config().eos_token_ids.clone();
        ids.extend(&self.generation.eos_token_ids);
        if let Some(t) = &self.tokenizer {
            ids.extend(t.eos_token_ids());
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// Ways to load a model other than as published.
#[derive(Debug, Clone, Copy, Default)]
pub struct LoadOptions {
    /// Keep only the first this many decoder layers: a deliberately weakened model (a draft
    /// that disagrees with its full self, for speculative-decoding tests and benchmarks).
    pub max_layers: Option<usize>,
    /// Convert bf16 weights at load (`--quantization fp8`: each layer projection and routed
    /// expert to FP8 per output channel; CUDA only).
    pub quantization: crate::gpu::UploadQuantization,
}

impl LoadOptions {
    fn apply(&self, path: &Path, cfg: &mut ModelConfig) -> Result<()> {
        if let Some(n) = self.max_layers {
            if n == 0 || n > cfg.num_layers {
                return Err(LoadError::format(
                    path,
                    format!("cannot keep {n} of the model's {} layers", cfg.num_layers),
                ));
            }
            cfg.num_layers = n;
        }
        Ok(())
    }
}

/// Load the model at `path` on the CPU.
pub fn load(path: &Path) -> Result<LoadedModel> {
    load_with(path, DeviceChoice::Cpu, &LoadOptions::default())
}

/// Load the model at `path` on the device `choice` names. `auto` takes CUDA device 0 when
/// there is one and the architecture has a CUDA path, the CPU otherwise (saying why on
/// stderr when a GPU was there); an explicit `cuda` that cannot run the model is an error.
pub fn load_on(path: &Path, choice: DeviceChoice) -> Result<LoadedModel> {
    load_with(path, choice, &LoadOptions::default())
}

/// `load_on` with `opts`.
pub fn load_with(path: &Path, choice: DeviceChoice, opts: &LoadOptions) -> Result<LoadedModel> {
    let t0 = Instant::now();
    let target = Target::resolve(choice)?;
    let mut loaded = if path.is_dir() {
        load_hf_dir(path, &target, opts)?
    } else if path.is_file() {
        load_gguf(path, &target, opts)?
    } else {
        return Err(LoadError::format(path, "no such model directory or .gguf file"));
    };
    loaded.load_secs = t0.elapsed().as_secs_f64();
    Ok(loaded)
}

/// A synthetic model (`gpu::SYNTHETIC_MODELS`) with random weights in `dtype` from `seed`: on
/// a CUDA device, generated there (bf16, or a block type the CUDA kernels read); on the CPU,
/// made on the host (bf16, f16, f32, the GGUF types the fast kernels read, every MLX format).
/// No tokenizer (the CLI attaches its family's, `ferrite-cli/src/synthetic_text.rs`).
pub fn synthetic(name: &str, choice: DeviceChoice, seed: u64, dtype: DType) -> Result<LoadedModel> {
    let t0 = Instant::now();
    let json = crate::gpu::synthetic_config(name).ok_or_else(|| {
        LoadError::Other(format!(
            "unknown synthetic model '{name}' (known: {})",
            crate::gpu::SYNTHETIC_MODELS.join(", ")
        ))
    })?;
    let device = resolve_device(choice)?;
    let path = Path::new("synthetic/config.json");
    let mut cfg = ModelConfig::from_hf_json(path, &json)?;
    let plan = (cfg.arch.plan)(&mut cfg, &ConfigSource::Hf { path, json: &json })?;
    let (model, weight_bytes, device_note): (Arc<dyn CausalLm>, usize, String) = match device {
        Device::Cuda(ordinal) => {
            let (gpu, device_note) = open_gpu(ordinal)?;
            let weights = crate::gpu::DecoderWeights::random(&cfg, &plan, &gpu, seed, dtype)?;
            let weight_bytes = weights.bytes;
            (Arc::new(crate::gpu::GpuDecoder::new(cfg, plan, weights, gpu)?), weight_bytes, device_note)
        }
        Device::Cpu => {
            let embed_fan_in = if plan.embed_scale.is_some() { cfg.hidden_size } else { 3 };
            let random = RandomWeights::new(dtype, seed, embed_fan_in);
            let weights = Weights::new(WeightSource::Random(random), WeightLayout::default());
            let model = build_cpu(cfg, plan, &weights, None)?;
            (model, weights.file_bytes(), "cpu".into())
        }
    };
    Ok(LoadedModel {
        model,
        tokenizer: None,
        chat_template: None,
        generation: GenerationDefaults::default(),
        weight_bytes,
        load_secs: t0.elapsed().as_secs_f64(),
        device,
        device_note,
    })
}

/// The CUDA executor of the HF model directory `dir` on device `ordinal`, as its concrete type
/// (tests switch its CUDA graphs off and on).
pub fn gpu_decoder(dir: &Path, ordinal: usize) -> Result<crate::gpu::GpuDecoder> {
    let cfg_path = dir.join("config.json");
    let json = read_config(&cfg_path)?;
    let mut cfg = ModelConfig::from_hf_json(&cfg_path, &json)?;
    let plan = (cfg.arch.plan)(&mut cfg, &ConfigSource::Hf { path: &cfg_path, json: &json })?;
    let weights = Weights::new(WeightSource::Safetensors(SafetensorsDir::open(dir)?), layout(&cfg, &plan, false))
        .with_mlx(MlxQuantization::from_config(&cfg_path, &json)?)
        .with_fp8(Fp8Quantization::from_config(&cfg_path, &json)?);
    let (gpu, _) = open_gpu(ordinal)?;
    let quantize = crate::gpu::UploadQuantization::None;
    let w = crate::gpu::DecoderWeights::upload(&cfg, &plan, &weights, &gpu, quantize, &|_| {})?;
    crate::gpu::GpuDecoder::new(cfg, plan, w, gpu)
}

/// Open CUDA device `ordinal`: the device and a note saying what it is and how its kernels
/// were obtained.
fn open_gpu(ordinal: usize) -> Result<(Arc<Gpu>, String)> {
    let gpu = Gpu::new(ordinal)?;
    let (info, r) = (gpu.info(), gpu.compile_report());
    let note = format!(
        "cuda:{ordinal} {} ({} kernel modules compiled, {} cached, {:.2} s, {})",
        info.name, r.compiled, r.cached, r.seconds, r.arch
    );
    Ok((Arc::new(gpu), note))
}

/// The device a load was asked for, resolved.
struct Target {
    choice: DeviceChoice,
    device: Device,
}

impl Target {
    fn resolve(choice: DeviceChoice) -> Result<Target> {
        Ok(Target { choice, device: resolve_device(choice)? })
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| LoadError::format(path, format!("invalid JSON: {e}")))
}

/// A model directory's `config.json`, the text model's part of a multimodal one.
fn read_config(path: &Path) -> Result<Value> {
    read_json(path).map(crate::config::text_config)
}

/// The model on its device, the device and its note.
type Built = (Arc<dyn CausalLm>, Device, String);

/// How the weights of `plan` are stored, in a GGUF file (`gguf`) or an HF directory.
fn layout(cfg: &ModelConfig, plan: &DecoderPlan, gguf: bool) -> WeightLayout {
    let quirks = &cfg.arch.quirks;
    WeightLayout {
        interleaved_rope: plan.interleaved_rope.then_some((
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rope.rotary_dim,
        )),
        unpermute_qk: (gguf && quirks.gguf_unpermute_qk).then_some((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)),
        sandwich_norms: gguf && quirks.gguf_sandwich,
    }
}

/// The model of `plan` (embedding with `embedding`), on the CUDA device when `target`
/// resolved to one and the plan has a CUDA path; a model that embeds runs on the CPU.
fn build(
    cfg: ModelConfig,
    plan: DecoderPlan,
    weights: &Weights,
    target: &Target,
    embedding: Option<EmbeddingHead>,
    quantize: crate::gpu::UploadQuantization,
) -> Result<Built> {
    if let Device::Cuda(ordinal) = target.device {
        let why = match &embedding {
            Some(_) => Some("embeddings are made on the CPU only".to_string()),
            None => crate::gpu::unsupported(&plan),
        };
        match why {
            None => {
                let (gpu, note) = open_gpu(ordinal)?;
                let bar = LoadBar::new(weights.file_bytes(), cfg.num_layers);
                let w =
                    crate::gpu::DecoderWeights::upload(&cfg, &plan, weights, &gpu, quantize, &|n| bar.layer_done(n))?;
                bar.finish();
                let model = Arc::new(crate::gpu::GpuDecoder::new(cfg, plan, w, gpu)?);
                return Ok((model, target.device, note));
            }
            Some(why) if target.choice == DeviceChoice::Auto => eprintln!("note: {why}; running on the CPU"),
            Some(why) => return Err(LoadError::Other(format!("cannot run this model on cuda:{ordinal}: {why}"))),
        }
    }
    if quantize != crate::gpu::UploadQuantization::None {
        return Err(LoadError::Other(
            "--quantization fp8 quantizes for a CUDA GPU (compute capability 8.9+); on the CPU run the checkpoint \
             as it is, or a GGUF or MLX quantization"
                .into(),
        ));
    }
    if let Some(float) = weights.fp8_dequantized_to() {
        eprintln!("note: FP8 weights are dequantized to {float} on the CPU (FP8 products need a CUDA GPU)");
    }
    Ok((build_cpu(cfg, plan, weights, embedding)?, Device::Cpu, "cpu".into()))
}

/// The loading progress bar, in bytes of weights (each layer counted as an equal share); drawn
/// only when stderr is a terminal.
struct LoadBar {
    bar: indicatif::ProgressBar,
    bytes: u64,
    layers: u64,
}

impl LoadBar {
    fn new(bytes: usize, layers: usize) -> LoadBar {
        use std::io::IsTerminal;
        let bar = if std::io::stderr().is_terminal() {
            indicatif::ProgressBar::new(bytes as u64).with_style(
                indicatif::ProgressStyle::with_template("loading {bar:30} {bytes}/{total_bytes}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            )
        } else {
            indicatif::ProgressBar::hidden()
        };
        LoadBar { bar, bytes: bytes as u64, layers: layers.max(1) as u64 }
    }

    /// `n` layers are loaded.
    fn layer_done(&self, n: usize) {
        self.bar.set_position(self.bytes * (n as u64).min(self.layers) / self.layers);
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

fn build_cpu(
    cfg: ModelConfig,
    plan: DecoderPlan,
    weights: &Weights,
    embedding: Option<EmbeddingHead>,
) -> Result<Arc<dyn CausalLm>> {
    let bar = LoadBar::new(weights.file_bytes(), cfg.num_layers);
    let model = Decoder::load(cfg, plan, weights, &|n| bar.layer_done(n))?.with_embedding(embedding);
    bar.finish();
    Ok(Arc::new(model))
}

fn load_hf_dir(dir: &Path, target: &Target, opts: &LoadOptions) -> Result<LoadedModel> {
    let cfg_path = dir.join("config.json");
    if !cfg_path.is_file() {
        return Err(LoadError::format(dir, "not a model directory: config.json is missing"));
    }
    let json = read_config(&cfg_path)?;
    let mut cfg = ModelConfig::from_hf_json(&cfg_path, &json)?;
    opts.apply(dir, &mut cfg)?;
    let plan = (cfg.arch.plan)(&mut cfg, &ConfigSource::Hf { path: &cfg_path, json: &json })?;
    let weights = Weights::new(WeightSource::Safetensors(SafetensorsDir::open(dir)?), layout(&cfg, &plan, false))
        .with_mlx(MlxQuantization::from_config(&cfg_path, &json)?)
        .with_fp8(Fp8Quantization::from_config(&cfg_path, &json)?);
    let embedding = EmbeddingHead::from_model_dir(dir, &json, cfg.hidden_size, plan.causal())?;
    if embedding.is_none() && !plan.causal() {
        return Err(LoadError::format(dir, "a bidirectional model needs a pooling config (modules.json) to embed"));
    }
    let (model, device, device_note) = build(cfg, plan, &weights, target, embedding, opts.quantization)?;
    let ModelText { tokenizer, chat_template, generation } = hf_text(dir)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template,
        generation,
        weight_bytes: weights.file_bytes(),
        load_secs: 0.0,
        device,
        device_note,
    })
}

/// What a model's files say about its text, without its weights: the tokenizer, the chat
/// template and the generation defaults (a process that serves a model another process runs
/// needs these and nothing else).
#[derive(Clone)]
pub struct ModelText {
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub chat_template: Option<ChatTemplate>,
    pub generation: GenerationDefaults,
}

/// The `ModelText` of the HF directory or `.gguf` file at `path`.
pub fn load_text(path: &Path) -> Result<ModelText> {
    if path.is_dir() {
        hf_text(path)
    } else if path.is_file() {
        gguf_text(path, &GgufFile::open(path)?)
    } else {
        Err(LoadError::format(path, "no such model directory or .gguf file"))
    }
}

fn hf_text(dir: &Path) -> Result<ModelText> {
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = if tok_path.is_file() { Some(Arc::new(Tokenizer::from_file(&tok_path)?)) } else { None };
    let templates = ModelChatTemplates::from_model_dir(dir).map_err(|e| LoadError::format(dir, e.to_string()))?;
    let chat_template = match templates.default {
        Some(_) => Some(templates.compile(None).map_err(|e| LoadError::format(dir, format!("chat template: {e}")))?),
        None => None,
    };
    let gen_path = dir.join("generation_config.json");
    let generation =
        if gen_path.is_file() { generation_defaults(&read_json(&gen_path)?) } else { GenerationDefaults::default() };
    Ok(ModelText { tokenizer, chat_template, generation })
}

fn gguf_text(path: &Path, g: &GgufFile) -> Result<ModelText> {
    let tokenizer = Tokenizer::from_gguf(g)?;
    let chat_template = match g.get_str("tokenizer.chat_template") {
        Some(src) => Some(
            ChatTemplate::new(src, tokenizer.bos_token().map(String::from), tokenizer.eos_token().map(String::from))
                .map_err(|e| LoadError::format(path, format!("chat template: {e}")))?,
        ),
        None => None,
    };
    Ok(ModelText { tokenizer: Some(Arc::new(tokenizer)), chat_template, generation: gguf_generation_defaults(g) })
}

fn generation_defaults(v: &Value) -> GenerationDefaults {
    let f = |k: &str| v.get(k).and_then(Value::as_f64).map(|x| x as f32);
    let eos = match v.get("eos_token_id") {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => vec![],
    };
    GenerationDefaults {
        do_sample: v.get("do_sample").and_then(Value::as_bool),
        temperature: f("temperature"),
        top_p: f("top_p"),
        top_k: v.get("top_k").and_then(Value::as_u64).map(|x| x as usize),
        repetition_penalty: f("repetition_penalty"),
        eos_token_ids: eos,
    }
}

/// The sampling a GGUF file recommends: the `general.sampling.*` keys converters copy from the
/// model's generation config (llama.cpp reads the same); their presence means the author
/// samples. A top-k of 0 or below is no cut.
fn gguf_generation_defaults(g: &GgufFile) -> GenerationDefaults {
    let f = |k: &str| g.get_f64(&format!("general.sampling.{k}")).map(|v| v as f32);
    let top_k = g.get("general.sampling.top_k").and_then(|v| v.as_i64()).map(|k| k.max(0) as usize);
    let (temperature, top_p) = (f("temp"), f("top_p"));
    let samples = temperature.is_some() || top_p.is_some() || top_k.is_some();
    GenerationDefaults {
        do_sample: samples.then_some(true),
        temperature,
        top_p,
        top_k,
        repetition_penalty: f("penalty_repeat"),
        eos_token_ids: vec![],
    }
}

fn load_gguf(path: &Path, target: &Target, opts: &LoadOptions) -> Result<LoadedModel> {
    let g = GgufFile::open(path)?;
    let mut cfg = ModelConfig::from_gguf(&g)?;
    opts.apply(path, &mut cfg)?;
    let ModelText { tokenizer, chat_template, generation } = gguf_text(path, &g)?;
    let plan = (cfg.arch.plan)(&mut cfg, &ConfigSource::Gguf(&g))?;
    let layout = layout(&cfg, &plan, true);
    let weights = Weights::new(WeightSource::Gguf(g), layout);
    let (model, device, device_note) = build(cfg, plan, &weights, target, None, opts.quantization)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template,
        generation,
        weight_bytes: weights.file_bytes(),
        load_secs: 0.0,
        device,
        device_note,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF v3 image with no tensors and `kv` (key, type id, little-endian value bytes).
    fn gguf(kv: &[(&str, u32, Vec<u8>)]) -> GgufFile {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend((kv.len() as u64).to_le_bytes());
        for (key, ty, value) in kv {
            b.extend((key.len() as u64).to_le_bytes());
            b.extend(key.as_bytes());
            b.extend(ty.to_le_bytes());
            b.extend(value);
        }
        b.resize(b.len().div_ceil(32) * 32, 0);
        GgufFile::from_bytes(Path::new("sampling.gguf"), &b).unwrap()
    }

    #[test]
    fn gguf_sampling_keys_are_the_model_defaults() {
        let (f32_, i32_) = (6, 5);
        let g = gguf(&[
            ("general.sampling.temp", f32_, 0.6f32.to_le_bytes().to_vec()),
            ("general.sampling.top_k", i32_, (-1i32).to_le_bytes().to_vec()),
            ("general.sampling.penalty_repeat", f32_, 1.5f32.to_le_bytes().to_vec()),
        ]);
        let d = gguf_generation_defaults(&g);
        assert_eq!((d.do_sample, d.temperature, d.top_k, d.top_p), (Some(true), Some(0.6), Some(0), None));
        assert_eq!(d.repetition_penalty, Some(1.5));
        let none = gguf_generation_defaults(&gguf(&[]));
        assert_eq!((none.do_sample, none.temperature, none.repetition_penalty), (None, None, None));
    }
}
