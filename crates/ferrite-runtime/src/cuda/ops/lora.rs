//! Multi-LoRA on the device (kernels in `lora.cu`): the rows of one step may each run through a
//! different adapter or none, and at every adapted projection the base GEMM runs once over all
//! tokens, then `lora_add` adds `B · (A · x)` for each token through its own adapter — one
//! shrink launch and one expand launch, whatever the mix of adapters.
//!
//! - `LoraTable` holds the resident adapters: each slot's A and B matrices (bf16, the scale
//!   folded into B) in one device buffer, and a device table of their addresses per (slot,
//!   layer, projection) that the kernels read. Installing or removing an adapter rewrites its
//!   slot's entries in stream order; nothing else moves, so a CUDA graph captured before an
//!   install sees the new adapter. The table knows each projection's (in, out) features and
//!   refuses matrices of other shapes, so a kernel never reads past one.
//! - `LoraStep` is a step's grouping: its adapted tokens sorted by slot and cut into groups of
//!   at most 8 tokens (each group's adapter matrices are read once for all its tokens), the
//!   shrink's work items, and the rank-wide intermediate of every token (partial sums over
//!   chunks of 2,048 inputs, which the expand adds in order). `update` writes it
//!   before the step (outside any graph, like the step's other inputs); rows with no adapter
//!   are in no group and cost nothing.
//!
//! Projection indices are the CPU's `LoraTarget` order: q, k, v, o, gate, up, down. A fused
//! projection is a range of consecutive targets whose outputs sit side by side in each output
//! row (q, k, v of a fused QKV matrix; gate, up of a fused gate-up one).

use std::ops::Range;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::cuda::context::{cfg, Gpu};
use crate::cuda::error::{CudaError, CudaResult};

/// Projections a layer may have adapted (q, k, v, o, gate, up, down).
pub const LORA_TARGETS: usize = 7;
/// The largest rank the kernels take.
pub const LORA_MAX_RANK: usize = 64;
/// Tokens of one adapter a group holds (`LORA_TG`).
const GROUP_TOKENS: usize = 8;
/// Rank rows a shrink work item computes (`LORA_RB`).
const RANK_ROWS: usize = 8;
/// Slices of a fused projection at most (`LORA_SLICES`).
const SLICES: usize = 3;
const THREADS: u32 = 256;
/// Input values a shrink work item covers (`LORA_KC`): a projection of `in` inputs is
/// `in.div_ceil(CHUNK)` items of partial sums a rank block.
const CHUNK: usize = THREADS as usize * 8;

fn check(ok: bool, what: impl FnOnce() -> String) -> CudaResult<()> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape(what()))
    }
}

/// One adapted projection of an adapter, row-major bf16.
#[derive(Debug, Clone, Copy)]
pub struct LoraMatrices<'a> {
    pub layer: usize,
    /// The projection (`LoraTarget` order).
    pub target: usize,
    /// `[rank, in]`.
    pub a: &'a [bf16],
    /// `[out, rank]`, times the adapter's scale.
    pub b: &'a [bf16],
}

/// An installed adapter: its rank and the buffer holding all its matrices.
struct Slot {
    rank: usize,
    _weights: CudaSlice<bf16>,
}

/// The resident adapters and the device table of their matrices' addresses.
pub struct LoraTable {
    /// `[slots][layers][LORA_TARGETS][A, B]` device addresses (0: not adapted).
    table: CudaSlice<u64>,
    /// Per layer and projection: (in, out) features, None where the layer has no such one.
    shapes: Vec<[Option<(usize, usize)>; LORA_TARGETS]>,
    slots: Vec<Option<Slot>>,
}

impl LoraTable {
    /// Room for `slots` adapters over layers whose projections have the (in, out) `shapes`.
    pub fn new(gpu: &Gpu, slots: usize, shapes: Vec<[Option<(usize, usize)>; LORA_TARGETS]>) -> CudaResult<LoraTable> {
        let table = gpu.alloc(slots.max(1) * shapes.len().max(1) * LORA_TARGETS * 2)?;
        Ok(LoraTable { table, shapes, slots: (0..slots).map(|_| None).collect() })
    }

    /// How many adapters it holds at most.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The rank of the adapter in `slot`, if one is installed.
    pub fn rank(&self, slot: usize) -> Option<usize> {
        self.slots.get(slot)?.as_ref().map(|s| s.rank)
    }

    /// A slot with no adapter.
    pub fn free_slot(&self) -> Option<usize> {
        self.slots.iter().position(Option::is_none)
    }

    /// The (in, out) features of projection `target` of `layer`.
    pub fn shape(&self, layer: usize, target: usize) -> Option<(usize, usize)> {
        *self.shapes.get(layer)?.get(target)?
    }

    /// Table entries of one slot.
    fn slot_stride(&self) -> usize {
        self.shapes.len() * LORA_TARGETS * 2
    }

    /// Install an adapter of `rank` into the free `slot`: each module's matrices must have its
    /// projection's shape.
    pub fn install(&mut self, gpu: &Gpu, slot: usize, rank: usize, modules: &[LoraMatrices]) -> CudaResult<()> {
        check(self.slots.get(slot).is_some_and(Option::is_none), || format!("LoRA slot {slot} is taken or missing"))?;
        check((1..=LORA_MAX_RANK).contains(&rank), || format!("LoRA rank {rank} outside 1..={LORA_MAX_RANK}"))?;
        // Every matrix 16-byte aligned in one buffer.
        let mut values: Vec<bf16> = Vec::new();
        let mut placed = Vec::with_capacity(modules.len());
        for m in modules {
            let (inp, out) = self.shape(m.layer, m.target).ok_or_else(|| {
                CudaError::Shape(format!(
                    "LoRA module for layer {} projection {}: no such projection",
                    m.layer, m.target
                ))
            })?;
            check(m.a.len() == rank * inp && m.b.len() == out * rank, || {
                format!(
                    "LoRA module for layer {} projection {}: A of {} and B of {} values for rank {rank}, {inp} → {out}",
                    m.layer,
                    m.target,
                    m.a.len(),
                    m.b.len()
                )
            })?;
            let mut at = [0usize; 2];
            for (i, part) in [m.a, m.b].into_iter().enumerate() {
                at[i] = values.len();
                values.extend_from_slice(part);
                values.resize(values.len().next_multiple_of(8), bf16::ZERO);
            }
            placed.push((m.layer, m.target, at));
        }
        let weights = gpu.upload(&values)?;
        let base = gpu.ptr(&weights);
        let mut entries = vec![0u64; self.slot_stride()];
        for (layer, target, at) in placed {
            let e = (layer * LORA_TARGETS + target) * 2;
            entries[e] = base + 2 * at[0] as u64;
            entries[e + 1] = base + 2 * at[1] as u64;
        }
        let start = slot * self.slot_stride();
        gpu.upload_into(&entries, &mut self.table.slice_mut(start..start + entries.len()))?;
        self.slots[slot] = Some(Slot { rank, _weights: weights });
        Ok(())
    }

    /// Remove the adapter in `slot`. Its entries are cleared and its matrices freed in stream
    /// order, after every step queued so far; a later step must not name the slot.
    pub fn remove(&mut self, gpu: &Gpu, slot: usize) -> CudaResult<()> {
        if self.slots.get(slot).is_none_or(Option::is_none) {
            return Ok(());
        }
        let (stride, start) = (self.slot_stride(), slot * self.slot_stride());
        gpu.upload_into(&vec![0u64; stride], &mut self.table.slice_mut(start..start + stride))?;
        self.slots[slot] = None;
        Ok(())
    }
}

/// Groups a step of `tokens` tokens may have over `slots` adapters: each has 1 to 8 tokens,
/// and only an adapter's last group can be short.
fn groups_cap(tokens: usize, slots: usize) -> usize {
    tokens.min(tokens.div_ceil(GROUP_TOKENS) + slots).max(1)
}

/// A step's tokens grouped by adapter, on the device, and the shrink's intermediate values.
pub struct LoraStep {
    /// `{n_groups, n_items, items at, order at} | groups[n][4] | items[m][2] | order`, one
    /// upload a step (the kernels find the parts from the head).
    meta: CudaSlice<u32>,
    /// `[tokens][kcap][SLICES][LORA_MAX_RANK]`, by position in the order: the shrink's partial
    /// sums, one per chunk of `CHUNK` inputs.
    s: CudaSlice<f32>,
    /// Chunks of the widest adapted input.
    kcap: usize,
    tokens: usize,
    slots: usize,
    /// One past the last adapted token of the last `update`.
    extent: usize,
}

impl LoraStep {
    /// Room for steps of up to `tokens` tokens over `table`'s slots and projections.
    pub fn new(gpu: &Gpu, tokens: usize, table: &LoraTable) -> CudaResult<LoraStep> {
        let (tokens, slots) = (tokens.max(1), table.capacity());
        let groups = groups_cap(tokens, slots);
        let widest = table.shapes.iter().flatten().flatten().map(|s| s.0).max().unwrap_or(0);
        let kcap = widest.div_ceil(CHUNK).max(1);
        let meta = gpu.alloc(4 + 4 * groups + 2 * groups * LORA_MAX_RANK / RANK_ROWS + tokens)?;
        let s = gpu.alloc(tokens * kcap * SLICES * LORA_MAX_RANK)?;
        Ok(LoraStep { meta, s, kcap, tokens, slots, extent: 0 })
    }

    /// Group the step's adapted tokens: `spans` holds (first token, tokens, slot) of every row
    /// that runs through an adapter of `table` (rows of the base model are left out). Queued
    /// before the step's kernels, like the step's other inputs.
    pub fn update(&mut self, gpu: &Gpu, table: &LoraTable, spans: &[(usize, usize, usize)]) -> CudaResult<()> {
        check(table.capacity() <= self.slots, || {
            format!("a LoRA table of {} slots for {}", table.capacity(), self.slots)
        })?;
        let mut tokens: Vec<(usize, usize)> = Vec::new();
        for &(first, n, slot) in spans {
            check(first + n <= self.tokens && table.rank(slot).is_some(), || {
                format!("LoRA tokens {first}..{} of slot {slot} in a step of at most {}", first + n, self.tokens)
            })?;
            tokens.extend((first..first + n).map(|t| (slot, t)));
        }
        tokens.sort_unstable();
        let mut seen = vec![false; self.tokens];
        for &(_, t) in &tokens {
            check(!std::mem::replace(&mut seen[t], true), || format!("LoRA token {t} in two rows"))?;
        }
        let (mut groups, mut items) = (Vec::new(), Vec::new());
        let mut at = 0;
        for run in tokens.chunk_by(|a, b| a.0 == b.0) {
            let slot = run[0].0;
            let rank = table.rank(slot).unwrap_or(0);
            for chunk in run.chunks(GROUP_TOKENS) {
                let g = (groups.len() / 4) as u32;
                groups.extend([slot as u32, at as u32, chunk.len() as u32, rank as u32]);
                items.extend((0..rank).step_by(RANK_ROWS).flat_map(|r| [g, r as u32]));
                at += chunk.len();
            }
        }
        let (items_at, order_at) = (4 + groups.len(), 4 + groups.len() + items.len());
        let mut meta = Vec::with_capacity(order_at + tokens.len());
        meta.extend([(groups.len() / 4) as u32, (items.len() / 2) as u32, items_at as u32, order_at as u32]);
        meta.extend_from_slice(&groups);
        meta.extend_from_slice(&items);
        meta.extend(tokens.iter().map(|&(_, t)| t as u32));
        check(meta.len() <= self.meta.len(), || {
            format!("LoRA step of {} words, room for {}", meta.len(), self.meta.len())
        })?;
        gpu.upload_into(&meta, &mut self.meta)?;
        self.extent = tokens.iter().map(|&(_, t)| t + 1).max().unwrap_or(0);
        Ok(())
    }
}

/// `out` (rows `stride` apart; the slices of `targets` side by side from column 0) gains, for
/// every token of `step` that runs through an adapter adapting them, `B · (A · x[t])` for
/// each projection in `targets` of `layer` (consecutive, at most 3, all reading `x`'s rows).
/// `tokens` is the step's token count (a graph's padded one): the launch shapes depend on it
/// alone, never on which adapters the step has, so a captured graph serves every step.
#[allow(clippy::too_many_arguments)]
pub fn lora_add(
    gpu: &Gpu,
    table: &LoraTable,
    step: &mut LoraStep,
    layer: usize,
    targets: Range<usize>,
    x: &impl DevicePtr<bf16>,
    out: &mut impl DevicePtrMut<bf16>,
    stride: usize,
    tokens: usize,
) -> CudaResult<()> {
    let n_slices = targets.len();
    check((1..=SLICES).contains(&n_slices) && targets.end <= LORA_TARGETS && layer < table.shapes.len(), || {
        format!("LoRA projections {targets:?} of layer {layer}")
    })?;
    let shapes: Vec<Option<(usize, usize)>> = targets.clone().map(|t| table.shape(layer, t)).collect();
    let inp = shapes.iter().flatten().map(|s| s.0).next().unwrap_or(0);
    let mut widths = [0usize; SLICES];
    for (w, s) in widths.iter_mut().zip(&shapes) {
        *w = s.map_or(0, |s| s.1);
    }
    let width: usize = widths.iter().sum();
    check(shapes.iter().flatten().all(|s| s.0 == inp), || {
        format!("LoRA projections {targets:?} read different widths")
    })?;
    check(tokens <= step.tokens && step.extent <= tokens && x.len() >= tokens * inp && stride >= width, || {
        format!(
            "LoRA over {tokens} tokens (grouped: {}) of {inp} → {width} (stride {stride}): x {}",
            step.extent,
            x.len()
        )
    })?;
    check(tokens == 0 || out.len() >= (tokens - 1) * stride + width, || format!("LoRA output {}", out.len()))?;
    let chunks = inp.div_ceil(CHUNK).max(1);
    check(chunks <= step.kcap, || format!("LoRA input of {inp} in a step sized for {}", step.kcap * CHUNK))?;
    if tokens == 0 || width == 0 {
        return Ok(());
    }
    let sms = gpu.info().multiprocessors.max(1);
    let groups = groups_cap(tokens, step.slots);
    let meta = gpu.ptr(&step.meta);
    let (tp, sp) = (gpu.ptr(&table.table), gpu.ptr_mut(&mut step.s));
    let (xp, op) = (gpu.ptr(x), gpu.ptr_mut(out));
    let slot_stride = table.slot_stride() as i32;
    let entry = ((layer * LORA_TARGETS + targets.start) * 2) as i32;
    // Two waves of one block a multiprocessor (the shrink's register budget) over the items.
    let items = groups * LORA_MAX_RANK / RANK_ROWS * chunks;
    let gx = items.min((2 * sms).div_ceil(n_slices)).max(1) as u32;
    let wide = i32::from(inp.is_multiple_of(8) && xp.is_multiple_of(16));
    let [in_i, chunks_i, kcap_i] = [inp, chunks, step.kcap].map(|v| v as i32);
    gpu.launch(
        &gpu.fns.lora_shrink,
        cfg((gx, n_slices as u32, 1), THREADS, 0),
        &[&xp, &in_i, &wide, &meta, &tp, &slot_stride, &entry, &sp, &chunks_i, &kcap_i],
    )?;
    // Eight expand blocks a multiprocessor: one wave at 48 registers a thread (its loads of B
    // and the outputs ahead of the gather take it to 110: about four waves).
    let col_blocks = width.div_ceil(THREADS as usize);
    let gx = groups.min((8 * sms).div_ceil(col_blocks)).max(1) as u32;
    let [n0, n1, n2] = widths.map(|w| w as i32);
    let stride_i = stride as i32;
    gpu.launch(
        &gpu.fns.lora_expand,
        cfg((gx, col_blocks as u32, 1), THREADS, 0),
        &[&op, &stride_i, &n0, &n1, &n2, &meta, &tp, &slot_stride, &entry, &sp, &chunks_i, &kcap_i],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_bounds_cover_every_grouping() {
        // 64 tokens over 3 adapters: 8 + 3 groups at most, fewer than the tokens.
        assert_eq!(groups_cap(64, 3), 11);
        // Every token its own adapter.
        assert_eq!(groups_cap(5, 64), 5);
        assert_eq!(groups_cap(0, 4), 1);
    }
}
