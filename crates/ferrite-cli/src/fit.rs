//! `ferrite fit MODEL`: whether the model fits the device's memory — weights, workspace, KV
//! bytes per token, how many tokens and sequences fit, and a verdict — from its config and
//! tensor table, without loading the weights. `serve` prints the same at start-up.

use std::path::Path;

use anyhow::Result;
use clap::Args;
use ferrite_models::fit::{self, Fit, FitOptions, KvDtypeChoice};
use ferrite_models::inspect::inspect;
use ferrite_runtime::cuda::{Device, DeviceChoice};

#[derive(Args)]
pub struct FitArgs {
    /// A model path, a name, or a Hugging Face repo in the local cache (org/name[@rev][:FILE.gguf]).
    pub model: String,
    /// The device: auto (a CUDA GPU when present and the model has a CUDA path), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Longest sequence, prompt + output (default: the model's context).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Sequences at once.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Query tokens per engine step (sizes the workspace).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// KV cache value type: auto (f16 on the CPU, bf16 on a GPU), f16, bf16, int8 or int4.
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: KvDtypeChoice,
    /// Values per scale and bias of an int8/int4 KV cache.
    #[arg(long, default_value_t = fit::DEFAULT_KV_GROUP_SIZE)]
    pub kv_group_size: usize,
    /// A fixed KV cache size in bytes (default: what the memory leaves).
    #[arg(long)]
    pub kv_cache_memory: Option<usize>,
    /// Fraction of the GPU's free memory, after weights and workspace, the KV cache takes.
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f32,
    /// Positions per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
}

/// The fit of the model at `path` on `choice`'s device under `opts`; on the CPU a KV cache of
/// `cpu_kv` bytes unless `opts` fixes one (what `serve` allocates there).
pub fn estimate(path: &Path, choice: DeviceChoice, mut opts: FitOptions, cpu_kv: Option<usize>) -> Result<Fit> {
    let m = inspect(path)?;
    let device = fit::device_for(&m.plan, choice)?;
    if device == Device::Cpu && opts.kv_cache_memory.is_none() {
        opts.kv_cache_memory = cpu_kv;
    }
    let memory = fit::device_memory(device)?;
    Ok(fit::fit(&m, device, memory, &opts)?)
}

pub fn fit(args: FitArgs) -> Result<()> {
    let path = crate::model_arg::resolve(&args.model)?;
    let opts = FitOptions {
        max_model_len: args.max_model_len,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        block_size: args.block_size,
        kv_dtype: args.kv_cache_dtype,
        kv_group_size: args.kv_group_size,
        kv_cache_memory: args.kv_cache_memory,
        gpu_memory_utilization: args.gpu_memory_utilization,
    };
    let f = estimate(&path, args.device, opts, None)?;
    println!("model      {}", path.display());
    println!("{f}");
    Ok(())
}
