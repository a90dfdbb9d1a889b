//! `ferrite bench embed`: embeddings per second of an embedding model on inputs of a fixed
//! length (random token ids), at each batch size asked for: a batch is that many embedding
//! requests submitted at once, which the engine runs in one step. One warm-up batch, then
//! `--reps` measured ones; the median is reported. `scripts/bench_embed_st.py` measures
//! sentence-transformers the same way.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrite_engine::{Engine, Request, RequestParams};
use serde_json::json;

use crate::bench::{pct, Lcg};
use crate::session::{EngineArgs, ModelArgs};

#[derive(Args)]
pub struct EmbedArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Tokens per input.
    #[arg(long, default_value_t = 512)]
    pub input_tokens: usize,
    /// Batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 32])]
    pub batch: Vec<usize>,
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Embed `inputs` at once; the seconds it took.
fn timed_batch(engine: &Engine, inputs: &[Vec<u32>]) -> Result<f64> {
    let t0 = Instant::now();
    let params = RequestParams { embed: true, ..Default::default() };
    let streams = inputs
        .iter()
        .map(|ids| engine.submit(Request { prompt: ids.clone(), params: params.clone() }))
        .collect::<Result<Vec<_>, _>>()?;
    for mut s in streams {
        let out = s.blocking_next().context("the engine stopped")?;
        if let Some(e) = out.finished.and_then(|f| f.error) {
            bail!("embedding failed: {e}");
        }
        out.embedding.context("an embedding request came back without its embedding")?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

pub fn embed(a: EmbedArgs) -> Result<()> {
    if a.reps == 0 || a.input_tokens == 0 || a.batch.contains(&0) {
        bail!("--reps, --input-tokens and every --batch must be at least 1");
    }
    let (loaded, path, threads) = a.model.load()?;
    let spec = loaded.model.embedding().cloned().context("this model does not make embeddings")?;
    let vocab = loaded.model.config().vocab_size;
    let largest = a.batch.iter().copied().max().unwrap_or(1);
    let engine_args = EngineArgs {
        max_num_seqs: largest,
        max_num_batched_tokens: largest * a.input_tokens,
        max_model_len: Some(a.input_tokens),
        no_prefix_cache: true,
        ..EngineArgs::default()
    };
    let engine = engine_args.start(&loaded, &path)?;
    let mut lcg = Lcg(0x9E37_79B9_7F4A_7C15);
    let mut rows = Vec::new();
    for &b in &a.batch {
        let inputs: Vec<Vec<u32>> =
            (0..b).map(|_| (0..a.input_tokens).map(|_| lcg.next(vocab as u64) as u32).collect()).collect();
        timed_batch(&engine, &inputs)?;
        let mut rates: Vec<f64> =
            (0..a.reps).map(|_| timed_batch(&engine, &inputs).map(|s| b as f64 / s)).collect::<Result<_>>()?;
        rates.sort_by(f64::total_cmp);
        rows.push((b, pct(&rates, 0.5)));
    }
    let device = crate::session::device_report(&loaded, threads);
    if a.json {
        let results: Vec<_> = rows.iter().map(|(b, r)| json!({"batch": b, "embeddings_per_s": r})).collect();
        let out = json!({"model": a.model.name(), "device": device, "threads": threads, "input_tokens": a.input_tokens,
                         "dimensions": spec.dimensions, "reps": a.reps, "results": results});
        println!("{out}");
        return Ok(());
    }
    println!("{} ({device}), {} tokens per input, {} dimensions", a.model.name(), a.input_tokens, spec.dimensions);
    println!("{:>6} {:>14} {:>14}", "batch", "embeddings/s", "tokens/s");
    for (b, r) in rows {
        println!("{b:>6} {r:>14.2} {:>14.0}", r * a.input_tokens as f64);
    }
    Ok(())
}
