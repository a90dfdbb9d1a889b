//! Where a layer's experts are stored: which of the layouts `ExpertNames` lists the weights
//! use, and, per expert and projection, the tensor and its rows. The CPU experts (`Experts`)
//! and the CUDA executor's stacked expert matrices read the weights through it.

use std::ops::Range;

use crate::error::{LoadError, Result};
use crate::moe::MoeShape;
use crate::plan::ExpertNames;
use crate::weights::Weights;

/// One projection of an expert's gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Projection {
    Gate,
    Up,
    Down,
}

/// Rows `rows` of the tensor `name` (its shape `shape`, viewed as `[rows, last dim]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertRows {
    pub name: String,
    pub shape: Vec<usize>,
    pub rows: Range<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stored {
    /// `{experts}.gate_up_proj` `[E, 2 × inter, hidden]` (gate rows first) and
    /// `{experts}.down_proj` `[E, hidden, inter]` (transformers 5, Gemma 4).
    Fused,
    /// `{experts}.{gate}.weight` `[E, inter, hidden]`, the same for up, and down
    /// `[E, hidden, inter]` (GGUF's `ffn_{gate,up,down}_exps`).
    Stacked,
    /// `{experts}.{e}.{gate}.weight` `[inter, hidden]` per expert (Hugging Face checkpoints of
    /// Qwen3-MoE and Mixtral).
    PerExpert,
}

/// A layer's experts as the weights store them.
#[derive(Debug, Clone)]
pub struct ExpertLayout {
    stored: Stored,
    names: ExpertNames,
    shape: MoeShape,
    hidden: usize,
}

impl ExpertLayout {
    /// The layout of the experts `names` gives, found in `w` (shapes are checked when the
    /// tensors are read).
    pub fn find(w: &Weights, names: &ExpertNames, shape: MoeShape, hidden: usize) -> Result<ExpertLayout> {
        let base = &names.experts;
        let fused = format!("{base}.gate_up_proj");
        let stacked = format!("{base}.{}.weight", names.gate);
        let stored = if w.contains(&fused) {
            Stored::Fused
        } else if w.contains(&stacked) {
            Stored::Stacked
        } else if w.contains(&format!("{base}.0.{}.weight", names.gate)) {
            Stored::PerExpert
        } else {
            return Err(LoadError::Other(format!(
                "the experts {base} are missing: none of {fused}, {stacked} or {base}.E.{}.weight is in the weights",
                names.gate
            )));
        };
        Ok(ExpertLayout { stored, names: names.clone(), shape, hidden })
    }

    /// Where expert `e`'s rows of projection `p` are (gate and up: `inter` rows of `hidden`
    /// values; down: `hidden` rows of `inter`).
    pub fn rows(&self, e: usize, p: Projection) -> ExpertRows {
        let (n, inter, d) = (self.shape.num_experts, self.shape.intermediate, self.hidden);
        let base = &self.names.experts;
        let name = match p {
            Projection::Gate => self.names.gate,
            Projection::Up => self.names.up,
            Projection::Down => self.names.down,
        };
        let (out, inp) = if p == Projection::Down { (d, inter) } else { (inter, d) };
        match self.stored {
            Stored::Fused if p == Projection::Down => {
                ExpertRows { name: format!("{base}.down_proj"), shape: vec![n, d, inter], rows: d * e..d * (e + 1) }
            }
            Stored::Fused => {
                let at = 2 * inter * e + if p == Projection::Up { inter } else { 0 };
                ExpertRows { name: format!("{base}.gate_up_proj"), shape: vec![n, 2 * inter, d], rows: at..at + inter }
            }
            Stored::Stacked => ExpertRows {
                name: format!("{base}.{name}.weight"),
                shape: vec![n, out, inp],
                rows: out * e..out * (e + 1),
            },
            Stored::PerExpert => {
                ExpertRows { name: format!("{base}.{e}.{name}.weight"), shape: vec![out, inp], rows: 0..out }
            }
        }
    }
}
