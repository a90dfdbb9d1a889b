//! Shared helpers of the engine tests: loading the tiny fixture models and running requests
//! through an `EngineCore` to completion.

#![allow(dead_code)]

pub mod hybrid;
pub mod lora;
pub mod model;
pub mod queued;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrite_engine::{EngineConfig, EngineCore, Output, Request, RequestId, RequestParams, SamplingParams, Usage};
use ferrite_models::model::CausalLm;
use serde_json::Value;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

pub fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

/// Fixture `name` cut to its first `layers` layers, on the CPU (where the CLI runs drafts): a
/// draft that often disagrees with the full model.
pub fn first_layers(name: &str, layers: usize) -> Arc<dyn CausalLm> {
    let opts = ferrite_models::LoadOptions { max_layers: Some(layers), ..Default::default() };
    ferrite_models::load_with(&fixture_dir(name), ferrite_runtime::cuda::DeviceChoice::Cpu, &opts)
        .unwrap_or_else(|e| panic!("{name} cut to {layers} layers: {e}"))
        .model
}

pub fn load_fixture(name: &str) -> (Arc<dyn CausalLm>, Value) {
    let dir = fixture_dir(name);
    let loaded = ferrite_models::load(&dir).unwrap_or_else(|e| panic!("load {name}: {e}"));
    let reference = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).expect("reference.json"))
        .expect("json");
    (loaded.model, reference)
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

pub fn greedy(max_tokens: usize) -> RequestParams {
    RequestParams { max_tokens: Some(max_tokens), ignore_eos: true, ..Default::default() }
}

pub fn seeded(max_tokens: usize, seed: u64, temperature: f32) -> RequestParams {
    RequestParams {
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        sampling: SamplingParams { temperature, top_k: 50, top_p: 0.9, seed, ..Default::default() },
        ..Default::default()
    }
}

/// A core over `model` with `cfg`.
pub fn core(model: &Arc<dyn CausalLm>, cfg: EngineConfig) -> EngineCore {
    EngineCore::new(model.clone(), None, vec![], &cfg).expect("engine core")
}

/// Add a request; returns its receiver.
pub fn add(core: &mut EngineCore, id: RequestId, prompt: Vec<u32>, params: RequestParams) -> UnboundedReceiver<Output> {
    let (tx, rx) = unbounded_channel();
    core.add_request(id, Request { prompt, params }, tx).expect("valid request");
    rx
}

/// Step until idle.
pub fn run_to_end(core: &mut EngineCore) {
    let mut steps = 0;
    while core.has_work() {
        core.step().expect("step");
        steps += 1;
        assert!(steps < 1_000_000, "engine did not finish");
    }
}

/// Every output of a finished request: per choice, the token ids.
pub fn collect(rx: &mut UnboundedReceiver<Output>, n: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); n];
    let mut finished = 0;
    while let Ok(o) = rx.try_recv() {
        out[o.choice].extend(&o.token_ids);
        if o.finished.is_some() {
            finished += 1;
        }
    }
    assert_eq!(finished, n, "every choice finishes exactly once");
    out
}

/// The tokens a request of one choice streamed and the usage
/// it finished with.
pub fn drain(rx: &mut UnboundedReceiver<Output>) -> (Vec<u32>, Usage) {
    let (mut tokens, mut usage) = (Vec::new(), None);
    while let Ok(o) = rx.try_recv() {
        tokens.extend(&o.token_ids);
        usage = o.finished.map(|f| f.usage).or(usage);
    }
    (tokens, usage.expect("finished"))
}

/// Run `core` to its end; the tokens `rx` streamed and the usage it finished with.
pub fn finish(core: &mut EngineCore, mut rx: UnboundedReceiver<Output>) -> (Vec<u32>, Usage) {
    run_to_end(core);
    drain(&mut rx)
}

/// Run one request alone on a fresh core and return its tokens per choice.
pub fn alone(model: &Arc<dyn CausalLm>, cfg: EngineConfig, prompt: Vec<u32>, params: RequestParams) -> Vec<Vec<u32>> {
    let n = params.n;
    let mut c = core(model, cfg);
    let mut rx = add(&mut c, 1, prompt, params);
    run_to_end(&mut c);
    collect(&mut rx, n)
}
