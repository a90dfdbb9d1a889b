//! `ferrite bench throughput --lora N`: what co-batched LoRA adapters cost. The same workload
//! runs twice on one engine — on the base model alone, then with request i through synthetic
//! adapter i mod N (random, rank `--lora-rank`, every projection of every layer, made for the
//! model's own shapes) — each after a warm-up pass of short requests (graphs captured,
//! weights warm), and the adapters' output throughput is reported as a share of the base's.
//! The goal: 85 % or more at 64 concurrent rows with 4 adapters.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use ferrite_engine::Engine;
use ferrite_models::lora::{LoraAdapter, MAX_LORA_RANK};
use ferrite_models::LoadedModel;
use serde_json::{json, Value};

use crate::bench::{drive, print_pass, ThroughputArgs};

/// Run `work` on the base and over `n` synthetic adapters; print both and the ratio.
pub(crate) fn compare(
    a: &ThroughputArgs,
    n: usize,
    loaded: &LoadedModel,
    path: &Path,
    device: &str,
    engine: &Arc<Engine>,
    work: &Arc<Vec<(Vec<u32>, usize)>>,
) -> Result<()> {
    if n == 0 || !(1..=MAX_LORA_RANK).contains(&a.lora_rank) {
        bail!("--lora takes at least 1 adapter, --lora-rank a rank in 1..={MAX_LORA_RANK}");
    }
    let shapes = loaded.model.lora_shapes();
    if shapes.is_empty() {
        bail!("this model runs no LoRA adapters");
    }
    let made = Instant::now();
    let mut names = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("synthetic-{i}");
        engine.load_adapter(&name, Arc::new(LoraAdapter::random(&shapes, a.lora_rank, 0x10AA + i as u64)))?;
        names.push(name);
    }
    let attach_s = made.elapsed().as_secs_f64();
    let (base_names, lora_names) = (Arc::new(Vec::new()), Arc::new(names));
    // One short request per client first: every graph bucket the pass reaches is captured.
    let warm = Arc::new(work.iter().take(a.concurrency).map(|(p, _)| (p.clone(), 8)).collect::<Vec<_>>());
    drive(engine, &warm, a.concurrency, &base_names)?;
    let base = drive(engine, work, a.concurrency, &base_names)?;
    drive(engine, &warm, a.concurrency, &lora_names)?;
    let lora = drive(engine, work, a.concurrency, &lora_names)?;
    let ratio = lora.output_tok_s() / base.output_tok_s().max(1e-9);
    let (base_stats, lora_stats) = (base.stats(), lora.stats());
    if a.json {
        let out = json!({
            "model": path.display().to_string(), "device": device,
            "num_requests": a.num_requests, "input_len": a.input_len, "output_len": a.output_len,
            "concurrency": a.concurrency, "lora_adapters": n, "lora_rank": a.lora_rank,
            "lora_attach_s": attach_s,
            "output_tok_s": lora.output_tok_s(), "base_output_tok_s": base.output_tok_s(), "lora_ratio": ratio,
            "base": Value::Object(base_stats), "lora": Value::Object(lora_stats),
        });
        println!("{out}");
    } else {
        println!(
            "model {} ({device}), {} requests of {} in / {} out at concurrency {}",
            path.display(),
            a.num_requests,
            a.input_len,
            a.output_len,
            a.concurrency
        );
        println!("base model:");
        print_pass(&base_stats);
        println!(
            "{n} synthetic adapters of rank {} on all 7 projections (made and attached in {attach_s:.1} s):",
            a.lora_rank
        );
        print_pass(&lora_stats);
        println!("LoRA / base output throughput: {ratio:.3}");
    }
    Ok(())
}
