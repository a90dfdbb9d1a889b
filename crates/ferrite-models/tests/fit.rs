//! `fit` against hand-computed numbers for fixture configs: weights as held on each device,
//! workspace, KV bytes per token per group (full, sliding, shared layers), tokens and
//! sequences that fit, and each verdict.

use std::path::Path;

use ferrite_models::fit::{fit, parse_meminfo, DeviceMemory, FitOptions, KvDtypeChoice, Verdict};
use ferrite_models::inspect::inspect;
use ferrite_runtime::cuda::Device;
use ferrite_runtime::{KvDtype, KvGroupKind};

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

const MIB: usize = 1 << 20;

fn memory(available: usize) -> DeviceMemory {
    DeviceMemory { available, total: 2 * available }
}

/// The `llama` fixture: vocab 307, hidden 64, MLP 136, 2 layers, 4 heads of 16, 2 KV heads,
/// context 256, untied, f32.
#[test]
fn llama_fixture_by_hand() {
    let m = inspect(&fixture("llama")).unwrap();
    // Per layer q 64·64, k and v 32·64, o 64·64, gate and up 136·64, down 64·136, two norms
    // of 64: 38,528 values; embeddings and LM head 307·64 each; the final norm 64.
    let numel = 2 * 38_528 + 2 * 307 * 64 + 64;
    assert_eq!(numel, 116_416);
    let opts = FitOptions::default();
    let f = fit(&m, Device::Cpu, memory(100 * MIB), &opts).unwrap();
    assert_eq!(f.weights, numel * 4, "f32, as stored");
    // 2 layers × (K + V) × 2 KV heads × 16 × 2 bytes (f16).
    assert_eq!(f.groups.len(), 1);
    assert_eq!((f.groups[0].kind, f.groups[0].layers, f.groups[0].bytes_per_token), (KvGroupKind::Full, 2, 256));
    assert_eq!(f.kv_dtype.name, "f16");
    // 2,048 tokens × (3·64 + q/k/v 128 + attention 64 + 3·136) f32 values, and 64 rows of
    // 307 f32 logits.
    assert_eq!(f.workspace, 2048 * 792 * 4 + 64 * 307 * 4);
    assert_eq!(f.workspace, 6_566_656);
    let left = 100 * MIB - 465_664 - 6_566_656;
    assert_eq!(f.kv_budget, left);
    assert_eq!(f.kv_blocks, left / (256 * 16));
    assert_eq!(f.kv_tokens, Some(23_883 * 16));
    assert_eq!(f.max_model_len, 256);
    assert_eq!((f.rows, f.verdict), (64, Verdict::Fits));
    assert!(f.verdict_line().starts_with("fits: 64 sequences of 256 tokens"), "{}", f.verdict_line());

    // 2,000 rows of logits take 2,456,000 bytes of workspace; the 23,302 blocks left hold
    // 1,456 sequences of 16 blocks, fewer than asked for.
    let f = fit(&m, Device::Cpu, memory(100 * MIB), &FitOptions { max_num_seqs: 2000, ..opts.clone() }).unwrap();
    assert_eq!(f.workspace, 2048 * 792 * 4 + 2000 * 307 * 4);
    assert_eq!((f.kv_blocks, f.rows, f.verdict), (23_302, 1456, Verdict::Limited));
    // A fixed 10-block cache holds 160 tokens, not one 256-token sequence.
    let small = FitOptions { kv_cache_memory: Some(10 * 4096), ..opts.clone() };
    let f = fit(&m, Device::Cpu, memory(100 * MIB), &small).unwrap();
    assert_eq!((f.kv_tokens, f.rows, f.verdict), (Some(160), 0, Verdict::ContextTooLong));
    assert!(f.verdict_line().contains("--max-model-len 160"), "{}", f.verdict_line());
    let f = fit(&m, Device::Cpu, memory(100 * MIB), &FitOptions { max_model_len: Some(160), ..small }).unwrap();
    assert_eq!((f.rows, f.verdict), (1, Verdict::Limited));
    // 6 MiB do not hold the workspace.
    let f = fit(&m, Device::Cpu, memory(6 * MIB), &opts).unwrap();
    assert_eq!(f.verdict, Verdict::NoRoom);
    assert!(f.verdict_line().starts_with("does not fit: weights 455 KiB + workspace 6.26 MiB"), "{}", f.verdict_line());
}

#[test]
fn llama_fixture_on_a_gpu() {
    let m = inspect(&fixture("llama")).unwrap();
    let f = fit(&m, Device::Cuda(0), memory(1 << 30), &FitOptions::default()).unwrap();
    // Five norm vectors of 64 stay f32, the matrices become bf16.
    assert_eq!(f.weights, 5 * 64 * 4 + (116_416 - 5 * 64) * 2);
    assert_eq!(f.kv_dtype.name, "bf16");
    assert_eq!(f.groups[0].bytes_per_token, 256);
    // bf16 activations, f32 logits, cuBLASLt's 32 MiB; no quantized matrix to dequantize.
    assert_eq!(f.workspace, 2048 * 792 * 2 + 64 * 307 * 4 + (32 << 20));
    let left = (1 << 30) - f.weights - f.workspace;
    // --gpu-memory-utilization is an f32.
    assert_eq!(f.kv_budget, (left as f64 * f64::from(0.9f32)) as usize);
}

/// `fp8-qwen3-moe-block`: vocab 307, hidden 128, 2 layers of q/k/v/o (128, 64, 64 and 128
/// rows) and 4 experts of 32 (gate and up 32 × 128, down 128 × 32), all FP8 with 64 × 64
/// block scales; the embedding, LM head, routers and norms f32.
#[test]
fn fp8_experts_by_hand() {
    let m = inspect(&fixture("fp8-qwen3-moe-block")).unwrap();
    // FP8 codes a layer: attention 49,152, experts 4 × 3 × 4,096; the scale grids (2 × 2 for q
    // and o, 1 × 2 for k and v and gate and up, 2 × 1 for down) 36 values; the router 4 × 128;
    // norms 128 + 128 + 32 + 32 a layer and 128 more.
    let (codes, grids, router, vectors) = (49_152 + 4 * 3 * 4_096, 36, 4 * 128, 2 * 320 + 128);
    let embed = 2 * 307 * 128;
    // The CPU dequantizes the codes to the checkpoint's f32 and maps the rest as stored (f32).
    let f = fit(&m, Device::Cpu, memory(100 * MIB), &FitOptions::default()).unwrap();
    assert_eq!(f.weights, 4 * (2 * (codes + grids + router) + embed + vectors));
    // The GPU holds each code in a byte, plus a 16-byte word of scale runs a row (q and o 128
    // rows, k and v 64; each expert's gate and up 32, down 128), the other matrices in bf16.
    let f = fit(&m, Device::Cuda(0), memory(1 << 30), &FitOptions::default()).unwrap();
    let scale_words = 16 * (128 + 64 + 64 + 128 + 4 * (32 + 32 + 128));
    assert_eq!(f.weights, 2 * (codes + scale_words + 2 * (grids + router)) + 2 * embed + 4 * vectors);
    assert_eq!(f.weights, 395_920);
}

/// `gemma3`: 3 layers (sliding window 8, sliding, full), 2 KV heads of 16.
#[test]
fn sliding_window_groups() {
    let m = inspect(&fixture("gemma3")).unwrap();
    let opts = FitOptions { kv_cache_memory: Some(100 * 384 * 16), ..FitOptions::default() };
    let f = fit(&m, Device::Cpu, memory(100 * MIB), &opts).unwrap();
    let groups: Vec<_> = f.groups.iter().map(|g| (g.kind, g.layers, g.bytes_per_token)).collect();
    assert_eq!(groups, [(KvGroupKind::Full, 1, 128), (KvGroupKind::Sliding { window: 8 }, 2, 256)]);
    assert_eq!(f.kv_bytes_per_token(), 384);
    // Every group gets the 100 blocks; a 256-token sequence takes 16 full blocks (the sliding
    // group only 2), so 6 fit.
    assert_eq!((f.kv_blocks, f.kv_tokens, f.rows, f.verdict), (100, Some(1600), 6, Verdict::Limited));
}

/// `gemma4-shared-ple`: 5 layers (sliding, full, sliding, sliding, full; the full ones 32
/// wide, the rest 16), the last 2 reading the KV of earlier layers.
#[test]
fn shared_layers_cost_nothing() {
    let m = inspect(&fixture("gemma4-shared-ple")).unwrap();
    let f = fit(&m, Device::Cpu, memory(100 * MIB), &FitOptions::default()).unwrap();
    assert_eq!(f.shared_layers, 2);
    // Layer 1 owns 2 × 2 × 32 × 2 bytes, layers 0 and 2 each 2 × 2 × 16 × 2.
    let groups: Vec<_> = f.groups.iter().map(|g| (g.kind, g.layers, g.bytes_per_token)).collect();
    assert_eq!(groups, [(KvGroupKind::Full, 1, 256), (KvGroupKind::Sliding { window: 8 }, 2, 256)]);
    assert!(f.to_string().contains("2 layers read another layer's KV"), "{f}");
}

#[test]
fn kv_dtypes() {
    assert_eq!("auto".parse::<KvDtypeChoice>().unwrap(), KvDtypeChoice::Auto);
    let gpu = Device::Cuda(0);
    let d = "BF16".parse::<KvDtypeChoice>().unwrap().resolve(gpu, 64).unwrap();
    assert_eq!((d.name, d.dtype.row_bytes(64)), ("bf16", 128));
    let d = "int8".parse::<KvDtypeChoice>().unwrap().resolve(Device::Cpu, 32).unwrap();
    assert_eq!((d.name, d.dtype), ("int8", KvDtype::Int8 { group: 32 }));
    let err = "fp8".parse::<KvDtypeChoice>().unwrap().resolve(Device::Cpu, 64).unwrap_err();
    assert!(err.contains("fp8 KV cache needs a GPU; on the CPU use int8"), "{err}");
    // The GPU holds int8, int4 and fp8 too (fp8's compute capability is the model's check).
    let d = KvDtypeChoice::Int4.resolve(gpu, 64).unwrap();
    assert_eq!((d.name, d.dtype.row_bytes(64)), ("int4", 32 + 4));
    let d = KvDtypeChoice::Fp8.resolve(gpu, 64).unwrap();
    assert_eq!((d.name, d.dtype, d.dtype.row_bytes(64)), ("fp8", KvDtype::Fp8, 64));
    let err = KvDtypeChoice::F16.resolve(gpu, 64).unwrap_err();
    assert!(err.contains("the GPU KV cache holds bf16, not f16"), "{err}");
    let err = "f64".parse::<KvDtypeChoice>().unwrap_err();
    assert!(err.contains("unknown KV cache dtype 'f64' (auto, f16, bf16, fp8, int8, int4)"), "{err}");
}

#[test]
fn reads_meminfo() {
    let text = "MemTotal:       16314812 kB\nMemFree:          812344 kB\nMemAvailable:   12010120 kB\n";
    assert_eq!(parse_meminfo(text), Some(DeviceMemory { available: 12_010_120 * 1024, total: 16_314_812 * 1024 }));
    assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), None);
}
