//! LoRA in the CUDA executor. `GpuLoras` holds a model's attached adapters: their matrices in
//! device memory (bf16, the scale folded into B) in the slots of one `LoraTable`, whose device
//! table of addresses the kernels read, and the engine's adapter ids mapped to slots. A step's
//! rows name their adapter by id (`RowSpan::adapter`); `StepLora` is the step's view the
//! layers use: after the base GEMM of an adapted projection (q/k/v fused, o, gate/up fused,
//! down) it adds every adapted token's `B · (A · x)` in two launches (`ops::lora_add`).
//!
//! Graphs: the per-step grouping is written before the step like the other inputs, and the
//! kernels take the adapters' addresses from the table, so a decode graph captured with
//! adapters stays valid when adapters are attached or detached later. Which projections a step
//! runs the LoRA launches for is the union over the attached adapters (`mask`), and a graph is
//! captured per mask (its variant): a step whose rows all run the base model replays the
//! graph without LoRA launches, and with adapters of q and v only the o and MLP launches stay
//! out. A layer an adapter leaves alone costs its two launches, which find no matrices.
//!
//! The shapes an adapter may have are the CPU executor's (`shape`): q, k, v, o, gate, up and
//! down with their (in, out) features, no k or v in a KV-shared layer, no v where the keys are
//! the values (Gemma 4's `attention_k_eq_v`): there the k update goes into both the k and the
//! v slice of the fused QKV rows, as the CPU copies the adapted keys.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use ferrite_runtime::cuda::ops::{self, LoraMatrices, LoraStep, LoraTable, LORA_TARGETS};
use ferrite_runtime::cuda::{DevicePtr, DevicePtrMut, Gpu};
use ferrite_runtime::{ForwardBatch, Result as RtResult, RuntimeError};
use half::bf16;

use crate::error::{LoadError, Result};
use crate::lora::{LoraAdapter, LoraTarget};
use crate::plan::DecoderPlan;

/// Adapters resident on one model at most.
pub const MAX_GPU_LORAS: usize = 64;

/// The projection groups of a layer, each one LoRA launch pair (bits of a mask).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraGroup {
    Qkv = 1,
    O = 2,
    GateUp = 4,
    Down = 8,
}

impl LoraGroup {
    fn of(target: LoraTarget) -> LoraGroup {
        match target {
            LoraTarget::Q | LoraTarget::K | LoraTarget::V => LoraGroup::Qkv,
            LoraTarget::O => LoraGroup::O,
            LoraTarget::Gate | LoraTarget::Up => LoraGroup::GateUp,
            LoraTarget::Down => LoraGroup::Down,
        }
    }
}

/// Per layer and projection (`LoraTarget` order): (in, out) features.
pub type LoraShapes = Vec<[Option<(usize, usize)>; LORA_TARGETS]>;

pub struct GpuLoras {
    /// What an adapter may adapt (the CPU executor's shapes).
    shapes: LoraShapes,
    /// Layers whose keys are the values.
    k_eq_v: Vec<bool>,
    state: Mutex<State>,
}

#[derive(Default)]
pub struct State {
    /// Made at the first attach.
    table: Option<LoraTable>,
    /// Adapter id → (slot, projection groups it adapts).
    slots: HashMap<u32, (usize, u8)>,
}

impl State {
    /// The projection groups any attached adapter adapts.
    fn mask(&self) -> u8 {
        self.slots.values().fold(0, |m, &(_, g)| m | g)
    }
}

impl GpuLoras {
    /// The adapters a model of `plan` may attach (`mlp(i)`: whether layer i has a dense MLP and
    /// whether it is gated).
    pub fn new(plan: &DecoderPlan, hidden: usize, mlp: impl Fn(usize) -> Option<bool>) -> GpuLoras {
        let shapes = plan
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let a = &l.attn;
                let (q, kv, inter) =
                    (a.params.n_heads * a.params.head_dim, a.params.n_kv_heads * a.params.head_dim, l.ffn.intermediate);
                // A DeltaNet layer has no q, k, v or o to adapt; a gated output's q rows hold
                // its gates too, which the device's QKV rows keep apart (no adapter of q).
                let softmax = a.linear.is_none();
                let own = softmax && !a.shared;
                // Whether layer i has a dense MLP (experts in its place take no adapter) and
                // whether it is gated.
                let (dense, gated) = (mlp(i).is_some(), mlp(i) == Some(true));
                [
                    (softmax && !a.output_gate).then_some((hidden, q)),
                    own.then_some((hidden, kv)),
                    (own && !a.k_eq_v).then_some((hidden, kv)),
                    softmax.then_some((q, hidden)),
                    gated.then_some((hidden, inter)),
                    dense.then_some((hidden, inter)),
                    dense.then_some((inter, hidden)),
                ]
            })
            .collect();
        let k_eq_v = plan.layers.iter().map(|l| l.attn.k_eq_v && !l.attn.shared).collect();
        GpuLoras { shapes, k_eq_v, state: Mutex::default() }
    }

    /// (in, out) features of each projection an adapter may adapt.
    pub fn shapes(&self) -> &LoraShapes {
        &self.shapes
    }

    /// The table's shapes: where the keys are the values, the v slice of the QKV rows takes the
    /// k update, so it is as wide as k.
    fn table_shapes(&self) -> LoraShapes {
        let mut shapes = self.shapes.clone();
        for (s, &kv) in shapes.iter_mut().zip(&self.k_eq_v) {
            if kv {
                s[LoraTarget::V.index()] = s[LoraTarget::K.index()];
            }
        }
        shapes
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Attach `adapter` under `id`: checked against the shapes, uploaded into a free slot.
    pub fn attach(&self, gpu: &Gpu, id: u32, adapter: &LoraAdapter) -> Result<()> {
        adapter.check_fits(self.shapes.len(), |i, t| self.shapes[i][t.index()])?;
        let mut st = self.lock();
        if st.slots.contains_key(&id) {
            return Err(LoadError::format(&adapter.path, format!("an adapter is already attached under id {id}")));
        }
        if st.table.is_none() {
            st.table = Some(LoraTable::new(gpu, MAX_GPU_LORAS, self.table_shapes())?);
        }
        let table = st.table.as_mut().ok_or_else(|| LoadError::Other("no LoRA table".into()))?;
        let slot = table.free_slot().ok_or_else(|| {
            LoadError::format(
                &adapter.path,
                format!("{MAX_GPU_LORAS} adapters are resident on this GPU model, the most it holds"),
            )
        })?;
        let to_bf16 = |v: &[f32], scale: f32| -> Vec<bf16> { v.iter().map(|&x| bf16::from_f32(x * scale)).collect() };
        let values: Vec<(usize, LoraTarget, Vec<bf16>, Vec<bf16>)> = adapter
            .modules
            .iter()
            .map(|m| (m.layer, m.target, to_bf16(&m.a, 1.0), to_bf16(&m.b, adapter.scale)))
            .collect();
        let mut modules: Vec<LoraMatrices> = Vec::with_capacity(values.len() + 1);
        let mut groups = 0u8;
        for (layer, target, a, b) in &values {
            modules.push(LoraMatrices { layer: *layer, target: target.index(), a, b });
            if *target == LoraTarget::K && self.k_eq_v[*layer] {
                modules.push(LoraMatrices { layer: *layer, target: LoraTarget::V.index(), a, b });
            }
            groups |= LoraGroup::of(*target) as u8;
        }
        table.install(gpu, slot, adapter.rank, &modules)?;
        st.slots.insert(id, (slot, groups));
        Ok(())
    }

    /// Detach the adapter attached under `id` (steps queued before still read it).
    pub fn detach(&self, gpu: &Gpu, id: u32) {
        let mut st = self.lock();
        if let (Some((slot, _)), Some(table)) = (st.slots.remove(&id), st.table.as_mut()) {
            // Only fails on a broken device, which the next step reports.
            let _ = table.remove(gpu, slot);
        }
    }
}

/// The LoRA part of a step's buffers: the grouping of its tokens, and which projection
/// groups its launches cover (0: the step has no adapter rows and launches none).
#[derive(Default)]
pub struct LoraBuffers {
    step: Option<LoraStep>,
    /// Tokens the workspace holds.
    tokens: usize,
    mask: u8,
}

impl LoraBuffers {
    pub fn new(tokens: usize) -> LoraBuffers {
        LoraBuffers { step: None, tokens, mask: 0 }
    }

    /// Group `batch`'s adapted tokens for the step (before its launches, outside any graph)
    /// and return the step's graph variant: the projection groups its launches cover.
    pub fn upload(&mut self, gpu: &Gpu, loras: &GpuLoras, batch: &ForwardBatch) -> RtResult<u64> {
        self.mask = 0;
        if !batch.has_adapters() {
            return Ok(0);
        }
        let st = loras.lock();
        let mut spans = Vec::new();
        for row in batch.rows.iter() {
            let Some(id) = row.adapter else { continue };
            let &(slot, _) = st.slots.get(&id).ok_or_else(|| {
                RuntimeError::Shape(format!("a row runs through LoRA adapter {id}, which is not attached"))
            })?;
            spans.push((row.query_start, row.query_len, slot));
        }
        let table = st.table.as_ref().ok_or_else(|| RuntimeError::Shape("no LoRA adapter is attached".into()))?;
        let step = match &mut self.step {
            Some(s) => s,
            empty => empty.insert(LoraStep::new(gpu, self.tokens, table)?),
        };
        step.update(gpu, table, &spans)?;
        self.mask = st.mask();
        Ok(self.mask as u64)
    }

    /// The step's LoRA for the layers (None: no adapter rows), holding the adapters' lock.
    pub fn for_step<'a>(&'a mut self, loras: &'a GpuLoras, tokens: usize) -> Option<StepLora<'a>> {
        if self.mask == 0 {
            return None;
        }
        Some(StepLora { state: loras.lock(), step: self.step.as_mut()?, mask: self.mask, tokens })
    }
}

/// What the layers of one step apply.
pub struct StepLora<'a> {
    state: MutexGuard<'a, State>,
    step: &'a mut LoraStep,
    mask: u8,
    tokens: usize,
}

impl StepLora<'_> {
    /// Whether the step's launches cover `group`.
    pub fn covers(&self, group: LoraGroup) -> bool {
        self.mask & group as u8 != 0
    }

    /// `out` (rows `stride` apart) gains the update of the projections `targets` of `layer`
    /// (consecutive, fused side by side from column 0) for every adapted token, reading `x`.
    pub fn add(
        &mut self,
        gpu: &Gpu,
        layer: usize,
        targets: std::ops::RangeInclusive<LoraTarget>,
        x: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        stride: usize,
    ) -> RtResult<()> {
        if !self.covers(LoraGroup::of(*targets.start())) {
            return Ok(());
        }
        let table = self.state.table.as_ref().ok_or_else(|| RuntimeError::Shape("no LoRA table".into()))?;
        let range = targets.start().index()..targets.end().index() + 1;
        Ok(ops::lora_add(gpu, table, self.step, layer, range, x, out, stride, self.tokens)?)
    }
}
