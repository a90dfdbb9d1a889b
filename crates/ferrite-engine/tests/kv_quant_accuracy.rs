//! Accuracy of the quantized KV cache on real weights (SmolLM2-135M, Gemma-3-270M,
//! Qwen2.5-Coder-0.5B from `ferrite pull`): 20 prompts, each continued greedily for 256 tokens
//! with f16 KV; then the prompt and continuation are run teacher-forced with f16, int8 and int4
//! KV (group 64), and per generated position the next-token distributions are compared: the
//! share of positions whose top-1 equals f16's, and the mean KL(f16 ‖ quantized). Prints the
//! table and holds int8 to a mean KL of 1e-3.
//!
//! Not a default test (minutes of CPU, real weights): `cargo test --release -p ferrite-engine
//! --test kv_quant_accuracy -- --ignored --nocapture`.

mod common;

use common::*;
use ferrite_engine::EngineConfig;
use ferrite_models::model::{CausalLm, Pending, Want};
use ferrite_models::{paths, registry};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::{ForwardBatch, KvDtype, KvScheme};

const PROMPTS: [&str; 20] = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Explain why the sky is blue to a ten-year-old.",
    "Once upon a time, in a village at the edge of a forest,",
    "SELECT name, COUNT(*) FROM orders",
    "The three laws of thermodynamics are",
    "Write a haiku about autumn rain.",
    "fn main() {\n    let v: Vec<u32> =",
    "Here is a recipe for a simple tomato soup:",
    "In 1969, the Apollo 11 mission",
    "The difference between a list and a tuple in Python is",
    "Dear hiring manager, I am writing to apply for",
    "Photosynthesis converts light energy into",
    "A binary search tree is a data structure in which",
    "The capital cities of Europe include",
    "To configure nginx as a reverse proxy,",
    "Q: What is the derivative of x^3?\nA:",
    "The best way to learn a new language is",
    "<html>\n<head>\n<title>",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
];
const GENERATED: usize = 256;
const BLOCK: usize = 16;

/// Logits at every position of `tokens`, in one forward over a fresh cache of `scheme`.
fn logits(model: &dyn CausalLm, tokens: &[u32], scheme: &KvScheme) -> Vec<f32> {
    let blocks = tokens.len().div_ceil(BLOCK);
    let groups = model.kv_layout().groups.len();
    let mut kv = model.new_kv_cache(&vec![blocks; groups], BLOCK, scheme).expect("kv cache");
    let mut batch = ForwardBatch::default();
    batch.push_row(tokens, tokens.len(), vec![(0..blocks as u32).collect(); groups], RowLogits::All);
    model.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("forward")
}

fn softmax64(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = row.iter().map(|&x| f64::from(x - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0
}

#[test]
#[ignore = "real weights, minutes of CPU: run with --ignored --nocapture"]
fn quantized_kv_tracks_f16_on_real_weights() {
    println!("model                 dtype      top-1 agree   mean KL");
    for name in ["smollm2", "gemma3-270m", "qwen2.5-coder-0.5b"] {
        let path = registry::resolve(name, &paths::models_dir()).expect("model (run `ferrite pull`)");
        let loaded = ferrite_models::load(&path).expect("load");
        let tok = loaded.tokenizer.clone().expect("tokenizer");
        let m = loaded.model.clone();
        let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| tok.encode(p, true).expect("encode")).collect();
        let cfg = EngineConfig { max_model_len: Some(512), ..EngineConfig::default() };
        let mut core = core(&m, cfg);
        let mut rxs: Vec<_> =
            prompts.iter().enumerate().map(|(i, p)| add(&mut core, i as u64, p.clone(), greedy(GENERATED))).collect();
        run_to_end(&mut core);
        let runs: Vec<Vec<u32>> =
            prompts.iter().zip(&mut rxs).map(|(p, rx)| [p.clone(), collect(rx, 1).remove(0)].concat()).collect();
        let vocab = m.config().vocab_size;
        let dtypes = [KvDtype::Int8 { group: 64 }, KvDtype::Int4 { group: 64 }];
        // Per dtype: positions whose top-1 agrees, summed KL, positions.
        let mut stats = [(0usize, 0f64, 0usize); 2];
        for (run, prompt) in runs.iter().zip(&prompts) {
            let want = logits(&*m, run, &KvScheme::default());
            for (dtype, (agree, kl, n)) in dtypes.iter().zip(&mut stats) {
                let got = logits(&*m, run, &KvScheme { dtype: *dtype, ..KvScheme::default() });
                // Positions whose next token was generated.
                for pos in prompt.len() - 1..run.len() - 1 {
                    let (w, g) = (&want[pos * vocab..(pos + 1) * vocab], &got[pos * vocab..(pos + 1) * vocab]);
                    *agree += usize::from(argmax(w) == argmax(g));
                    let (p, q) = (softmax64(w), softmax64(g));
                    *kl += p
                        .iter()
                        .zip(&q)
                        .filter(|(p, _)| **p > 0.0)
                        .map(|(p, q)| p * (p / q.max(1e-300)).ln())
                        .sum::<f64>();
                    *n += 1;
                }
            }
        }
        for (dtype, (agree, kl, n)) in dtypes.iter().zip(stats) {
            let (agree, kl) = (agree as f64 / n as f64, kl / n as f64);
            println!("{name:<21} {:<10} {agree:>10.4}   {kl:.2e}", dtype.to_string());
            if matches!(dtype, KvDtype::Int8 { .. }) {
                assert!(kl <= 1e-3, "{name}: int8 KV mean KL {kl:.2e} over 1e-3");
            }
        }
    }
}
