//! Multi-LoRA against transformers + PEFT (`scripts/goldens/make_lora_adapters.py`): tiny random
//! adapters on the tiny llama fixture give PEFT's last-position logits within 1e-4 and its 16
//! greedy tokens exactly; rows of three adapters and the base co-batched in one step give what
//! each gives alone (also on SmolLM2's Q4_1 GGUF); the prefix cache keeps adapters apart;
//! prompt-lookup speculation and echo fill keep an adapter's tokens; bad adapters and bad
//! requests get clear errors.

mod common;

use std::sync::Arc;

use common::lora::*;
use common::*;
use ferrite_engine::{EngineConfig, EngineCore, EngineError, FillMode, Request, Speculation};
use ferrite_models::lora::{LoraAdapter, MAX_LORA_RANK};
use ferrite_models::model::{CausalLm, Pending, Want};
use ferrite_models::{paths, registry};
use ferrite_runtime::batch::{RowLogits, RowOptions};
use ferrite_runtime::{ForwardBatch, KvCache, KvDtype, KvScheme};
use serde_json::Value;

/// The last-position logits of `prompt` through adapter `id` (already attached), over an f32
/// KV cache.
fn last_logits(model: &dyn CausalLm, prompt: &[u32], id: u32) -> Vec<f32> {
    let block = 4;
    let blocks = prompt.len().div_ceil(block);
    let layout = model.kv_layout();
    let scheme = KvScheme { dtype: KvDtype::F32, ..Default::default() };
    let mut kv = KvCache::with_scheme(&layout, &vec![blocks; layout.groups.len()], block, &scheme).expect("kv");
    let mut batch = ForwardBatch::default();
    let tables = vec![(0..blocks as u32).collect::<Vec<_>>(); layout.groups.len()];
    batch.push_row_with(
        prompt,
        prompt.len(),
        tables,
        RowLogits::Last,
        RowOptions { adapter: Some(id), ..Default::default() },
    );
    model.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("forward")
}

#[test]
fn adapters_match_transformers_and_peft() {
    let (model, _) = load_fixture("llama");
    let reference = reference();
    let prompts: Vec<Vec<u32>> = reference["prompts"].as_array().expect("prompts").iter().map(ids).collect();
    for (i, name) in ADAPTERS.iter().enumerate() {
        let want = &reference["adapters"][name];
        let id = 1000 + i as u32;
        model.attach_lora(id, &adapter(name)).expect("attach");
        for (p, prompt) in prompts.iter().enumerate() {
            let got = last_logits(model.as_ref(), prompt, id);
            let want_logits: Vec<f32> = want["last_logits"][p]
                .as_array()
                .expect("logits")
                .iter()
                .map(|x| x.as_f64().expect("f") as f32)
                .collect();
            assert_eq!(got.len(), want_logits.len());
            // Relative to the row's largest logit: the adapters move the logits far from the
            // base, to magnitudes (~10) where f32 summation order alone shifts them by ~1e-4.
            let scale = want_logits.iter().fold(1f32, |m, w| m.max(w.abs()));
            for (t, (g, w)) in got.iter().zip(&want_logits).enumerate() {
                let err = (g - w).abs() / scale;
                assert!(err <= 1e-4, "{name} prompt {p} token {t}: {g} vs PEFT {w} (row scale {scale})");
            }
        }
        model.detach_lora(id);
        let cfg = EngineConfig { max_num_batched_tokens: 7, block_size: 4, ..EngineConfig::default() };
        for (p, prompt) in prompts.iter().enumerate() {
            let mut c = core_with_adapters(&model, cfg.clone(), &[name]);
            let mut rx = add(&mut c, 1, prompt.clone(), with_adapter(greedy(16), Some(name)));
            run_to_end(&mut c);
            assert_eq!(collect(&mut rx, 1)[0], ids(&want["greedy"][p]), "{name} prompt {p}: greedy tokens");
        }
    }
}

/// Run `reqs` together on one core (`names` loaded) and each alone; the tokens must agree,
/// and the adapters must change the base's tokens.
fn check_co_batched(
    model: &Arc<dyn CausalLm>,
    cfg: EngineConfig,
    names: &[&str],
    reqs: &[(Vec<u32>, Option<&str>, usize)],
) {
    let mut c = core_with_adapters(model, cfg.clone(), names);
    let mut rxs: Vec<_> = (reqs.iter().enumerate())
        .map(|(i, (p, a, n))| add(&mut c, i as u64, p.clone(), with_adapter(greedy(*n), *a)))
        .collect();
    run_to_end(&mut c);
    c.check_kv_invariants().expect("kv invariants");
    let mut differs = 0;
    for (i, (p, a, n)) in reqs.iter().enumerate() {
        let together = collect(&mut rxs[i], 1);
        let mut solo = core_with_adapters(model, cfg.clone(), a.as_slice());
        let mut rx = add(&mut solo, 1, p.clone(), with_adapter(greedy(*n), *a));
        run_to_end(&mut solo);
        assert_eq!(together, collect(&mut rx, 1), "request {i} ({a:?}) batched vs alone");
        if a.is_some() {
            let base = alone(model, cfg.clone(), p.clone(), greedy(*n));
            differs += (base != together) as usize;
        }
    }
    assert!(differs > 0, "no adapter changed any request's tokens");
}

#[test]
fn co_batched_adapters_equal_each_alone() {
    let (model, _) = load_fixture("llama");
    let vocab = model.config().vocab_size as u32;
    let cfg = EngineConfig { max_num_batched_tokens: 23, block_size: 4, ..EngineConfig::default() };
    check_co_batched(&model, cfg, &ADAPTERS, &mixed_requests(vocab));
}

#[test]
fn co_batched_adapter_on_quantized_gguf_equals_alone() {
    let path = registry::resolve("smollm2", &paths::models_dir()).expect("smollm2 (run `ferrite pull smollm2`)");
    let model = ferrite_models::load(&path).expect("load").model;
    let mut c = core(&model, EngineConfig::default());
    c.load_adapter("smollm2", &adapter("smollm2")).expect("the SmolLM2-shaped adapter fits the GGUF");
    drop(c);
    let reqs: Vec<(Vec<u32>, Option<&str>, usize)> = (0..4)
        .map(|i| ((0..9 + 13 * i).map(|j| (100 + j * 7 + i * 3) as u32).collect(), [Some("smollm2"), None][i % 2], 8))
        .collect();
    let cfg = EngineConfig { max_num_batched_tokens: 29, max_model_len: Some(256), ..EngineConfig::default() };
    check_co_batched(&model, cfg, &["smollm2"], &reqs);
}

#[test]
fn prefix_cache_keeps_adapters_apart() {
    let (model, reference) = load_fixture("llama");
    let prompt = ids(&reference["prompts"][2]);
    let cfg = EngineConfig { block_size: 4, ..EngineConfig::default() };
    let mut c = core_with_adapters(&model, cfg.clone(), &["qv"]);
    let run = |c: &mut EngineCore, id: u64, a: Option<&str>| {
        let mut rx = add(c, id, prompt.clone(), with_adapter(greedy(8), a));
        run_to_end(c);
        let mut cached = 0;
        let mut tokens = Vec::new();
        while let Ok(o) = rx.try_recv() {
            tokens.extend(o.token_ids);
            if let Some(f) = o.finished {
                cached = f.usage.cached_tokens;
            }
        }
        (tokens, cached)
    };
    let (base, _) = run(&mut c, 1, None);
    let (first, cached) = run(&mut c, 2, Some("qv"));
    assert_eq!(cached, 0, "an adapter's request must not reuse the base model's blocks");
    let (again, cached) = run(&mut c, 3, Some("qv"));
    assert!(cached > 0, "the same adapter's prompt hits its own cached blocks");
    assert_eq!(again, first);
    assert_ne!(first, base);
    let want = ids(&reference_lora_greedy("qv", 2));
    assert_eq!(first, want[..8]);
}

fn reference_lora_greedy(name: &str, prompt: usize) -> Value {
    reference()["adapters"][name]["greedy"][prompt].clone()
}

#[test]
fn speculation_and_fill_keep_an_adapters_tokens() {
    let (model, reference) = load_fixture("llama");
    let prompts: Vec<Vec<u32>> = reference["prompts"].as_array().expect("prompts").iter().map(ids).collect();
    for (speculation, fill) in [(Speculation::Ngram, FillMode::Off), (Speculation::Off, FillMode::Echo)] {
        let cfg = EngineConfig { speculation, fill, block_size: 4, ..EngineConfig::default() };
        let mut c = core_with_adapters(&model, cfg, &ADAPTERS);
        let mut rxs = Vec::new();
        for (i, name) in ADAPTERS.iter().enumerate() {
            for (p, prompt) in prompts.iter().enumerate() {
                rxs.push((
                    *name,
                    p,
                    add(&mut c, (i * 10 + p) as u64, prompt.clone(), with_adapter(greedy(16), Some(name))),
                ));
            }
        }
        run_to_end(&mut c);
        for (name, p, mut rx) in rxs {
            assert_eq!(collect(&mut rx, 1)[0], ids(&reference_lora_greedy(name, p)), "{name} prompt {p}");
        }
    }
}

#[test]
fn bad_adapters_and_requests_get_clear_errors() {
    let (model, _) = load_fixture("llama");
    let mut c = core(&model, EngineConfig { max_loras: 2, ..EngineConfig::default() });
    let err = |r: Result<(), EngineError>| r.expect_err("refused").to_string();
    let e = err(c.load_adapter("wide", &adapter("wide")));
    assert!(e.contains("does not fit the base model") && e.contains("64"), "{e}");
    let e = LoraAdapter::load(&lora_dir("dora"), MAX_LORA_RANK).expect_err("DoRA").to_string();
    assert!(e.contains("DoRA"), "{e}");
    let e = LoraAdapter::load(&lora_dir("qv"), 2).expect_err("rank 4 > 2").to_string();
    assert!(e.contains("rank 4") && e.contains("--max-lora-rank"), "{e}");
    let e = LoraAdapter::load(&lora_dir("no-such-adapter"), MAX_LORA_RANK).expect_err("missing").to_string();
    assert!(e.contains("no such adapter directory"), "{e}");

    // A truncated weight file.
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(lora_dir("qv").join("adapter_config.json"), dir.path().join("adapter_config.json")).expect("cp");
    let bytes = std::fs::read(lora_dir("qv").join("adapter_model.safetensors")).expect("read");
    std::fs::write(dir.path().join("adapter_model.safetensors"), &bytes[..bytes.len() / 2]).expect("write");
    let e = LoraAdapter::load(dir.path(), MAX_LORA_RANK).expect_err("truncated").to_string();
    assert!(e.contains("truncated"), "{e}");

    // Unknown adapter, duplicates, the cap, unloading in use.
    let req = |a: &str| Request { prompt: vec![1, 2, 3], params: with_adapter(greedy(4), Some(a)) };
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let e = c.add_request(1, req("qv"), tx.clone()).expect_err("unknown").to_string();
    assert!(e.contains("'qv' is not loaded"), "{e}");
    c.load_adapter("qv", &adapter("qv")).expect("load");
    assert!(err(c.load_adapter("qv", &adapter("qv"))).contains("already loaded"));
    c.load_adapter("all", &adapter("all")).expect("load");
    assert!(err(c.load_adapter("mlp-late", &adapter("mlp-late"))).contains("--max-loras"));
    c.add_request(2, req("qv"), tx).expect("known adapter");
    let e = err(c.unload_adapter("qv"));
    assert!(e.contains("in use by 1 sequence"), "{e}");
    run_to_end(&mut c);
    c.unload_adapter("qv").expect("unload once idle");
    assert!(err(c.unload_adapter("qv")).contains("not loaded"));
    c.load_adapter("mlp-late", &adapter("mlp-late")).expect("room after the unload");
}
