//! The engine's overlap of host and device work (`core/overlap.rs`), on a CPU model that
//! queues steps the way a device model does (`common::queued`): requests get exactly the
//! tokens and finish reasons of the plain engine — through end tokens, `min_tokens`, stop
//! tokens, length limits, forks, rows that sample on the host (which stop the overlap) and
//! aborts while a step is queued — the following step is queued with carried ids wherever it
//! can be, and every KV block comes back. The CPU model itself never hands back a queued
//! step, so the plain engine lands every step at once.

mod common;

use std::sync::Arc;

use common::queued::Queueing;
use common::*;
use ferrite_engine::{EngineConfig, EngineCore, FinishReason, Request, RequestParams, SamplingParams};
use ferrite_models::model::{CausalLm, Pending, Want};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::ForwardBatch;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Per choice: the token ids and the finish reason.
type Outcome = Vec<(Vec<u32>, Option<FinishReason>)>;

fn outcome(rx: &mut UnboundedReceiver<ferrite_engine::Output>, n: usize) -> Outcome {
    let mut out = vec![(Vec::new(), None); n];
    while let Ok(o) = rx.try_recv() {
        out[o.choice].0.extend(&o.token_ids);
        if let Some(f) = o.finished {
            assert!(out[o.choice].1.is_none(), "choice {} finished twice", o.choice);
            out[o.choice].1 = Some(f.reason);
        }
    }
    out
}

fn cfg() -> EngineConfig {
    EngineConfig { max_num_batched_tokens: 64, block_size: 4, ..EngineConfig::default() }
}

/// Run `reqs` together on a core over `model` (aborting request `abort.1` after `abort.0`
/// steps); the outcomes, and whether every block came back.
fn run(
    model: Arc<dyn CausalLm>,
    eos: &[u32],
    reqs: &[(Vec<u32>, RequestParams)],
    abort: Option<(usize, u64)>,
) -> (Vec<Outcome>, bool) {
    let mut core = EngineCore::new(model, None, eos.to_vec(), &cfg()).expect("core");
    let free = core.kv_manager().free_blocks();
    let mut rxs: Vec<_> = (reqs.iter().enumerate())
        .map(|(i, (prompt, params))| {
            let (tx, rx) = unbounded_channel();
            core.add_request(i as u64, Request { prompt: prompt.clone(), params: params.clone() }, tx)
                .expect("request");
            rx
        })
        .collect();
    let mut steps = 0;
    while core.has_work() {
        if abort.is_some_and(|(at, _)| at == steps) {
            core.abort(abort.unwrap().1);
        }
        core.step().expect("step");
        steps += 1;
        assert!(steps < 100_000, "the engine did not finish");
    }
    let outs = rxs.iter_mut().zip(reqs).map(|(rx, (_, p))| outcome(rx, p.n)).collect();
    (outs, core.kv_manager().free_blocks() == free)
}

fn model() -> (Arc<dyn CausalLm>, Vec<u32>) {
    let (m, reference) = load_fixture("llama");
    let prompt = ids(&reference["prompts"][1]);
    (m, prompt)
}

#[test]
fn a_lone_greedy_request_overlaps_every_decode_step() {
    let (m, prompt) = model();
    let q = Queueing::new(m.clone());
    let reqs = [(prompt, greedy(24))];
    let (plain, _) = run(m, &[], &reqs, None);
    let (overlapped, blocks_back) = run(q.clone(), &[], &reqs, None);
    assert_eq!(overlapped, plain);
    assert_eq!(plain[0][0].0.len(), 24);
    assert!(blocks_back);
    // Tokens 2..=24 are picked by steps queued behind the one picking the token before.
    assert_eq!(q.carried_steps(), 23);
}

#[test]
fn overlap_gives_the_plain_engine_outcomes() {
    let (m, _) = model();
    let vocab = m.config().vocab_size;
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let prompt = |rng: &mut rand::rngs::StdRng| -> Vec<u32> {
        let len = rng.random_range(1..40);
        (0..len).map(|_| rng.random_range(1..vocab as u32)).collect()
    };
    // An end token this model does pick: the 6th greedy token of the first prompt.
    let first = prompt(&mut rng);
    let (probe, _) = run(m.clone(), &[], &[(first.clone(), greedy(8))], None);
    let eos = probe[0][0].0[5];
    let with_eos = |max: usize| RequestParams { ignore_eos: false, ..greedy(max) };
    let mut reqs = vec![(first, with_eos(30))];
    for i in 0..6 {
        reqs.push((prompt(&mut rng), with_eos(rng.random_range(1..30))));
        let sampled = RequestParams { ignore_eos: false, ..seeded(rng.random_range(2..20), i, 0.9) };
        reqs.push((prompt(&mut rng), if i % 3 == 0 { sampled } else { with_eos(rng.random_range(5..25)) }));
    }
    reqs.push((reqs[0].0.clone(), RequestParams { min_tokens: 12, ..with_eos(20) }));
    reqs.push((prompt(&mut rng), RequestParams { stop_token_ids: vec![eos], ..greedy(25) }));
    reqs.push((prompt(&mut rng), RequestParams { n: 3, ..with_eos(15) }));
    let biased = SamplingParams { logit_bias: vec![(eos, 2.0)], ..Default::default() };
    reqs.push((prompt(&mut rng), RequestParams { sampling: biased, ..with_eos(18) }));
    let penalized = SamplingParams { repetition_penalty: 1.3, ..Default::default() };
    reqs.push((prompt(&mut rng), RequestParams { sampling: penalized, ..with_eos(18) }));
    let q = Queueing::new(m.clone());
    let (plain, _) = run(m, &[eos], &reqs, None);
    let (overlapped, blocks_back) = run(q.clone(), &[eos], &reqs, None);
    for (i, (a, b)) in plain.iter().zip(&overlapped).enumerate() {
        assert_eq!(b, a, "request {i}");
        assert!(a.iter().all(|(_, reason)| reason.is_some()), "request {i} finished");
    }
    assert!(plain[0][0].1 == Some(FinishReason::Stop) && plain[0][0].0.len() == 6, "the end token ends request 0");
    assert!(blocks_back, "KV blocks leaked");
    // While a row samples on the host (this model picks only argmaxes) nothing overlaps.
    assert!(q.carried_steps() > 0, "no step overlapped");
}

#[test]
fn an_abort_while_a_step_is_queued_loses_nothing() {
    let (m, prompt) = model();
    let reqs: Vec<_> = (0..3).map(|i| (prompt[i..].to_vec(), greedy(20 + i))).collect();
    for at in [1, 2, 5, 9] {
        let (plain, _) = run(m.clone(), &[], &reqs, Some((at, 1)));
        let (overlapped, blocks_back) = run(Queueing::new(m.clone()), &[], &reqs, Some((at, 1)));
        assert!(blocks_back, "KV blocks leaked (abort after {at} steps)");
        for i in [0, 2] {
            assert_eq!(overlapped[i], plain[i], "request {i}, abort after {at} steps");
            assert_eq!(plain[i][0].0.len(), 20 + i);
        }
    }
}

/// The CPU model resolves its step handles when it hands them back: the argmax of a step is
/// the argmax of its logits; ids carried from an earlier step's picks and device sampling are
/// refused (it keeps no picks on a device).
#[test]
fn cpu_steps_come_back_resolved() {
    let (m, prompt) = model();
    let (mut kv, tables) = common::model::cache(m.as_ref(), prompt.len().div_ceil(common::model::BLOCK) + 1);
    let mut batch = ForwardBatch::default();
    batch.push_row(&prompt, prompt.len(), tables.clone(), RowLogits::Last);
    let step = m.step(&batch, &mut kv, Want::Argmax).expect("argmax step");
    assert!(!step.is_queued());
    let ids = step.ids().expect("ids");
    let logits = m.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("logits step");
    assert_eq!(ids, vec![ferrite_runtime::cpu::argmax(&logits) as u32]);
    assert!(!m.samples_on_device());
    assert!(m.step(&batch, &mut kv, Want::Sample(&[])).is_err(), "the CPU model sampled");
    let mut next = ForwardBatch::default();
    next.push_row(&[0], prompt.len() + 1, tables, RowLogits::Last);
    next.carried.push((0, 0));
    assert!(m.step(&next, &mut kv, Want::Argmax).is_err(), "the CPU model took carried ids");
}
