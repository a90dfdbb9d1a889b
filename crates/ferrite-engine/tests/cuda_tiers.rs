//! The prefix cache's tiers below a GPU pool, gated by `FERRITE_TEST_CUDA=1` (skipped
//! elsewhere), on SmolLM2-135M Q4_1 (real weights: clear margins) on CUDA device 0:
//!
//! - host RAM: a pool of a few requests' blocks, so a second long prompt evicts the first's
//!   prefix into `host_cache_memory`; the request sharing that prefix gets it back through
//!   the copy stream;
//! - SSD: a new engine over the directory an earlier one wrote (a restart) restores it.
//!
//! Each restored run gives exactly the tokens of the same request served by a pool hit of as
//! many tokens (the restored KV is the pool's bytes), and the cold run's tokens up to a near
//! tie of the CPU model's logits (a hit prefills only the suffix: another kernel shape).
//! Every comparison prints a `TABLE|…` row for `scripts/gpu_tests.sh`.

mod common;

use std::sync::Arc;

use common::model::{cuda_enabled, equal_or_tie, smollm2_gguf};
use ferrite_engine::kv::disk::DiskConfig;
use ferrite_engine::{EngineConfig, EngineCore, Output, Request, RequestParams, Usage};
use ferrite_models::model::CausalLm;
use ferrite_runtime::cuda::DeviceChoice;
use tokio::sync::mpsc::unbounded_channel;

/// Run `prompts` one after the other on `core`; each one's tokens and usage.
fn run(core: &mut EngineCore, prompts: &[&[u32]]) -> Vec<(Vec<u32>, Usage)> {
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (tx, mut rx) = unbounded_channel::<Output>();
        let params = RequestParams { max_tokens: Some(24), ignore_eos: true, ..Default::default() };
        core.add_request(i as u64 + 1, Request { prompt: p.to_vec(), params }, tx).expect("request");
        while core.has_work() {
            core.step().expect("step");
        }
        out.push(common::drain(&mut rx));
    }
    out
}

fn engine(model: &Arc<dyn CausalLm>, cfg: &EngineConfig) -> EngineCore {
    EngineCore::new(model.clone(), None, vec![], cfg).expect("engine core")
}

#[test]
fn cuda_prefix_restored_from_host_ram_and_ssd_gives_the_cold_tokens() {
    if !cuda_enabled("cuda_prefix_restored_from_host_ram_and_ssd_gives_the_cold_tokens") {
        return;
    }
    let Some(path) = smollm2_gguf("cuda_tiers") else { return };
    let cpu = ferrite_models::load_on(&path, DeviceChoice::Cpu).expect("cpu load");
    let gpu = ferrite_models::load_on(&path, DeviceChoice::Cuda(0)).expect("cuda load").model;
    let tok = cpu.tokenizer.clone().expect("tokenizer");
    let text = |topic: &str| -> Vec<u32> {
        let lines: Vec<String> =
            (0..40).map(|i| format!("Note {i} on {topic}: each entry adds one more fact to the list. ")).collect();
        tok.encode(&lines.concat(), false).expect("encode")
    };
    let shared = text("rivers");
    let first = [shared.clone(), tok.encode(" And so the first list ends.", false).expect("encode")].concat();
    let second =
        [shared.clone(), tok.encode(" The second list asks: what comes next?", false).expect("encode")].concat();
    let filler = text("mountains and the weather in spring");
    let base = EngineConfig { max_num_batched_tokens: 256, max_num_seqs: 4, ..EngineConfig::default() };
    let cold = run(&mut engine(&gpu, &EngineConfig { prefix_cache: false, ..base.clone() }), &[&second]).remove(0).0;
    let pool = run(&mut engine(&gpu, &base), &[&first, &second]).remove(1);
    let bytes_per_token = engine(&gpu, &base).limits().kv_bytes_per_token;

    // Host RAM: a pool of one long request and a bit, host memory for three.
    let room = first.len().max(filler.len()) + 64;
    let host_cfg = EngineConfig {
        kv_cache_memory: Some(bytes_per_token * room),
        max_model_len: Some(room),
        host_cache_memory: Some(bytes_per_token * 3 * room),
        ..base.clone()
    };
    let mut core = engine(&gpu, &host_cfg);
    let metrics = core.metrics();
    let host = run(&mut core, &[&first, &filler, &second]).remove(2);
    let host_tokens = host.1.tiers.host_tokens;
    println!("TABLE|GPU host-RAM restore|{host_tokens} tokens from host RAM, {} cached|||", host.1.cached_tokens);
    assert!(host_tokens > 0, "nothing came from host RAM: {:?}", host.1.tiers);
    assert!(metrics.host_written_bytes.load(std::sync::atomic::Ordering::Relaxed) > 0);
    core.check_kv_invariants().expect("invariants");
    drop(core);

    // SSD: one engine writes, a new one (a restart) reads.
    let dir = tempfile::tempdir().expect("tempdir");
    let ssd_cfg = EngineConfig { disk_cache: Some(DiskConfig::new(dir.path().to_path_buf(), 1 << 30)), ..base };
    run(&mut engine(&gpu, &ssd_cfg), &[&first]);
    let ssd = run(&mut engine(&gpu, &ssd_cfg), &[&second]).remove(0);
    println!("TABLE|GPU SSD restore|{} tokens from the SSD, {} cached|||", ssd.1.tiers.ssd_tokens, ssd.1.cached_tokens);
    assert!(ssd.1.tiers.ssd_tokens > 0, "nothing came from the SSD: {:?}", ssd.1.tiers);

    for (what, got) in [("host RAM", &host), ("SSD", &ssd)] {
        if got.1.cached_tokens == pool.1.cached_tokens {
            assert_eq!(got.0, pool.0, "a prefix restored from {what} differs from the same pool hit");
        }
        let same = equal_or_tie(cpu.model.as_ref(), &second, &cold, &got.0, &format!("GPU {what} restore vs cold"));
        println!("TABLE|GPU {what} restore == cold|{}|||", if same { "identical" } else { "parted" });
        assert!(same, "a prefix restored from {what} parted from the cold run away from a tie");
    }
}
