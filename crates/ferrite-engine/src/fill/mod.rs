//! Fill: tokens a row appends that the model does not have to sample one by one.
//!
//! `--fill strict` asserts tool-call scaffolds (the fixed tokens of the chat template's
//! tool-call syntax, found by `scaffold::ToolScaffold::discover`) on free rows, and the tokens
//! the grammar forces on constrained rows (structured output, forced tool calls); `--fill
//! echo` also verifies
//! echo spans (n-gram lookup over the conversation, `spec::ngram`). Both are proposals
//! (`spec::Proposal`) that share the batch with plain and speculative rows.

pub mod scaffold;

use std::str::FromStr;

pub use scaffold::{ScaffoldCursor, ToolScaffold};

use crate::spec::FillUsage;

/// A row's fill state: its mode, where it is in the tool-call scaffold, its counters.
#[derive(Debug, Clone, Copy, Default)]
pub struct FillState {
    pub mode: FillMode,
    pub cursor: ScaffoldCursor,
    pub usage: FillUsage,
}

/// How a request fills.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FillMode {
    /// Every token is sampled.
    #[default]
    Off,
    /// Assert tool-call scaffolds, or what a constrained row's grammar forces.
    Strict,
    /// Strict, plus verify echo spans copied from the conversation.
    Echo,
}

impl FillMode {
    pub fn asserts_scaffolds(self) -> bool {
        self != FillMode::Off
    }
    pub fn echoes(self) -> bool {
        self == FillMode::Echo
    }
}

impl FromStr for FillMode {
    type Err = String;
    fn from_str(s: &str) -> Result<FillMode, String> {
        match s {
            "off" => Ok(FillMode::Off),
            "strict" => Ok(FillMode::Strict),
            "echo" => Ok(FillMode::Echo),
            _ => Err(format!("fill must be off, strict or echo, got {s:?}")),
        }
    }
}
