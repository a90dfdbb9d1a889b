//! Each layer's RoPE on the device: one table of frequencies, or — for a schedule that depends
//! on the row's length (dynamic NTK, long RoPE) — tables written before each step for its
//! rows, one per distinct schedule key, with each token pointing at its row's: what the CPU
//! executor does with `rope_for(row.context_len)` per row, in one launch for the whole step.

use ferrite_runtime::cuda::ops::{self, AttentionMeta, DeviceKv, RopeShape};
use ferrite_runtime::cuda::{CudaSlice, CudaView, Gpu};
use ferrite_runtime::{ForwardBatch, Padding, Result as RtResult, RuntimeError};
use half::bf16;

use crate::error::Result;
use crate::plan::DecoderPlan;
use crate::rope_scaling::RopeScaling;

/// One layer's RoPE.
enum LayerRope {
    /// One table for every token (empty: a NoPE layer).
    Fixed { inv_freq: CudaSlice<f32>, scaling: f32 },
    /// The step's tables of schedule `schedule` (`Ropes::schedules`). Both kinds scale cos
    /// and sin alike at every length.
    PerRow { schedule: usize, half: usize, scaling: f32 },
}

/// A per-row schedule's frequencies for one step: a table (`half` values) per distinct key of
/// the step's rows, and each token's table.
pub struct StepRope {
    tables: CudaSlice<f32>,
    table_of: CudaSlice<i32>,
}

/// The RoPE of every layer of a model.
pub struct Ropes {
    layers: Vec<LayerRope>,
    /// The distinct schedules that depend on the row's length.
    schedules: Vec<RopeScaling>,
}

impl Ropes {
    pub fn new(gpu: &Gpu, plan: &DecoderPlan) -> Result<Ropes> {
        let mut schedules: Vec<RopeScaling> = Vec::new();
        let mut layers = Vec::with_capacity(plan.layers.len());
        for l in &plan.layers {
            let (rope, r) = (&l.attn.rope, l.attn.rope.rope_for(0));
            if !rope.is_dynamic() || rope.rotary_dim == 0 {
                layers.push(LayerRope::Fixed { inv_freq: gpu.upload(&r.inv_freq)?, scaling: r.attention_scaling });
                continue;
            }
            let schedule = schedules.iter().position(|s| s == rope).unwrap_or_else(|| {
                schedules.push(rope.clone());
                schedules.len() - 1
            });
            layers.push(LayerRope::PerRow { schedule, half: rope.rotary_dim / 2, scaling: r.attention_scaling });
        }
        Ok(Ropes { layers, schedules })
    }

    /// Layer `i`'s frequencies and scaling when it has one non-empty table for every token
    /// (what the decode attention kernel can rotate by itself).
    pub fn fixed(&self, i: usize) -> Option<(&CudaSlice<f32>, f32)> {
        match self.layers.get(i) {
            Some(LayerRope::Fixed { inv_freq, scaling }) if !inv_freq.is_empty() => Some((inv_freq, *scaling)),
            _ => None,
        }
    }

    /// Per-step tables for steps of up to `tokens` tokens (none without per-row schedules).
    pub fn step_buffers(&self, gpu: &Gpu, tokens: usize) -> RtResult<Vec<StepRope>> {
        let tokens = tokens.max(1);
        (self.schedules.iter())
            .map(|s| Ok(StepRope { tables: gpu.alloc(tokens * (s.rotary_dim / 2))?, table_of: gpu.alloc(tokens)? }))
            .collect()
    }

    /// Write `steps` for `batch` padded as `pad` says (the padding tokens of a graph bucket
    /// point at the first table).
    pub fn upload(&self, gpu: &Gpu, steps: &mut [StepRope], batch: &ForwardBatch, pad: Padding) -> RtResult<()> {
        let tokens = pad.tokens(batch);
        for (schedule, step) in self.schedules.iter().zip(steps) {
            let mut keys: Vec<usize> = Vec::new();
            let mut table_of = vec![0i32; tokens];
            for row in &batch.rows {
                let key = schedule.schedule_key(row.context_len);
                let table = keys.iter().position(|&k| k == key).unwrap_or_else(|| {
                    keys.push(key);
                    keys.len() - 1
                });
                let span = row.query_start..row.query_start + row.query_len;
                let what = || RuntimeError::Shape(format!("a row spans tokens {span:?} of a step of {tokens}"));
                table_of.get_mut(span.clone()).ok_or_else(what)?.fill(table as i32);
            }
            let tables: Vec<f32> = keys.iter().flat_map(|&k| schedule.rope_for(k).inv_freq).collect();
            gpu.upload_into(&tables, &mut step.tables)?;
            gpu.upload_into(&table_of, &mut step.table_of)?;
        }
        Ok(())
    }

    /// Rotate layer `i`'s heads of `x` (as `ops::rope`, storing K and V with `store`).
    #[allow(clippy::too_many_arguments)]
    pub fn queue(
        &self,
        gpu: &Gpu,
        i: usize,
        steps: &[StepRope],
        x: &mut CudaSlice<bf16>,
        positions: &CudaView<'_, u32>,
        shape: RopeShape,
        store: Option<(&AttentionMeta, &mut DeviceKv)>,
    ) -> RtResult<()> {
        let missing = || RuntimeError::Shape(format!("layer {i} has no RoPE"));
        match self.layers.get(i).ok_or_else(missing)? {
            LayerRope::Fixed { inv_freq, scaling } => {
                Ok(ops::rope(gpu, x, positions, inv_freq, *scaling, shape, store)?)
            }
            LayerRope::PerRow { schedule, half, scaling } => {
                let what = || RuntimeError::Shape(format!("no step tables for RoPE schedule {schedule}"));
                let t = steps.get(*schedule).ok_or_else(what)?;
                let freqs = (&t.tables, *half, &t.table_of);
                Ok(ops::rope_per_token(gpu, x, positions, freqs, *scaling, shape, store)?)
            }
        }
    }
}
