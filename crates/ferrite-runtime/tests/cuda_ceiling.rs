//! Measurements on the device, gated on `FERRITE_TEST_CUDA=1`: kernel start-up (cold NVRTC
//! compile vs the disk cache), the two ceilings every later number is a ratio to — a copy
//! kernel's bandwidth (bytes read + written) and cuBLASLt's bf16 GEMM rate at 8192³ — and
//! first baselines of our kernels against them (decode-shaped GEMMs, decode and prefill
//! attention, sampling). Each timing is the median of repeated runs after warm-up, timed with
//! CUDA events; inputs are random bf16 (never zeros), and every working set is several times
//! the 60 MB L2 unless the row says otherwise.

mod cuda_common;

use std::time::Instant;

use cuda_common::{fill_pool, gpu, measure};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::cpu::AttentionParams;
use ferrite_runtime::cuda::ops::{
    self, AttentionMeta, DecodePlan, DecodeScratch, DeviceKv, RowSampling, SamplingParamsDev,
};
use ferrite_runtime::cuda::{CudaResult, Gpu};
use ferrite_runtime::ForwardBatch;
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Random bf16 with |x| < 2 (top exponent bit cleared: no inf or NaN), fast to make.
fn quick_bf16(rng: &mut StdRng, n: usize) -> Vec<bf16> {
    (0..n).map(|_| bf16::from_bits(rng.random::<u16>() & 0xbfff)).collect()
}

fn median_ms(gpu: &Gpu, warmup: usize, reps: usize, mut f: impl FnMut() -> CudaResult<()>) -> f64 {
    for _ in 0..warmup {
        f().unwrap();
    }
    let mut t: Vec<f64> = (0..reps).map(|_| f64::from(gpu.time_ms(&mut f).unwrap())).collect();
    t.sort_by(f64::total_cmp);
    t[reps / 2]
}

#[test]
fn cuda_ceilings_and_baselines() {
    let Some((gpu, _checks)) = gpu("cuda_ceilings_and_baselines") else { return };
    let mut rng = StdRng::seed_from_u64(7);
    let info = gpu.info();
    measure(
        "device",
        &info.name,
        format!(
            "sm_{}{}|{} SMs|{:.0} GiB",
            info.compute_capability.0,
            info.compute_capability.1,
            info.multiprocessors,
            info.total_memory as f64 / (1u64 << 30) as f64
        ),
    );

    // Start-up: open the device with an empty kernel cache, then again with it filled.
    let dir = std::env::temp_dir().join(format!("ferrite-kernel-cache-{}", std::process::id()));
    for label in ["cold", "cached"] {
        let t = Instant::now();
        let g = Gpu::with_kernel_cache(0, Some(&dir)).unwrap();
        let open = t.elapsed().as_secs_f64();
        let r = g.compile_report();
        measure(
            "startup",
            &format!("kernels {label}"),
            format!(
                "{}|nvrtc {}.{}|compiled={} cached={}|build {:.3} s|open {:.3} s",
                r.arch, r.nvrtc_version.0, r.nvrtc_version.1, r.compiled, r.cached, r.seconds, open
            ),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);

    // Copy ceiling: 1 GiB to 1 GiB.
    let words = 1usize << 28;
    let src = gpu.upload(&quick_bf16(&mut rng, 2 * words)).unwrap();
    let mut dst = gpu.alloc::<bf16>(2 * words).unwrap();
    let ms = median_ms(gpu, 3, 20, || ops::copy(gpu, &src, &mut dst));
    let copy_gbs = 2.0 * 4.0 * words as f64 / ms / 1e6;
    measure("ceiling", "copy 1 GiB", format!("{ms:.3} ms|{copy_gbs:.0} GB/s (read+write)"));
    drop((src, dst));

    // GEMM ceiling: 8192³ bf16 in, f32 accumulate, bf16 out.
    let n = 8192;
    let x = gpu.upload(&quick_bf16(&mut rng, n * n)).unwrap();
    let w = gpu.upload(&quick_bf16(&mut rng, n * n)).unwrap();
    let mut y = gpu.alloc::<bf16>(n * n).unwrap();
    let ms = median_ms(gpu, 3, 10, || ops::linear::<bf16>(gpu, &x, &w, None, &mut y, (n, n, n)));
    let gemm_tflops = 2.0 * (n as f64).powi(3) / ms / 1e9;
    measure("ceiling", "gemm 8192^3 bf16", format!("{ms:.3} ms|{gemm_tflops:.0} TFLOP/s"));
    drop((x, w, y));

    // Decode-shaped GEMMs (m = 1): bandwidth-bound weight reads.
    for (name, m, n, k) in [
        ("mlp 1x14336x4096", 1, 14336, 4096),
        ("lm_head 1x128256x4096", 1, 128_256, 4096),
        ("qkv 64x6144x4096", 64, 6144, 4096),
    ] {
        let x = gpu.upload(&quick_bf16(&mut rng, m * k)).unwrap();
        let w = gpu.upload(&quick_bf16(&mut rng, n * k)).unwrap();
        let mut y = gpu.alloc::<f32>(m * n).unwrap();
        let ms = median_ms(gpu, 3, 20, || ops::linear::<f32>(gpu, &x, &w, None, &mut y, (m, n, k)));
        let gbs = (2 * n * k) as f64 / ms / 1e6;
        measure("gemv", name, format!("{:.1} us|{gbs:.0} GB/s|{:.0}% of copy", ms * 1e3, 100.0 * gbs / copy_gbs));
    }

    // Attention: decode at B=1 / context 512 (the Llama-3.2-1B and -3.1-8B head shapes), a
    // throughput-style batch, a long-context batch, and a 2048-token causal prefill.
    let shapes = [
        (32, 8, 64, 1, 512, 1),
        (32, 8, 128, 1, 512, 1),
        (32, 8, 128, 256, 256, 1),
        (32, 8, 128, 64, 2048, 1),
        (32, 8, 128, 1, 2048, 2048),
    ];
    let bs = 16;
    for (nh, nkv, hd, rows, ctx, qlen) in shapes {
        let p = AttentionParams {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window: None,
            softcap: None,
            causal: true,
        };
        let blocks = rows * ctx / bs;
        let mut kv = DeviceKv::new(gpu, blocks, bs, nkv, hd).unwrap();
        let n = blocks * bs * nkv * hd;
        fill_pool(gpu, &quick_bf16(&mut rng, n), &mut kv.k);
        fill_pool(gpu, &quick_bf16(&mut rng, n), &mut kv.v);
        let mut batch = ForwardBatch::default();
        for r in 0..rows {
            let table: Vec<u32> = (0..ctx / bs).map(|b| (r * ctx / bs + b) as u32).collect();
            batch.push_row(&vec![0; qlen], ctx, vec![table], RowLogits::None);
        }
        let meta = AttentionMeta::upload(gpu, &batch, 0, bs).unwrap();
        let plan = DecodePlan::new(gpu, rows, &p, ctx);
        let mut scratch = DecodeScratch::new(gpu, rows, nh, hd, plan.splits).unwrap();
        let q = gpu.upload(&quick_bf16(&mut rng, rows * qlen * nh * hd)).unwrap();
        let mut out = gpu.alloc::<bf16>(rows * qlen * nh * hd).unwrap();
        let ms = median_ms(gpu, 3, 20, || {
            ops::attention(gpu, &q, nh * hd, &meta, &kv, &p, Some(plan), &mut scratch, &mut out, nh * hd)
        });
        if qlen == 1 {
            let gbs = (rows * ctx * nkv * hd * 2 * 2) as f64 / ms / 1e6;
            let case = format!("decode {rows}x{ctx} {nh}/{nkv}x{hd} splits={}x{}", plan.splits, plan.partition);
            let value = format!("{:.1} us|{gbs:.0} GB/s KV|{:.0}% of copy", ms * 1e3, 100.0 * gbs / copy_gbs);
            measure("attention", &case, value);
        } else {
            let flops = 4.0 * (nh * hd) as f64 * (qlen * (qlen + 1) / 2) as f64;
            let tf = flops / ms / 1e9;
            let case = format!("prefill causal {qlen} {nh}/{nkv}x{hd}");
            measure(
                "attention",
                &case,
                format!("{:.3} ms|{tf:.0} TFLOP/s|{:.0}% of gemm", ms, 100.0 * tf / gemm_tflops),
            );
        }
    }

    // Sampling: one row (B=1 decode) and a 256-row decode batch of a 128256 vocabulary.
    let vocab = 128_256;
    let all: Vec<f32> = (0..256 * vocab).map(|_| rng.random_range(-10.0..10.0)).collect();
    let logits = gpu.upload(&all).unwrap();
    let mut tokens = gpu.alloc::<u32>(256).unwrap();
    let mut lps = gpu.alloc::<f32>(256).unwrap();
    for rows in [1, 256] {
        let mut scratch = ops::ArgmaxScratch::new(gpu, rows).unwrap();
        let ms = median_ms(gpu, 2, 10, || ops::argmax(gpu, &logits, (rows, vocab, vocab), &mut scratch, &mut tokens));
        measure("sampling", &format!("argmax {rows}x{vocab}"), format!("{:.1} us", ms * 1e3));
        for (name, top_k, top_p) in [("top_k=50", 50, 1.0), ("top_p=0.9", 0, 0.9)] {
            let params: Vec<RowSampling> = (0..rows)
                .map(|_| RowSampling { temperature: 0.8, top_k, top_p, min_p: 0.0, uniform: rng.random() })
                .collect();
            let params = SamplingParamsDev::upload(gpu, &params).unwrap();
            let ms =
                median_ms(gpu, 2, 10, || ops::sample(gpu, &logits, (vocab, vocab), &params, &mut tokens, &mut lps));
            measure("sampling", &format!("{name} T=0.8 {rows}x{vocab}"), format!("{:.1} us", ms * 1e3));
        }
    }
}
