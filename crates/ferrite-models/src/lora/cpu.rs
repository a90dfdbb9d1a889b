//! LoRA in the CPU executor. `CpuLora` is an adapter attached to a `Decoder`: its matrices
//! per (layer, projection), each checked against the base projection's shape. `LoraStep` is
//! one step's view: which query tokens run through which attached adapter (from the rows'
//! `adapter` ids). At each adapted projection the base matmul runs once for every token, then
//! `LayerLora::add` adds the low-rank update of the tokens whose adapter adapts it, all of
//! them in one parallel loop (`cpu::lora_add`).

use ferrite_runtime::cpu::{self, LoraPair};
use ferrite_runtime::{ForwardBatch, Result as RtResult, RuntimeError};

use super::{LoraAdapter, LoraTarget};
use crate::error::{LoadError, Result};

/// An adapter attached to a CPU model: per layer, per projection (`LoraTarget::index`).
pub struct CpuLora {
    layers: Vec<[Option<LoraPair>; 7]>,
}

impl CpuLora {
    /// `adapter` on a base of `layers` layers whose projection `target` of layer `i` maps
    /// `shape(i, target) = Some((in, out))` features (None: the layer has no such projection).
    pub fn new(
        adapter: &LoraAdapter,
        layers: usize,
        shape: impl Fn(usize, LoraTarget) -> Option<(usize, usize)>,
    ) -> Result<CpuLora> {
        adapter.check_fits(layers, &shape)?;
        let mut out: Vec<[Option<LoraPair>; 7]> = (0..layers).map(|_| Default::default()).collect();
        for m in &adapter.modules {
            let pair =
                LoraPair::new(m.a.clone(), m.b.clone(), adapter.rank, m.in_features, adapter.scale).map_err(|e| {
                    LoadError::format(&adapter.path, format!("layers.{}.{}: {e}", m.layer, m.target.module()))
                })?;
            out[m.layer][m.target.index()] = Some(pair);
        }
        Ok(CpuLora { layers: out })
    }

    fn pair(&self, layer: usize, target: LoraTarget) -> Option<&LoraPair> {
        self.layers.get(layer)?[target.index()].as_ref()
    }
}

/// Which query tokens of a step run through which adapter, in token order.
#[derive(Default)]
pub struct LoraStep<'a> {
    tokens: Vec<(usize, &'a CpuLora)>,
}

impl<'a> LoraStep<'a> {
    /// The step of `batch`, whose rows' adapter ids `attached` resolves; an id it does not
    /// know is an error.
    pub fn new(batch: &ForwardBatch, attached: impl Fn(u32) -> Option<&'a CpuLora>) -> RtResult<LoraStep<'a>> {
        let mut tokens = Vec::new();
        for row in &batch.rows {
            let Some(id) = row.adapter else { continue };
            let lora = attached(id).ok_or_else(|| {
                RuntimeError::Shape(format!("a row runs through LoRA adapter {id}, which is not attached"))
            })?;
            tokens.extend((row.query_start..row.query_start + row.query_len).map(|t| (t, lora)));
        }
        tokens.sort_unstable_by_key(|&(t, _)| t);
        Ok(LoraStep { tokens })
    }

    /// The step's adapters at layer `layer`.
    pub fn layer(&self, layer: usize) -> LayerLora<'_> {
        LayerLora { step: (!self.tokens.is_empty()).then_some(self), layer }
    }
}

/// One layer's view of a step's adapters.
#[derive(Clone, Copy)]
pub struct LayerLora<'a> {
    step: Option<&'a LoraStep<'a>>,
    layer: usize,
}

impl LayerLora<'static> {
    /// No adapter (a MoE expert, a step of base rows only).
    pub const NONE: Self = LayerLora { step: None, layer: 0 };
}

impl LayerLora<'_> {
    /// `out` (`[t, out]`, the base projection `target` of `x`, `[t, in]`) gains the update of
    /// every token whose adapter adapts `target` in this layer.
    pub fn add(&self, target: LoraTarget, x: &[f32], out: &mut [f32]) -> RtResult<()> {
        let Some(step) = self.step else { return Ok(()) };
        let work: Vec<(usize, &LoraPair)> =
            step.tokens.iter().filter_map(|&(t, l)| l.pair(self.layer, target).map(|p| (t, p))).collect();
        cpu::lora_add(x, &work, out)
    }
}
