//! `ferrite chat MODEL`: a multi-turn conversation in the terminal through the chat template.

use std::io::{BufRead, Write};

use anyhow::Result;
use clap::Args;
use serde_json::{json, Value};

use crate::session::{report, EngineArgs, ModelArgs, SamplingArgs, Session};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// An optional system prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// Print speed statistics after each answer.
    #[arg(long)]
    pub stats: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub fn chat(args: ChatArgs) -> Result<()> {
    let mut session = Session::open(&args.model, &args.engine)?;
    session.note_ignored_flags(&args.sampling);
    let start: Vec<Value> = args.system.iter().map(|s| json!({"role": "system", "content": s})).collect();
    let mut messages = start.clone();
    eprintln!("chat ready: /exit to quit, /reset to start over");
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!("> ");
        let _ = std::io::stderr().flush();
        let Some(line) = lines.next() else { break };
        let line = line?;
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = start.clone();
                eprintln!("(conversation reset)");
                continue;
            }
            _ => {}
        }
        messages.push(json!({"role": "user", "content": line}));
        let prompt = match session.chat_prompt(&messages) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("error: {e:#}");
                messages.pop();
                continue;
            }
        };
        match session.stream(prompt, &args.sampling) {
            Ok((text, stats)) => {
                println!();
                if args.stats {
                    report(&stats);
                }
                messages.push(json!({"role": "assistant", "content": text}));
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                messages.pop();
            }
        }
    }
    Ok(())
}
