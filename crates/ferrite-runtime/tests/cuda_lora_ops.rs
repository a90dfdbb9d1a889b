//! Multi-LoRA's shrink and expand kernels (`ops::lora_add`) against a plain f64 reference on
//! random bf16 inputs: ranks 1, 8, 16 and 64; odd token counts; rows with no adapter, every
//! row through one adapter, three adapters mixed with base rows; fused projections of one,
//! two and three slices, with an adapter that leaves a slice alone; an input width the
//! 16-byte path reads and one it cannot; inputs of one shrink chunk and of several. A token's
//! result must not depend on its batch (the same bits alone as co-batched), and a CUDA graph
//! captured before an adapter was installed must run it afterwards. Gated on
//! `FERRITE_TEST_CUDA=1`.
//!
//! Tolerance: the kernels add the f32 update to the bf16 base output and round once, so the
//! result is within half a bf16 ulp of the exact sum plus f32 summation noise: rtol 2^-8 and
//! an absolute part of 1e-4 of the largest value (where the sum cancels).

mod cuda_common;

use cuda_common::{compare, fail, gpu, rand_bf16, rng, to_f32};
use ferrite_runtime::cuda::ops::{self, LoraMatrices, LoraStep, LoraTable, LORA_TARGETS};
use ferrite_runtime::cuda::Gpu;
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

const RTOL: f32 = 1.0 / 256.0;
const SLOTS: usize = 8;

/// Per layer, per projection (q, k, v, o, gate, up, down): (in, out). Layer 0 is
/// SmolLM2-like (widths the 16-byte path reads), layer 1 has odd widths (the scalar path);
/// both down projections read more than one shrink chunk of 2,048 inputs, the last ragged.
fn shapes() -> Vec<[Option<(usize, usize)>; LORA_TARGETS]> {
    let layer = |d: usize, q: usize, kv: usize, inter: usize| {
        [(d, q), (d, kv), (d, kv), (q, d), (d, inter), (d, inter), (inter, d)].map(Some)
    };
    vec![layer(576, 576, 192, 4160), layer(203, 136, 40, 2077)]
}

/// A fused projection: its layer and targets.
#[derive(Clone)]
struct Proj {
    layer: usize,
    targets: std::ops::Range<usize>,
}

impl Proj {
    fn input(&self) -> usize {
        shapes()[self.layer][self.targets.start..self.targets.end].iter().flatten().next().expect("shape").0
    }
    fn width(&self) -> usize {
        shapes()[self.layer][self.targets.clone()].iter().flatten().map(|s| s.1).sum()
    }
}

fn projections() -> Vec<Proj> {
    let mut out = Vec::new();
    for layer in 0..2 {
        for targets in [0..3, 3..4, 4..6, 6..7] {
            out.push(Proj { layer, targets });
        }
    }
    out
}

/// An adapter's matrices (f32 copies of bf16 values) per (layer, target).
struct Adapter {
    rank: usize,
    modules: Vec<(usize, usize, Vec<bf16>, Vec<bf16>)>,
}

impl Adapter {
    /// Random matrices of `rank` for every projection of both layers except those `skip` names.
    fn random(rng: &mut StdRng, rank: usize, skip: &[usize]) -> Adapter {
        let mut modules = Vec::new();
        for (layer, shapes) in shapes().iter().enumerate() {
            for (target, shape) in shapes.iter().enumerate() {
                let Some((inp, out)) = *shape else { continue };
                if skip.contains(&target) {
                    continue;
                }
                let (a, _) = rand_bf16(rng, rank * inp, 1.0 / (inp as f32).sqrt());
                let (b, _) = rand_bf16(rng, out * rank, 1.0 / (rank as f32).sqrt());
                modules.push((layer, target, a, b));
            }
        }
        Adapter { rank, modules }
    }

    fn module(&self, layer: usize, target: usize) -> Option<(&[bf16], &[bf16])> {
        self.modules.iter().find(|m| m.0 == layer && m.1 == target).map(|m| (m.2.as_slice(), m.3.as_slice()))
    }

    fn install(&self, gpu: &Gpu, table: &mut LoraTable, slot: usize) {
        let mods: Vec<LoraMatrices> = self
            .modules
            .iter()
            .map(|(layer, target, a, b)| LoraMatrices { layer: *layer, target: *target, a, b })
            .collect();
        table.install(gpu, slot, self.rank, &mods).expect("install");
    }
}

/// `base` plus each adapted token's update, in f64, for `proj` (`x` is `[tokens, in]`).
fn reference(proj: &Proj, adapters: &[Adapter], x: &[f32], base: &[f32], slot_of: &[Option<usize>]) -> Vec<f32> {
    let (inp, width) = (proj.input(), proj.width());
    let mut out: Vec<f64> = base.iter().map(|&v| v as f64).collect();
    for (t, slot) in slot_of.iter().enumerate() {
        let Some(slot) = *slot else { continue };
        let ad = &adapters[slot];
        let xt = &x[t * inp..(t + 1) * inp];
        let mut col = 0;
        for target in proj.targets.clone() {
            let Some((_, n)) = shapes()[proj.layer][target] else { continue };
            if let Some((a, b)) = ad.module(proj.layer, target) {
                let s: Vec<f64> = (0..ad.rank)
                    .map(|r| (0..inp).map(|k| xt[k] as f64 * a[r * inp + k].to_f64()).sum::<f64>())
                    .collect();
                for j in 0..n {
                    let d: f64 = (0..ad.rank).map(|r| b[j * ad.rank + r].to_f64() * s[r]).sum();
                    out[t * width + col + j] += d;
                }
            }
            col += n;
        }
    }
    out.into_iter().map(|v| v as f32).collect()
}

/// Rows of random lengths over `slot_of` (a row's tokens share its adapter): (first, len, slot).
fn spans(slot_of: &[Option<usize>]) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let mut t = 0;
    while t < slot_of.len() {
        let mut end = t + 1;
        while end < slot_of.len() && slot_of[end] == slot_of[t] && end - t < 5 {
            end += 1;
        }
        if let Some(slot) = slot_of[t] {
            out.push((t, end - t, slot));
        }
        t = end;
    }
    out
}

/// Run `lora_add` for `proj` over `tokens` tokens: the output.
#[allow(clippy::too_many_arguments)]
fn run(
    gpu: &Gpu,
    table: &LoraTable,
    step: &mut LoraStep,
    proj: &Proj,
    x: &[bf16],
    base: &[bf16],
    slot_of: &[Option<usize>],
) -> Vec<f32> {
    let tokens = slot_of.len();
    step.update(gpu, table, &spans(slot_of)).expect("update");
    let x_d = gpu.upload(x).expect("upload");
    let mut out = gpu.upload(base).expect("upload");
    let width = proj.width();
    ops::lora_add(gpu, table, step, proj.layer, proj.targets.clone(), &x_d, &mut out, width, tokens).expect("lora_add");
    to_f32(&gpu.download(&out).expect("download"))
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// Every mix of adapters against the reference, and each adapted token alone bit for bit.
#[test]
fn cuda_lora_add_matches_reference_and_is_batch_invariant() {
    let Some((gpu, _checks)) = gpu("cuda_lora_add_matches_reference_and_is_batch_invariant") else { return };
    let mut rng = rng("lora");
    // Slots 0..4: ranks 1, 8 (leaves k and gate alone), 16, 64.
    let adapters = [
        Adapter::random(&mut rng, 1, &[]),
        Adapter::random(&mut rng, 8, &[1, 4]),
        Adapter::random(&mut rng, 16, &[]),
        Adapter::random(&mut rng, 64, &[]),
    ];
    let mut table = LoraTable::new(gpu, SLOTS, shapes()).expect("table");
    for (slot, a) in adapters.iter().enumerate() {
        a.install(gpu, &mut table, slot);
    }
    let mut step = LoraStep::new(gpu, 160, &table).expect("step");
    for tokens in [1usize, 7, 37, 131] {
        let mixes: Vec<(&str, Vec<Option<usize>>)> = vec![
            ("no adapter", vec![None; tokens]),
            ("all rank 16", vec![Some(2); tokens]),
            (
                "ranks 1, 8, 64 and base",
                (0..tokens).map(|t| [Some(0), None, Some(1), Some(3)][(t * 7 / 3) % 4]).collect(),
            ),
            ("every adapter", (0..tokens).map(|_| Some(rng.random_range(0..4))).collect()),
        ];
        for proj in projections() {
            let (inp, width) = (proj.input(), proj.width());
            let (xh, xf) = rand_bf16(&mut rng, tokens * inp, 1.0);
            let (bh, bf) = rand_bf16(&mut rng, tokens * width, 1.0);
            for (name, slot_of) in &mixes {
                let case = format!("{tokens} tokens, layer {} targets {:?}, {name}", proj.layer, proj.targets);
                let got = run(gpu, &table, &mut step, &proj, &xh, &bh, slot_of);
                let want = reference(&proj, &adapters, &xf, &bf, slot_of);
                if slot_of.iter().all(Option::is_none) && got != bf {
                    fail(format!("{case}: a step with no adapter changed the output"));
                }
                compare("lora_add", &case, &got, &want, 1e-4 * max_abs(&want), RTOL);
                // Each adapted token alone (the others through the base): the same bits.
                for t in (0..tokens).filter(|&t| slot_of[t].is_some()).step_by(5) {
                    let alone: Vec<Option<usize>> =
                        (0..tokens).map(|u| (u == t).then_some(slot_of[t]).flatten()).collect();
                    let solo = run(gpu, &table, &mut step, &proj, &xh, &bh, &alone);
                    if solo[t * width..(t + 1) * width] != got[t * width..(t + 1) * width] {
                        fail(format!("{case}: token {t} alone differs from co-batched"));
                    }
                }
            }
        }
    }
}

/// A graph captured over a step of one adapter runs an adapter installed after the capture
/// (its addresses come from the table), and a removed adapter's slot can be refilled.
#[test]
fn cuda_lora_graph_reads_adapters_installed_after_capture() {
    let Some((gpu, _checks)) = gpu("cuda_lora_graph_reads_adapters_installed_after_capture") else { return };
    let mut rng = rng("lora graph");
    let first = Adapter::random(&mut rng, 16, &[]);
    let later = [Adapter::random(&mut rng, 8, &[]), first, Adapter::random(&mut rng, 64, &[2])];
    let mut table = LoraTable::new(gpu, SLOTS, shapes()).expect("table");
    later[1].install(gpu, &mut table, 1);
    let proj = Proj { layer: 0, targets: 0..3 };
    let (tokens, inp, width) = (12, proj.input(), proj.width());
    let mut step = LoraStep::new(gpu, tokens, &table).expect("step");
    let (xh, xf) = rand_bf16(&mut rng, tokens * inp, 1.0);
    let (bh, bf) = rand_bf16(&mut rng, tokens * width, 1.0);
    let x_d = gpu.upload(&xh).expect("upload");
    let mut out = gpu.upload(&bh).expect("upload");
    step.update(gpu, &table, &spans(&[Some(1); 12])).expect("update");
    let graph =
        gpu.capture(|| ops::lora_add(gpu, &table, &mut step, 0, 0..3, &x_d, &mut out, width, tokens)).expect("capture");
    // Slot 0 and 2 filled after the capture; slot 1's adapter removed and put back.
    later[0].install(gpu, &mut table, 0);
    later[2].install(gpu, &mut table, 2);
    table.remove(gpu, 1).expect("remove");
    later[1].install(gpu, &mut table, 1);
    let slot_of: Vec<Option<usize>> = (0..tokens).map(|t| [Some(0), Some(2), None, Some(1)][t % 4]).collect();
    step.update(gpu, &table, &spans(&slot_of)).expect("update");
    gpu.upload_into(&bh, &mut out).expect("reset");
    graph.replay().expect("replay");
    let replayed = to_f32(&gpu.download(&out).expect("download"));
    let want = reference(&proj, &later, &xf, &bf, &slot_of);
    compare("lora_graph", "adapters installed after the capture", &replayed, &want, 1e-4 * max_abs(&want), RTOL);
    let eager = run(gpu, &table, &mut step, &proj, &xh, &bh, &slot_of);
    if eager != replayed {
        fail("the replayed graph and an eager launch differ".into());
    }
}

/// Bad shapes and slots are errors, not out-of-bounds reads.
#[test]
fn cuda_lora_table_refuses_bad_shapes() {
    let Some((gpu, _checks)) = gpu("cuda_lora_table_refuses_bad_shapes") else { return };
    let mut table = LoraTable::new(gpu, 2, shapes()).expect("table");
    let a = vec![bf16::ONE; 4 * 576];
    let b = vec![bf16::ONE; 576 * 4];
    let wrong_in = vec![bf16::ONE; 4 * 575];
    assert!(
        table.install(gpu, 0, 4, &[LoraMatrices { layer: 0, target: 0, a: &wrong_in, b: &b }]).is_err(),
        "A of the wrong width"
    );
    assert!(table.install(gpu, 0, 4, &[LoraMatrices { layer: 2, target: 0, a: &a, b: &b }]).is_err(), "no layer 2");
    assert!(table.install(gpu, 0, 65, &[]).is_err(), "rank 65");
    assert!(table.install(gpu, 5, 4, &[LoraMatrices { layer: 0, target: 0, a: &a, b: &b }]).is_err(), "no slot 5");
    table.install(gpu, 0, 4, &[LoraMatrices { layer: 0, target: 0, a: &a, b: &b }]).expect("fits");
    assert!(
        table.install(gpu, 0, 4, &[LoraMatrices { layer: 0, target: 0, a: &a, b: &b }]).is_err(),
        "slot 0 is taken"
    );
    let mut step = LoraStep::new(gpu, 4, &table).expect("step");
    assert!(step.update(gpu, &table, &[(0, 5, 0)]).is_err(), "past the step's tokens");
    assert!(step.update(gpu, &table, &[(0, 2, 1)]).is_err(), "an empty slot");
    assert!(step.update(gpu, &table, &[(0, 2, 0), (1, 2, 0)]).is_err(), "a token in two rows");
    step.update(gpu, &table, &[(2, 2, 0)]).expect("fits");
    let (x, mut out) = (gpu.alloc::<bf16>(4 * 576).expect("x"), gpu.alloc::<bf16>(4 * 576).expect("out"));
    assert!(ops::lora_add(gpu, &table, &mut step, 0, 0..1, &x, &mut out, 576, 3).is_err(), "token 3 of a 3-token step");
    ops::lora_add(gpu, &table, &mut step, 0, 0..1, &x, &mut out, 576, 4).expect("fits");
}
