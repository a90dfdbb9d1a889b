//! KV ownership through the engine: with a pool small enough to preempt, the prefix cache,
//! n > 1 forks and a draft model, every block's count equals its live holders after every
//! step (in the target's pools and the draft's), a request aborted mid-generation is no
//! holder any more, and once all is done every block of both is back.

mod common;

use std::sync::atomic::Ordering::Relaxed;

use common::*;
use ferrite_engine::{EngineConfig, RequestParams, Speculation};

#[test]
fn every_block_is_counted_by_its_holders_and_an_abort_returns_them() {
    let (m, reference) = load_fixture("llama");
    let prompts: Vec<Vec<u32>> = reference["prompts"].as_array().expect("prompts").iter().map(ids).collect();
    let draft = first_layers("llama", 1);
    let block_bytes: usize = m.kv_layout().block_bytes(4).iter().sum();
    let cfg = EngineConfig {
        block_size: 4,
        max_num_batched_tokens: 48,
        kv_cache_memory: Some(40 * block_bytes),
        speculation: Speculation::Draft(draft),
        num_draft_tokens: 3,
        ..EngineConfig::default()
    };
    let mut c = core(&m, cfg);
    let (free0, total) = c.kv_manager().free_blocks();
    assert_eq!(free0, total);
    // Two requests share prompt 2's prefix (a prefix hit), one forks three choices.
    let mut longer = prompts[2].clone();
    longer.extend([5, 6, 7, 8, 9]);
    let reqs = [
        (prompts[2].clone(), RequestParams { n: 3, ..seeded(30, 1, 0.9) }),
        (prompts[1].clone(), seeded(30, 2, 0.9)),
        (longer, seeded(30, 3, 0.9)),
        (prompts[0].clone(), greedy(30)),
    ];
    let mut rxs: Vec<_> =
        reqs.iter().enumerate().map(|(i, (p, pr))| add(&mut c, i as u64, p.clone(), pr.clone())).collect();
    let mut streamed = 0;
    let mut aborted = false;
    while c.has_work() {
        c.step().expect("step");
        c.check_kv_invariants().expect("invariants after a step");
        while let Ok(o) = rxs[1].try_recv() {
            assert!(o.finished.is_none(), "request 1 must still be generating when it is aborted");
            streamed += o.token_ids.len();
        }
        if !aborted && streamed >= 2 {
            c.abort(1);
            aborted = true;
            c.check_kv_invariants().expect("invariants after the abort");
        }
    }
    assert!(aborted, "request 1 never streamed two tokens");
    assert!(c.metrics().preemptions.load(Relaxed) > 0, "the small pool forced no preemption");
    assert!(c.metrics().prefix_hit_rate() > 0.0, "no prefix hit happened");
    for (i, (_, pr)) in reqs.iter().enumerate().filter(|&(i, _)| i != 1) {
        let got = collect(&mut rxs[i], pr.n);
        assert!(got.iter().all(|t| t.len() == 30), "request {i}");
    }
    assert_eq!(c.kv_manager().free_blocks(), (free0, total), "target blocks leaked");
    // With no holder left, the holder check means every draft block is back too.
    c.check_kv_invariants().expect("invariants at the end");
}
