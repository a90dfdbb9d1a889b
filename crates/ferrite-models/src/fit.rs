//! `fit`: whether a model fits a device's memory, computed from its config and tensor table
//! (`inspect`) without loading the weights — the weights as they would be held there, the
//! step workspace, the KV bytes per token of each KV group, how many tokens the rest of the
//! memory holds and how many sequences of the context length that is at once, and a verdict.
//!
//! The KV sizing follows the engine: every KV group gets the same number of blocks
//! (`EngineConfig::group_blocks`), so a token of context costs the sum of the groups' bytes,
//! and a sequence holds whole blocks of a full-attention group but only its window's worth in
//! a sliding one. Layers that read another layer's KV (Gemma 4's shared layers) cost nothing.

use std::fmt;
use std::str::FromStr;

use ferrite_runtime::cuda::ops::QuantMatrix;
use ferrite_runtime::cuda::{resolve_device, Device, DeviceChoice};
use ferrite_runtime::{DType, KvDtype, KvGroupKind, KvScheme};

/// `--kv-group-size` when not given.
pub const DEFAULT_KV_GROUP_SIZE: usize = 64;

use crate::error::{LoadError, Result};
use crate::inspect::{Format, Inspected, TensorMeta};
use crate::plan::DecoderPlan;

/// A KV cache value type as a device holds it: its name for reports, and the host type of
/// the same size (bf16 counts as f16, two bytes a value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheDtype {
    pub name: &'static str,
    pub dtype: KvDtype,
}

/// `--kv-cache-dtype`: auto (what the device's pools hold by default) or a named type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtypeChoice {
    #[default]
    Auto,
    F16,
    Bf16,
    Fp8,
    Int8,
    Int4,
}

/// The names `--kv-cache-dtype` takes.
const KV_DTYPE_NAMES: &str = "auto, f16, bf16, fp8, int8, int4";

impl FromStr for KvDtypeChoice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<KvDtypeChoice, String> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "auto" => KvDtypeChoice::Auto,
            "f16" | "fp16" => KvDtypeChoice::F16,
            "bf16" => KvDtypeChoice::Bf16,
            "fp8" | "fp8_e4m3" => KvDtypeChoice::Fp8,
            "int8" => KvDtypeChoice::Int8,
            "int4" => KvDtypeChoice::Int4,
            other => return Err(format!("unknown KV cache dtype '{other}' ({KV_DTYPE_NAMES})")),
        })
    }
}

impl KvDtypeChoice {
    /// The type the KV pools of `device` hold, quantized ones in groups of `group` values; an
    /// error for a type the device cannot hold. The CPU holds f16, int8 and int4 (fp8 is
    /// refused there: int8 takes the same bytes and keeps more precision); a GPU holds bf16,
    /// int8, int4 and fp8 (e4m3, compute capability 8.9 and up: the model refuses it below).
    pub fn resolve(self, device: Device, group: usize) -> std::result::Result<KvCacheDtype, String> {
        let is = |name, dtype| Ok(KvCacheDtype { name, dtype });
        match (self, device) {
            (KvDtypeChoice::Auto | KvDtypeChoice::F16, Device::Cpu) => is("f16", KvDtype::F16),
            (KvDtypeChoice::Int8, _) => is("int8", KvDtype::Int8 { group }),
            (KvDtypeChoice::Int4, _) => is("int4", KvDtype::Int4 { group }),
            (KvDtypeChoice::Auto | KvDtypeChoice::Bf16, Device::Cuda(_)) => is("bf16", KvDtype::F16),
            (KvDtypeChoice::Fp8, Device::Cuda(_)) => is("fp8", KvDtype::Fp8),
            (KvDtypeChoice::Bf16, Device::Cpu) => {
                Err("the CPU KV cache holds f16, not bf16 (use auto, f16, int8 or int4 on the CPU)".into())
            }
            (KvDtypeChoice::Fp8, Device::Cpu) => Err("an fp8 KV cache needs a GPU; on the CPU use int8 (the same \
                                                      bytes a value, group-affine)"
                .into()),
            (KvDtypeChoice::F16, Device::Cuda(_)) => {
                Err("the GPU KV cache holds bf16, not f16 (use auto, bf16, int8, int4 or fp8 there)".into())
            }
        }
    }
}

/// Memory a model may use on its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Free for the model: `MemAvailable` on the host, the free device memory on a GPU.
    pub available: usize,
    pub total: usize,
}

/// `MemAvailable` and `MemTotal` of a `/proc/meminfo` text, in bytes.
pub fn parse_meminfo(text: &str) -> Option<DeviceMemory> {
    let field = |key: &str| -> Option<usize> {
        let line = text.lines().find(|l| l.split(':').next() == Some(key))?;
        let kib: usize = line.split(':').nth(1)?.split_whitespace().next()?.parse().ok()?;
        kib.checked_mul(1024)
    };
    Some(DeviceMemory { available: field("MemAvailable")?, total: field("MemTotal")? })
}

/// The memory of `device`: `/proc/meminfo` for the CPU, the driver's query for a GPU (an
/// error saying what is missing when there is none).
pub fn device_memory(device: Device) -> Result<DeviceMemory> {
    match device {
        Device::Cpu => {
            let path = std::path::Path::new("/proc/meminfo");
            let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
            parse_meminfo(&text).ok_or_else(|| LoadError::format(path, "no MemAvailable and MemTotal lines"))
        }
        Device::Cuda(n) => {
            let (available, total) = ferrite_runtime::cuda::device_memory(n)
                .map_err(|e| LoadError::Other(format!("cannot query the memory of cuda:{n}: {e}")))?;
            Ok(DeviceMemory { available, total })
        }
    }
}

/// The device a model of `plan` loads on for `choice`, as `load_on` decides: `auto` takes GPU
/// 0 when there is one and the plan has a CUDA path, the CPU otherwise.
pub fn device_for(plan: &DecoderPlan, choice: DeviceChoice) -> Result<Device> {
    match resolve_device(choice)? {
        Device::Cuda(n) => match crate::gpu::unsupported(plan) {
            None => Ok(Device::Cuda(n)),
            Some(_) if choice == DeviceChoice::Auto => Ok(Device::Cpu),
            Some(why) => Err(LoadError::Other(format!("cannot run this model on cuda:{n}: {why}"))),
        },
        Device::Cpu => Ok(Device::Cpu),
    }
}

/// What the engine would be asked to run.
#[derive(Debug, Clone)]
pub struct FitOptions {
    /// Longest sequence (default: the model's context).
    pub max_model_len: Option<usize>,
    /// Sequences at once.
    pub max_num_seqs: usize,
    /// Query tokens per step (sizes the workspace).
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub kv_dtype: KvDtypeChoice,
    /// Values per scale and bias of a quantized KV type (`--kv-group-size`).
    pub kv_group_size: usize,
    /// A fixed KV cache size (`--kv-cache-memory`); default: what the memory leaves.
    pub kv_cache_memory: Option<usize>,
    /// Fraction of the GPU's free memory left after weights and workspace the KV takes.
    pub gpu_memory_utilization: f32,
}

impl Default for FitOptions {
    fn default() -> Self {
        FitOptions {
            max_model_len: None,
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            block_size: 16,
            kv_dtype: KvDtypeChoice::Auto,
            kv_group_size: DEFAULT_KV_GROUP_SIZE,
            kv_cache_memory: None,
            gpu_memory_utilization: 0.9,
        }
    }
}

/// One KV group: how it keeps positions, how many layers own KV in it, bytes per token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroupFit {
    pub kind: KvGroupKind,
    pub layers: usize,
    /// Bytes a token of context takes; for the recurrent group, bytes of one sequence's state.
    pub bytes_per_token: usize,
}

/// The one-line outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// `max_num_seqs` sequences of `max_model_len` tokens fit at once.
    Fits,
    /// Fewer sequences of that length fit at once than asked for (at least one).
    Limited,
    /// Not one sequence of `max_model_len` tokens fits in the KV cache.
    ContextTooLong,
    /// Weights, workspace (and a fixed KV cache) exceed the memory.
    NoRoom,
}

/// The estimate.
#[derive(Debug, Clone)]
pub struct Fit {
    pub device: Device,
    pub memory: DeviceMemory,
    pub format: Format,
    pub kv_dtype: KvCacheDtype,
    /// Bytes of the weights as held on the device.
    pub weights: usize,
    /// Bytes of one step's buffers (activations of `max_num_batched_tokens` tokens, logits of
    /// `max_num_seqs` rows; on a GPU also the GEMM workspace and dequantization scratch).
    pub workspace: usize,
    pub groups: Vec<KvGroupFit>,
    /// Layers that read another layer's KV.
    pub shared_layers: usize,
    pub block_size: usize,
    /// Bytes given to the KV cache, and whether they were fixed (`--kv-cache-memory`).
    pub kv_budget: usize,
    pub kv_fixed: bool,
    /// Blocks of each group.
    pub kv_blocks: usize,
    /// Positions a full-attention group holds (None: every group slides, no bound).
    pub kv_tokens: Option<usize>,
    pub max_model_len: usize,
    /// Sequences of `max_model_len` tokens the cache holds at once, at most `max_num_seqs`.
    pub rows: usize,
    pub max_num_seqs: usize,
    pub verdict: Verdict,
}

/// Bytes of `t` as the device holds it: as stored on the CPU (mapped), but FP8 matrices
/// dequantized to the checkpoint's float type (`float_bytes` a value); on a
/// GPU, vectors as f32, matrices in a block type its kernels read as stored, FP8 matrices (dense
/// projections and routed experts alike) as their codes plus a 16-byte word of scale runs per
/// row and 512 columns (`fp8_scale_bytes`), every other matrix as bf16.
fn held_bytes(t: &TensorMeta, device: Device, float_bytes: usize) -> usize {
    match device {
        Device::Cpu if t.dtype == DType::F8E4M3 => t.numel() * float_bytes,
        Device::Cpu => t.stored_bytes(),
        Device::Cuda(_) if t.dtype == DType::F8E4M3 => t.numel() + fp8_scale_bytes(&t.shape),
        Device::Cuda(_) if t.shape.len() <= 1 => t.numel() * 4,
        Device::Cuda(_) if t.dtype.is_quantized() && QuantMatrix::supports(t.dtype) => t.stored_bytes(),
        Device::Cuda(_) => t.numel() * 2,
    }
}

/// Bytes of a value of the checkpoint's float type (that of its largest float matrix, the
/// embedding), which the CPU dequantizes FP8 matrices to; bf16 without one.
fn float_bytes(m: &Inspected) -> usize {
    let floats =
        m.tensors.iter().filter(|t| t.shape.len() == 2 && matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16));
    floats.max_by_key(|t| t.numel()).and_then(|t| t.dtype.row_bytes(1).ok()).unwrap_or(2)
}

/// Scale bytes the device holds beside the codes of an FP8 matrix of `shape`: a 16-byte word
/// (4 runs of 128 columns: the block-scaled checkpoints' scales as the routed experts' rows
/// hold them) per row and 512 columns; a scale a row takes less.
fn fp8_scale_bytes(shape: &[usize]) -> usize {
    let cols = shape.last().copied().unwrap_or(1);
    let rows = shape.iter().product::<usize>() / cols.max(1);
    rows * 16 * cols.div_ceil(512)
}

/// cuBLASLt's workspace (`ferrite_runtime::cuda::blas`).
const GEMM_WORKSPACE: usize = 32 << 20;

/// One step's buffers on `device` for `tokens` query tokens and `rows` rows.
fn workspace_bytes(m: &Inspected, device: Device, tokens: usize, rows: usize) -> usize {
    let (cfg, plan) = (&m.cfg, &m.plan);
    let d = cfg.hidden_size;
    let rows = rows.max(1);
    let tokens = tokens.max(rows);
    let widest = |f: &dyn Fn(&crate::plan::LayerPlan) -> usize| plan.layers.iter().map(f).max().unwrap_or(0);
    let qkv = widest(&|l| (l.attn.params.n_heads + 2 * l.attn.params.n_kv_heads) * l.attn.params.head_dim);
    let attn = widest(&|l| l.attn.params.n_heads * l.attn.params.head_dim);
    let inter = widest(&|l| l.ffn.intermediate);
    // Residual and normed streams, q/k/v, attention output, its projection, gate+up, activation.
    let mut per_token = 3 * d + qkv + attn + 3 * inter;
    if let Some(moe) = plan.layers.iter().find_map(|l| l.ffn.moe.as_ref().map(|m| m.shape)) {
        per_token += 3 * d + moe.num_experts + moe.top_k * (2 * d + 3 * moe.intermediate);
    }
    if let Some((_, width)) = plan.per_layer_input {
        per_token += 2 * plan.layers.len() * width + 2 * width;
    }
    let logits = rows * cfg.vocab_size * 4;
    match device {
        Device::Cpu => tokens * per_token * 4 + logits,
        Device::Cuda(_) => {
            // The larger-batch GEMMs dequantize the largest quantized (or FP8) layer matrix to
            // bf16.
            let dequant = m
                .tensors
                .iter()
                .filter(|t| t.shape.len() == 2 && (t.dtype.is_quantized() || t.dtype == DType::F8E4M3))
                .filter(|t| t.shape[0] != cfg.vocab_size)
                .map(|t| t.numel() * 2)
                .max()
                .unwrap_or(0);
            tokens * per_token * 2 + logits + GEMM_WORKSPACE + dequant
        }
    }
}

/// The fit of `m` on `device`, whose memory is `memory`, run as `opts` says.
pub fn fit(m: &Inspected, device: Device, memory: DeviceMemory, opts: &FitOptions) -> Result<Fit> {
    let bs = opts.block_size;
    if bs == 0 || opts.max_num_seqs == 0 {
        return Err(LoadError::Other("block size and --max-num-seqs must be at least 1".into()));
    }
    let u = opts.gpu_memory_utilization;
    if !(u > 0.0 && u <= 1.0) {
        return Err(LoadError::Other(format!("--gpu-memory-utilization must be in (0, 1], got {u}")));
    }
    let context = m.cfg.max_context();
    let max_model_len = opts.max_model_len.unwrap_or(context).min(context);
    if max_model_len == 0 {
        return Err(LoadError::Other("--max-model-len must be at least 1".into()));
    }
    let kv_dtype = opts.kv_dtype.resolve(device, opts.kv_group_size).map_err(LoadError::Other)?;
    let float = float_bytes(m);
    let weights: usize = m.tensors.iter().map(|t| held_bytes(t, device, float)).sum();
    let workspace = workspace_bytes(m, device, opts.max_num_batched_tokens, opts.max_num_seqs);
    let layout = &m.plan.layout;
    let scheme = KvScheme { dtype: kv_dtype.dtype, ..KvScheme::default() };
    // Per token of a 16-slot block (an fp8 block's per-head scales spread over its slots).
    let dtypes = layout.layer_dtypes(&scheme).map_err(|e| LoadError::Other(e.to_string()))?;
    let per_token: Vec<usize> = layout.block_bytes_with(16, &dtypes).iter().map(|b| b.div_ceil(16)).collect();
    let groups: Vec<KvGroupFit> = layout
        .groups
        .iter()
        .enumerate()
        .map(|(g, &kind)| KvGroupFit {
            kind,
            layers: match kind {
                KvGroupKind::Recurrent => layout.states.len(),
                _ => layout.layers.iter().filter(|l| l.group == g).count(),
            },
            bytes_per_token: per_token[g],
        })
        .collect();
    // A recurrent group's state does not grow with the context: each sequence holds about
    // two (the one it reads and the one it writes), off the top of the budget.
    let recurrent = layout.recurrent_group();
    let state_bytes = recurrent.map_or(0, |g| per_token[g]);
    let left = memory.available.saturating_sub(weights + workspace);
    let kv_budget = match (opts.kv_cache_memory, device) {
        (Some(bytes), _) => bytes,
        (None, Device::Cpu) => left,
        (None, Device::Cuda(_)) => (left as f64 * u as f64) as usize,
    };
    let per_block: usize =
        per_token.iter().enumerate().filter(|&(g, _)| Some(g) != recurrent).map(|(_, b)| b).sum::<usize>() * bs;
    let kv_blocks = kv_budget.saturating_sub(2 * state_bytes * opts.max_num_seqs) / per_block.max(1);
    let full = groups.iter().any(|g| g.kind == KvGroupKind::Full);
    let kv_tokens = full.then_some(kv_blocks * bs);
    let seq_blocks = max_model_len.div_ceil(bs);
    let row_blocks = groups
        .iter()
        .map(|g| match g.kind {
            KvGroupKind::Full => seq_blocks,
            KvGroupKind::Sliding { window } => seq_blocks.min(window.div_ceil(bs) + 1),
            KvGroupKind::Recurrent => 0,
        })
        .max()
        .unwrap_or(0);
    let rows = kv_blocks.checked_div(row_blocks).unwrap_or(usize::MAX).min(opts.max_num_seqs);
    let needed = weights + workspace + opts.kv_cache_memory.unwrap_or(0);
    let verdict = if needed > memory.available || kv_blocks == 0 {
        Verdict::NoRoom
    } else if rows == 0 {
        Verdict::ContextTooLong
    } else if rows < opts.max_num_seqs {
        Verdict::Limited
    } else {
        Verdict::Fits
    };
    Ok(Fit {
        device,
        memory,
        format: m.format,
        kv_dtype,
        weights,
        workspace,
        groups,
        shared_layers: m.plan.layers.len() - layout.layers.len() - layout.states.len(),
        block_size: bs,
        kv_budget,
        kv_fixed: opts.kv_cache_memory.is_some(),
        kv_blocks,
        kv_tokens,
        max_model_len,
        rows,
        max_num_seqs: opts.max_num_seqs,
        verdict,
    })
}

/// Bytes for people: binary units, three significant digits.
pub fn human_bytes(n: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{n} B"),
        _ if v >= 100.0 => format!("{v:.0} {}", UNITS[unit]),
        _ if v >= 10.0 => format!("{v:.1} {}", UNITS[unit]),
        _ => format!("{v:.2} {}", UNITS[unit]),
    }
}

impl Fit {
    /// Bytes one token of context costs in the cache (every group holds the same blocks).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.groups.iter().filter(|g| g.kind != KvGroupKind::Recurrent).map(|g| g.bytes_per_token).sum()
    }

    /// The one-line verdict.
    pub fn verdict_line(&self) -> String {
        let (len, rows, asked) = (self.max_model_len, self.rows, self.max_num_seqs);
        match self.verdict {
            Verdict::Fits => format!("fits: {asked} sequences of {len} tokens at once on {}", self.device),
            Verdict::Limited => format!(
                "fits {rows} sequence{} of {len} tokens at once on {} ({asked} asked for: {} for more)",
                if rows == 1 { "" } else { "s" },
                self.device,
                if self.kv_fixed {
                    "raise --kv-cache-memory or lower --max-model-len"
                } else {
                    "lower --max-model-len"
                }
            ),
            Verdict::ContextTooLong => match self.kv_tokens {
                Some(tokens) => format!(
                    "does not fit at this context: the KV cache holds {tokens} tokens, less than one {len}-token \
                     sequence (--max-model-len {tokens} would fit one)"
                ),
                None => format!(
                    "does not fit: the KV cache's {} blocks are fewer than one sequence's window needs",
                    self.kv_blocks
                ),
            },
            Verdict::NoRoom => format!(
                "does not fit: weights {} + workspace {}{} need more than the {} available on {}",
                human_bytes(self.weights),
                human_bytes(self.workspace),
                if self.kv_budget > 0 && self.kv_blocks > 0 {
                    format!(" + KV cache {}", human_bytes(self.kv_budget))
                } else {
                    String::new()
                },
                human_bytes(self.memory.available),
                self.device
            ),
        }
    }
}

impl fmt::Display for Fit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = human_bytes;
        let what = match self.device {
            Device::Cpu => "available",
            Device::Cuda(_) => "free",
        };
        writeln!(f, "device     {}: {} {what} of {}", self.device, h(self.memory.available), h(self.memory.total))?;
        let held = match (self.format, self.device) {
            (_, Device::Cpu) => "as stored, memory-mapped",
            (Format::Gguf, Device::Cuda(_)) => "quantized blocks the kernels read kept, the rest bf16",
            (Format::Safetensors, Device::Cuda(_)) => "bf16; MLX-quantized blocks and FP8 codes kept as stored",
        };
        writeln!(f, "weights    {} ({held})", h(self.weights))?;
        writeln!(f, "workspace  {}", h(self.workspace))?;
        let kinds: Vec<String> = self
            .groups
            .iter()
            .map(|g| {
                let kind = match g.kind {
                    KvGroupKind::Full => "full attention".to_string(),
                    KvGroupKind::Sliding { window } => format!("sliding window {window}"),
                    KvGroupKind::Recurrent => {
                        return format!("recurrent state, {} layers: {} a sequence", g.layers, h(g.bytes_per_token))
                    }
                };
                format!("{kind}, {} layers: {}", g.layers, h(g.bytes_per_token))
            })
            .collect();
        let shared = match self.shared_layers {
            0 => String::new(),
            n => format!("; {n} layers read another layer's KV"),
        };
        writeln!(
            f,
            "KV cache   {}: {} per token ({}{shared})",
            self.kv_dtype.name,
            h(self.kv_bytes_per_token()),
            kinds.join("; ")
        )?;
        let tokens = self.kv_tokens.map_or("any number of".to_string(), |t| t.to_string());
        writeln!(f, "           {} for the KV cache: {tokens} tokens", h(self.kv_budget))?;
        write!(f, "verdict    {}", self.verdict_line())
    }
}
