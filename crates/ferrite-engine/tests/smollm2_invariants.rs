//! Batch invariance on real quantized weights (SmolLM2-135M Q4_1) with the default fast
//! kernels: 16 requests of mixed lengths and sampling settings, run together under a token
//! budget that mixes prefill chunks with decode rows, give exactly the tokens each gives alone.

mod common;

use std::sync::Arc;

use common::*;
use ferrite_engine::{EngineConfig, RequestParams};
use ferrite_models::model::CausalLm;
use ferrite_models::{paths, registry};
use rand::{Rng, SeedableRng};

fn smollm2() -> Arc<dyn CausalLm> {
    let path = registry::resolve("smollm2", &paths::models_dir()).expect("smollm2 (run `ferrite pull smollm2`)");
    ferrite_models::load(&path).expect("load").model
}

#[test]
fn batched_requests_equal_requests_alone_on_quantized_weights() {
    let m = smollm2();
    let vocab = m.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let reqs: Vec<(Vec<u32>, RequestParams)> = (0..16)
        .map(|i| {
            let len = rng.random_range(1..90);
            let prompt = (0..len).map(|_| rng.random_range(1..vocab)).collect();
            let max = rng.random_range(1..20);
            let params = if i % 2 == 0 { greedy(max) } else { seeded(max, i, 0.8) };
            (prompt, params)
        })
        .collect();
    let cfg = EngineConfig { max_num_batched_tokens: 61, max_model_len: Some(256), ..EngineConfig::default() };
    let mut c = core(&m, cfg.clone());
    let mut rxs: Vec<_> =
        reqs.iter().enumerate().map(|(i, (p, params))| add(&mut c, i as u64, p.clone(), params.clone())).collect();
    run_to_end(&mut c);
    for (i, (p, params)) in reqs.iter().enumerate() {
        let together = collect(&mut rxs[i], 1);
        let solo = alone(&m, cfg.clone(), p.clone(), params.clone());
        assert_eq!(together, solo, "request {i} differs when batched");
    }
}
