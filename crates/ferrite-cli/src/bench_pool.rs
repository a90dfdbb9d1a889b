//! `ferrite bench switch A B`: what a pool pays to swap one resident model for another on the
//! CPU — unloading one (dropping its engine) and loading the other (weights and engine start),
//! each way, as `serve` loads them. `ferrite bench respawn MODEL`: how long an isolated
//! engine (`serve --isolate`) takes to come back after a `kill -9` — until its new process is
//! ready, and until a request sent right after the kill gets its first token.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use clap::Args;
use ferrite_engine::{Request, RequestParams};
use ferrite_runtime::cuda::DeviceChoice;
use ferrite_server::isolate::{IsolatedEngine, WorkerCommand, MAX_RESTARTS};
use ferrite_server::pool::{EngineBackend, EngineHealth};
use serde_json::json;

use crate::session::EngineArgs;

#[derive(Args)]
pub struct SwitchArgs {
    /// The two models (paths or names).
    pub a: String,
    pub b: String,
    /// Switches each way.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct RespawnArgs {
    /// The model (a path or a name).
    pub model: String,
    /// Crashes to time (at most the restart limit, 3).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

pub fn switch(a: SwitchArgs) -> Result<()> {
    let threads = ferrite_runtime::threads::init(a.threads)?;
    let paths = [crate::model_arg::resolve(&a.a)?, crate::model_arg::resolve(&a.b)?];
    let engine_args = EngineArgs::default();
    let load = |path: &PathBuf| -> Result<(ferrite_engine::Engine, Duration)> {
        let t0 = Instant::now();
        let loaded = ferrite_models::load_on(path, DeviceChoice::Cpu)?;
        let engine = crate::pool::start_engine(&loaded, path, &engine_args, threads)?;
        Ok((engine, t0.elapsed()))
    };
    let (mut resident, _) = load(&paths[0])?;
    // (unload ms, load ms) of switches to B (index 0) and back to A (index 1).
    let mut switches: [Vec<(f64, f64)>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..a.rounds {
        for (to, way) in [(1, 0), (0, 1)] {
            let t0 = Instant::now();
            drop(resident);
            let unload = t0.elapsed();
            let (engine, load_time) = load(&paths[to])?;
            resident = engine;
            switches[way].push((ms(unload), ms(load_time)));
        }
    }
    let summary = |s: &[(f64, f64)]| {
        let (unload, load): (Vec<f64>, Vec<f64>) = s.iter().copied().unzip();
        let total = s.iter().map(|(u, l)| u + l).collect();
        (median(unload), median(load), median(total))
    };
    let names = [&a.a, &a.b];
    if a.json {
        let ways: Vec<_> = [(0, 1), (1, 0)]
            .iter()
            .zip(&switches)
            .map(|(&(from, to), s)| {
                let (unload, load, total) = summary(s);
                json!({"from": names[from], "to": names[to], "unload_ms": unload, "load_ms": load, "switch_ms": total})
            })
            .collect();
        println!("{}", json!({"threads": threads, "rounds": a.rounds, "switches": ways}));
    } else {
        println!("model switch on the CPU ({threads} threads), median of {} rounds:", a.rounds);
        for (&(from, to), s) in [(0, 1), (1, 0)].iter().zip(&switches) {
            let (unload, load, total) = summary(s);
            println!("  {} -> {}: unload {unload:.0} ms + load {load:.0} ms = {total:.0} ms", names[from], names[to]);
        }
    }
    Ok(())
}

pub fn respawn(a: RespawnArgs) -> Result<()> {
    if a.rounds == 0 || a.rounds > MAX_RESTARTS {
        bail!("--rounds must be between 1 and {MAX_RESTARTS} (the restart limit)");
    }
    let path = crate::model_arg::resolve(&a.model)?;
    let mut serve_args = vec!["--model".to_string(), format!("m={}", path.display()), "--device".into(), "cpu".into()];
    if let Some(t) = a.threads {
        serve_args.extend(["--threads".into(), t.to_string()]);
    }
    let command = WorkerCommand {
        program: std::env::current_exe()?,
        args: vec![crate::worker::SUBCOMMAND.into(), "m".into(), serde_json::to_string(&serve_args)?],
    };
    let engine = IsolatedEngine::spawn("m", command).map_err(|e| anyhow!(e))?;
    let runtime = tokio::runtime::Builder::new_current_thread().build()?;
    let (mut ready, mut first_token) = (Vec::new(), Vec::new());
    for _ in 0..a.rounds {
        let old = engine.pid().ok_or_else(|| anyhow!("the engine has no process"))?;
        let t0 = Instant::now();
        let killed = std::process::Command::new("kill").args(["-9", &old.to_string()]).status()?;
        if !killed.success() {
            bail!("kill -9 {old} failed");
        }
        // Sent at once: it fails with the crash or waits for the restart; retried until served.
        let token = loop {
            let params = RequestParams { max_tokens: Some(1), ..RequestParams::default() };
            if let Ok(mut stream) = engine.submit(Request { prompt: vec![1, 2, 3], params }) {
                let out = runtime.block_on(stream.next());
                if out.is_some_and(|o| o.finished.as_ref().is_none_or(|f| f.error.is_none())) {
                    break t0.elapsed();
                }
            }
            if let EngineHealth::Down(why) = engine.health() {
                bail!("the engine went down: {why}");
            }
        };
        let restart = engine.last_restart().ok_or_else(|| anyhow!("no restart was recorded"))?;
        ready.push(ms(restart));
        first_token.push(ms(token));
    }
    let (ready, first_token) = (median(ready), median(first_token));
    if a.json {
        println!(
            "{}",
            json!({"model": a.model, "rounds": a.rounds, "restart_ms": ready, "kill_to_first_token_ms": first_token})
        );
    } else {
        println!(
            "respawn of {} after kill -9, median of {} rounds: ready again in {ready:.0} ms, first token of a request \
             sent at the kill after {first_token:.0} ms",
            a.model, a.rounds
        );
    }
    Ok(())
}
