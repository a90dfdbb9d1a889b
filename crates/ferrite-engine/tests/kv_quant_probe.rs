//! Scratch diagnosis of int8 KV accuracy on Qwen2.5-Coder-0.5B (not committed).

mod common;

use common::*;
use ferrite_engine::EngineConfig;
use ferrite_models::model::{CausalLm, Pending, Want};
use ferrite_models::{paths, registry};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::{ForwardBatch, KvCache, KvDtype, KvScheme, KvSkip};

const PROMPTS: [&str; 6] = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Explain why the sky is blue to a ten-year-old.",
    "SELECT name, COUNT(*) FROM orders",
    "fn main() {\n    let v: Vec<u32> =",
    "Q: What is the derivative of x^3?\nA:",
];
const BLOCK: usize = 16;

fn run(model: &dyn CausalLm, tokens: &[u32], scheme: &KvScheme) -> (Vec<f32>, KvCache) {
    run_off(model, tokens, scheme, None)
}

fn run_off(
    model: &dyn CausalLm,
    tokens: &[u32],
    scheme: &KvScheme,
    off: Option<&[Option<Vec<f32>>]>,
) -> (Vec<f32>, KvCache) {
    let blocks = tokens.len().div_ceil(BLOCK);
    let groups = model.kv_layout().groups.len();
    let mut kv = model.new_kv_cache(&vec![blocks; groups], BLOCK, scheme).expect("kv cache");
    if let Some(o) = off {
        kv.set_key_offsets(o).unwrap();
    }
    let mut batch = ForwardBatch::default();
    batch.push_row(tokens, tokens.len(), vec![(0..blocks as u32).collect(); groups], RowLogits::All);
    let l = model.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("forward");
    (l, kv)
}

fn kl(want: &[f32], got: &[f32], vocab: usize, from: usize) -> f64 {
    let sm = |row: &[f32]| {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = row.iter().map(|&x| f64::from(x - max).exp()).collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|x| x / s).collect::<Vec<_>>()
    };
    let n = want.len() / vocab;
    let mut t = 0.0;
    for pos in from..n - 1 {
        let (p, q) = (sm(&want[pos * vocab..(pos + 1) * vocab]), sm(&got[pos * vocab..(pos + 1) * vocab]));
        t += p.iter().zip(&q).filter(|(p, _)| **p > 0.0).map(|(p, q)| p * (p / q.max(1e-300)).ln()).sum::<f64>();
    }
    t / (n - 1 - from) as f64
}

#[test]
#[ignore]
fn probe() {
    let name = std::env::var("PROBE_MODEL").unwrap_or("qwen2.5-coder-0.5b".into());
    let path = registry::resolve(&name, &paths::models_dir()).expect("model");
    let loaded = ferrite_models::load(&path).expect("load");
    let tok = loaded.tokenizer.clone().expect("tokenizer");
    let m = loaded.model.clone();
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| tok.encode(p, true).expect("encode")).collect();
    let mut core = core(&m, EngineConfig { max_model_len: Some(512), ..EngineConfig::default() });
    let mut rxs: Vec<_> =
        prompts.iter().enumerate().map(|(i, p)| add(&mut core, i as u64, p.clone(), greedy(64))).collect();
    run_to_end(&mut core);
    let runs: Vec<Vec<u32>> =
        prompts.iter().zip(&mut rxs).map(|(p, rx)| [p.clone(), collect(rx, 1).remove(0)].concat()).collect();
    let vocab = m.config().vocab_size;
    let nl = m.kv_layout().layers.len();
    let mode = std::env::var("PROBE").unwrap_or("all".into());
    let g: usize = std::env::var("PROBE_G").ok().and_then(|v| v.parse().ok()).unwrap_or(64);
    let int8 = KvDtype::Int8 { group: g };
    let mut total = 0.0;
    let mut per_layer = vec![0.0; nl];
    for (run_tokens, prompt) in runs.iter().zip(&prompts) {
        let (want, f16kv) = run(&*m, run_tokens, &KvScheme::default());
        if mode == "pos" {
            let mut f16kv = f16kv;
            for l in [0usize, 1, 8] {
                let layer = f16kv.layer_mut(l).unwrap();
                let hd = layer.spec.head_dim;
                let k = layer.k.to_f32();
                let v = layer.v.to_f32();
                // layout [block][head][slot][hd], BLOCK slots
                let nkv = layer.spec.n_kv_heads;
                let row = |pool: &Vec<f32>, h: usize, p: usize| -> Vec<f32> {
                    let off = (((p / BLOCK) * nkv + h) * BLOCK + p % BLOCK) * hd;
                    pool[off..off + hd].to_vec()
                };
                for h in 0..nkv {
                    let mut ranges: Vec<(usize, f32, f32)> = (0..run_tokens.len())
                        .map(|p| {
                            let r = row(&k, h, p);
                            let (lo, hi) = r.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                            let vr = row(&v, h, p);
                            let (vlo, vhi) = vr.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                            (p, hi - lo, vhi - vlo)
                        })
                        .collect();
                    let first: Vec<_> = ranges[..4].iter().map(|x| format!("{:.1}/{:.3}", x.1, x.2)).collect();
                    ranges.sort_by(|a, b| a.1.total_cmp(&b.1));
                    let med = ranges[ranges.len() / 2];
                    println!("layer {l} head {h}: K/V range first tokens {first:?}, median K {:.1} V {:.3}, max K {:.1} at {}", med.1, med.2, ranges.last().unwrap().1, ranges.last().unwrap().0);
                    // per channel: mean and std over positions >= 1
                    let n = run_tokens.len();
                    let mut line = String::new();
                    for c in [0usize, 27, 28, 29, 30, 31, 59, 60, 61, 62, 63] {
                        let xs: Vec<f32> = (1..n).map(|p| row(&k, h, p)[c]).collect();
                        let mean = xs.iter().sum::<f32>() / xs.len() as f32;
                        let sd = (xs.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / xs.len() as f32).sqrt();
                        line += &format!(" c{c}:{mean:.0}±{sd:.0}(p0 {:.0})", row(&k, h, 0)[c]);
                    }
                    println!("   {line}");
                }
            }
            return;
        }
        if mode == "stats" {
            let mut f16kv = f16kv;
            for l in 0..nl {
                let layer = f16kv.layer_mut(l).unwrap();
                let hd = layer.spec.head_dim;
                let n = run_tokens.len() * layer.spec.n_kv_heads; // rows (whole cache may be padded)
                for (which, pool) in [("K", layer.k.to_f32()), ("V", layer.v.to_f32())] {
                    let rows: Vec<&[f32]> = pool.chunks(hd).take(n.max(1)).collect();
                    let mut maxc = vec![0f32; hd];
                    let mut meanc = vec![0f64; hd];
                    let mut steps = 0.0f64;
                    for r in &rows {
                        for (c, &x) in r.iter().enumerate() {
                            maxc[c] = maxc[c].max(x.abs());
                            meanc[c] += x as f64 / rows.len() as f64;
                        }
                        for grp in r.chunks(g) {
                            let (lo, hi) = grp.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                            steps += ((hi - lo) / 255.0) as f64;
                        }
                    }
                    let gm = maxc.iter().copied().fold(0.0, f32::max);
                    let med = {
                        let mut v = maxc.clone();
                        v.sort_by(f32::total_cmp);
                        v[hd / 2]
                    };
                    let top = maxc
                        .iter()
                        .enumerate()
                        .filter(|(_, &x)| x > 4.0 * med)
                        .map(|(c, &x)| format!("{c}:{x:.0}(mean {:.0})", meanc[c]))
                        .collect::<Vec<_>>();
                    println!(
                        "layer {l:2} {which} max {gm:8.2} median-channel-max {med:6.2} mean-step {:.4} outliers {:?}",
                        steps / (rows.len() * hd / g) as f64,
                        top
                    );
                }
            }
            return;
        }
        let offsets: Option<Vec<Option<Vec<f32>>>> = (mode == "oracle").then(|| {
            let mut f16kv = f16kv;
            (0..nl)
                .map(|l| {
                    let layer = f16kv.layer_mut(l).unwrap();
                    let (hd, nkv) = (layer.spec.head_dim, layer.spec.n_kv_heads);
                    let k = layer.k.to_f32();
                    let mut mu = vec![0f32; nkv * hd];
                    for p in 0..run_tokens.len() {
                        for h in 0..nkv {
                            let off = (((p / BLOCK) * nkv + h) * BLOCK + p % BLOCK) * hd;
                            for c in 0..hd {
                                mu[h * hd + c] += k[off + c] / run_tokens.len() as f32;
                            }
                        }
                    }
                    Some(mu)
                })
                .collect()
        });
        let (got, _) = run_off(&*m, run_tokens, &KvScheme { dtype: int8, ..Default::default() }, offsets.as_deref());
        total += kl(&want, &got, vocab, prompt.len() - 1);
        if mode == "layers" {
            for l in 0..nl {
                let skip = KvSkip::List((0..nl).filter(|&i| i != l).collect());
                let (got, _) = run(&*m, run_tokens, &KvScheme { dtype: int8, skip });
                per_layer[l] += kl(&want, &got, vocab, prompt.len() - 1);
            }
        }
    }
    println!("{name} int8/g{g} mean KL over {} runs: {:.3e}", runs.len(), total / runs.len() as f64);
    for (l, k) in per_layer.iter().enumerate() {
        if mode == "layers" {
            println!("  only layer {l:2}: {:.3e}", k / runs.len() as f64);
        }
    }
}
