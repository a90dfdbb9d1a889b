//! `ferrite run MODEL -p TEXT`: one completion, text on stdout, stats on stderr.

use anyhow::Result;
use clap::Args;
use serde_json::json;

use crate::session::{report, EngineArgs, ModelArgs, SamplingArgs, Session};

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The prompt.
    #[arg(short = 'p', long)]
    pub prompt: String,
    /// Tokenize the prompt as is instead of wrapping it in the chat template as a user turn.
    #[arg(long)]
    pub raw: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub fn run(args: RunArgs) -> Result<()> {
    let mut session = Session::open(&args.model, &args.engine)?;
    session.note_ignored_flags(&args.sampling);
    let use_template = !args.raw && session.loaded.chat_template.is_some();
    let prompt = if use_template {
        session.chat_prompt(&[json!({"role": "user", "content": args.prompt})])?
    } else {
        session.raw_prompt(&args.prompt)?
    };
    let (_, stats) = session.stream(prompt, &args.sampling)?;
    // stdout carries exactly the generated text; the line break for the terminal goes to stderr.
    eprintln!();
    report(&stats);
    Ok(())
}
