//! The gated DeltaNet kernels against the CPU ops they mirror (`cpu::gated_delta`, the CPU
//! norms and activations) on fresh random inputs, gated on `FERRITE_TEST_CUDA=1`:
//! - the causal conv + SiLU and the delta rule over steps of several rows of different
//!   lengths (one token, odd counts), rows starting from the zero state and from random
//!   states in slots, writing block-end snapshots, their end (a decode-like row its own read
//!   slot) and a verify row's per-token states; then a second step of decode rows continuing
//!   the slots the first wrote. Outputs and every slot's state are compared;
//! - the delta rule at each register width (key heads of 16, 48 and 128; value heads of 8,
//!   40 and 128; grouped and tiled value heads); the 17-token row of these cases takes the
//!   chunked scan (`DELTA_CHUNK_MIN_TOKENS`), the others the sequential kernel;
//! - the chunked scan against the sequential kernel and the CPU on long rows (1 to 1,000
//!   tokens: around the 32-token chunks and far past them), each routed to one kernel, the
//!   other, or by length; writes at chunk boundaries and mid-chunk, per-token writes, rows
//!   reading slots and the zero state, then rows continuing the first step's ends (a row
//!   writing the slot it reads), at every key width;
//! - a step of rows of one length padded to a graph's row bucket with rows that touch no slot
//!   (`Padding`) equals the step unpadded, bit for bit (outputs and every slot);
//! - the q/k L2 norm, the gates, the output norm times silu(z), and the sigmoid gates of a
//!   gated attention output and of a shared expert.
//!
//! Everything but the last is f32 on both sides: what differs is fused multiply-adds and
//! `expf`, so tolerances are 1e-5 absolute plus 1e-4 relative (the delta rule, a recurrence
//! over up to 40 tokens, 1e-4 plus 1e-3). The chunked scan regroups the recurrence's sums
//! (`deltanet.cu`'s header); an f32 emulation of it over up to 2,048 tokens stayed within
//! 2.4e-6 of the sequential scan on states of magnitude up to 1.8 and 5e-7 on outputs, so its
//! comparisons take 5e-5 absolute plus 5e-4 relative. Outputs are NaN-poisoned first.

mod cuda_common;

use cuda_common::{compare, gpu, poisoned_bf16, poisoned_f32, rand_bf16, rng, to_f32};
use ferrite_runtime::cpu::gated_delta::{self, DeltaShape};
use ferrite_runtime::cpu::{rms_norm_in_place, silu_mul};
use ferrite_runtime::cuda::ops::{self, DeviceStatePool, StateTable, DELTA_CHUNK_MIN_TOKENS};
use ferrite_runtime::cuda::Gpu;
use ferrite_runtime::kv_state::{StatePool, StateRow, StateSpec};
use ferrite_runtime::Padding;
use rand::rngs::StdRng;
use rand::Rng;

const KERNEL: usize = 4;
/// Slots of the pools: 0..8 hold random states the rows may read; writes go to 8 and up.
const SLOTS: usize = 80;

fn uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// A host pool of `SLOTS` random states, and its copy on the device.
fn pools(gpu: &Gpu, rng: &mut StdRng, spec: StateSpec) -> (StatePool, DeviceStatePool) {
    let mut host = StatePool::zeroed(spec, SLOTS);
    for slot in 0..SLOTS as u32 {
        let conv = uniform(rng, spec.conv_values(), -1.0, 1.0);
        host.conv_mut(slot).expect("slot").copy_from_slice(&conv);
        let ssm = uniform(rng, spec.ssm_values(), -0.5, 0.5);
        host.ssm_mut(slot).expect("slot").copy_from_slice(&ssm);
    }
    let dev = device_pool(gpu, &host);
    (host, dev)
}

/// A device copy of `host`'s states.
fn device_pool(gpu: &Gpu, host: &StatePool) -> DeviceStatePool {
    let mut dev = DeviceStatePool::zeroed(gpu, host.spec, SLOTS).expect("device pool");
    let (conv, ssm) = host_states(host);
    gpu.upload_into(&conv, &mut dev.conv).expect("upload");
    gpu.upload_into(&ssm, &mut dev.ssm).expect("upload");
    dev
}

/// Every slot's (conv windows, matrices), concatenated.
fn host_states(pool: &StatePool) -> (Vec<f32>, Vec<f32>) {
    let slots = 0..pool.slots() as u32;
    let conv = slots.clone().flat_map(|s| pool.conv(s).expect("slot").to_vec()).collect();
    let ssm = slots.flat_map(|s| pool.ssm(s).expect("slot").to_vec()).collect();
    (conv, ssm)
}

fn device_states(gpu: &Gpu, pool: &DeviceStatePool) -> (Vec<f32>, Vec<f32>) {
    let spec = pool.spec;
    let mut conv = gpu.download(&pool.conv).expect("download");
    let mut ssm = gpu.download(&pool.ssm).expect("download");
    conv.truncate(SLOTS * spec.conv_values());
    ssm.truncate(SLOTS * spec.ssm_values());
    (conv, ssm)
}

/// A prefill-like step: rows of `lens` tokens; odd rows read a random slot (even ones start a
/// sequence), each writes a snapshot every 4 tokens and its end to fresh slots, and the last
/// row (a verify row) also the state after each of its tokens.
fn prefill_rows(lens: &[usize]) -> Vec<StateRow> {
    let (mut start, mut fresh) = (0, 8u32);
    let mut next = || {
        fresh += 1;
        fresh - 1
    };
    let mut rows = Vec::new();
    for (r, &len) in lens.iter().enumerate() {
        let mut writes = Vec::new();
        for n in 1..=len {
            if r + 1 == lens.len() {
                writes.push((n, next()));
            }
            if n % 4 == 0 || n == len {
                writes.push((n, next()));
            }
        }
        rows.push(StateRow { tokens: start..start + len, read: (r % 2 == 1).then_some(r as u32), writes });
        start += len;
    }
    rows
}

/// A decode step continuing `before`: one token a row, reading each row's end slot and writing
/// it again (a sequence within its block).
fn decode_rows(before: &[StateRow]) -> Vec<StateRow> {
    (before.iter().enumerate())
        .map(|(r, row)| {
            let end = row.writes.last().expect("an end write").1;
            StateRow { tokens: r..r + 1, read: Some(end), writes: vec![(1, end)] }
        })
        .collect()
}

/// The steps each case runs: a prefill of rows of these lengths, then a decode step.
const CASES: [&[usize]; 4] = [&[1], &[7], &[5, 1, 13, 2], &[3, 17, 9]];

fn spec_of(shape: &DeltaShape) -> StateSpec {
    let channels = 2 * shape.k_heads * shape.k_dim + shape.v_heads * shape.v_dim;
    StateSpec {
        conv_channels: channels,
        conv_kernel: KERNEL,
        heads: shape.v_heads,
        k_dim: shape.k_dim,
        v_dim: shape.v_dim,
        group: 0,
    }
}

#[test]
fn cuda_deltanet_conv_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_deltanet_conv_matches_cpu") else { return };
    let mut rng = rng("cuda_deltanet_conv_matches_cpu");
    let shape = DeltaShape { k_heads: 2, v_heads: 3, k_dim: 5, v_dim: 7, tiled: false };
    let spec = spec_of(&shape);
    let c = spec.conv_channels;
    let weight = uniform(&mut rng, KERNEL * c, -0.6, 0.6);
    let w_dev = gpu.upload(&weight).expect("upload");
    for lens in CASES {
        let (mut host, mut dev) = pools(gpu, &mut rng, spec);
        let first = prefill_rows(lens);
        let steps = [first.clone(), decode_rows(&first)];
        for (step, rows) in steps.iter().enumerate() {
            let t = rows.last().expect("rows").tokens.end;
            // Device rows wider than the channels (the fused projection's stride).
            let stride = c + 3;
            let x = uniform(&mut rng, t * stride, -2.0, 2.0);
            let mut want: Vec<f32> = x.chunks_exact(stride).flat_map(|r| r[..c].to_vec()).collect();
            gated_delta::causal_conv_silu(&mut want, &weight, KERNEL, &mut host, rows).expect("cpu conv");
            let mut table = StateTable::new(gpu, t).expect("table");
            table.upload(gpu, rows, Padding { rows: rows.len(), query: 1 }, SLOTS).expect("table upload");
            let x_dev = gpu.upload(&x).expect("upload");
            let mut out = poisoned_f32(gpu, t * c);
            ops::delta_conv(gpu, &x_dev, stride, &w_dev, &table, &mut dev, &mut out).expect("conv");
            let case = format!("rows {lens:?} step {step}");
            compare("deltanet_conv", &case, &gpu.download(&out).expect("download"), &want, 1e-5, 1e-4);
            let (conv, _) = device_states(gpu, &dev);
            compare("deltanet_conv_windows", &case, &conv, &host_states(&host).0, 0.0, 0.0);
        }
    }
}

/// Random normalized q and k, v, log decays and betas for `t` tokens: the CPU's inputs, and
/// the device's fused rows (q, k, v, then padding).
struct RuleInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    fused: Vec<f32>,
    stride: usize,
}

fn rule_inputs(rng: &mut StdRng, shape: &DeltaShape, t: usize) -> RuleInputs {
    let (kd, vd) = (shape.k_heads * shape.k_dim, shape.v_heads * shape.v_dim);
    let mut q = uniform(rng, t * kd, -1.0, 1.0);
    let mut k = uniform(rng, t * kd, -1.0, 1.0);
    gated_delta::l2_normalize(&mut q, shape.k_dim, 1e-6, 1.0 / (shape.k_dim as f32).sqrt());
    gated_delta::l2_normalize(&mut k, shape.k_dim, 1e-6, 1.0);
    let v = uniform(rng, t * vd, -1.0, 1.0);
    let g = uniform(rng, t * shape.v_heads, -2.0, 0.0);
    let beta = uniform(rng, t * shape.v_heads, 0.0, 1.0);
    let stride = 2 * kd + vd + 3;
    let mut fused = vec![0f32; t * stride];
    for (i, row) in fused.chunks_exact_mut(stride).enumerate() {
        row[..kd].copy_from_slice(&q[i * kd..(i + 1) * kd]);
        row[kd..2 * kd].copy_from_slice(&k[i * kd..(i + 1) * kd]);
        row[2 * kd..2 * kd + vd].copy_from_slice(&v[i * vd..(i + 1) * vd]);
    }
    RuleInputs { q, k, v, g, beta, fused, stride }
}

#[test]
fn cuda_deltanet_rule_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_deltanet_rule_matches_cpu") else { return };
    let mut rng = rng("cuda_deltanet_rule_matches_cpu");
    let shapes = [
        DeltaShape { k_heads: 2, v_heads: 4, k_dim: 16, v_dim: 8, tiled: false },
        DeltaShape { k_heads: 1, v_heads: 3, k_dim: 48, v_dim: 40, tiled: false },
        DeltaShape { k_heads: 2, v_heads: 4, k_dim: 128, v_dim: 128, tiled: true },
    ];
    for shape in shapes {
        let spec = spec_of(&shape);
        let vd = shape.v_heads * shape.v_dim;
        for lens in CASES {
            let (mut host, mut dev) = pools(gpu, &mut rng, spec);
            let first = prefill_rows(lens);
            let steps = [first.clone(), decode_rows(&first)];
            for (step, rows) in steps.iter().enumerate() {
                let t = rows.last().expect("rows").tokens.end;
                let x = rule_inputs(&mut rng, &shape, t);
                let mut want = vec![0f32; t * vd];
                gated_delta::gated_delta_rule(&x.q, &x.k, &x.v, &x.g, &x.beta, &shape, &mut host, rows, &mut want)
                    .expect("cpu rule");
                let mut table = StateTable::new(gpu, t).expect("table");
                table.upload(gpu, rows, Padding { rows: rows.len(), query: 1 }, SLOTS).expect("table upload");
                let (fused, g, beta) = (gpu.upload(&x.fused), gpu.upload(&x.g), gpu.upload(&x.beta));
                let (fused, g, beta) = (fused.expect("upload"), g.expect("upload"), beta.expect("upload"));
                let mut out = poisoned_f32(gpu, t * vd);
                ops::delta_rule(gpu, &fused, x.stride, &g, &beta, &shape, &table, &mut dev, &mut out).expect("rule");
                let case = format!("{shape:?} rows {lens:?} step {step}");
                compare("deltanet_rule", &case, &gpu.download(&out).expect("download"), &want, 1e-4, 1e-3);
                let (_, ssm) = device_states(gpu, &dev);
                compare("deltanet_rule_states", &case, &ssm, &host_states(&host).1, 1e-4, 1e-3);
            }
        }
    }
}

/// Rows of one length (a verify step's shape) padded to a graph's row bucket with rows that
/// read and write no slot, against the same rows unpadded: the real tokens' conv and delta
/// rule outputs and every slot's state must be the same bits (the one-step kernel at 5 tokens
/// a row, the chunked scan at 17).
#[test]
fn cuda_deltanet_padded_rows_touch_no_state() {
    let Some((gpu, _checks)) = gpu("cuda_deltanet_padded_rows_touch_no_state") else { return };
    let mut rng = rng("cuda_deltanet_padded_rows_touch_no_state");
    let shape = DeltaShape { k_heads: 2, v_heads: 4, k_dim: 16, v_dim: 8, tiled: false };
    let spec = spec_of(&shape);
    let (c, vd) = (spec.conv_channels, shape.v_heads * shape.v_dim);
    let w_dev = gpu.upload(&uniform(&mut rng, KERNEL * c, -0.6, 0.6)).expect("upload");
    for q in [5usize, DELTA_CHUNK_MIN_TOKENS + 1] {
        let rows = prefill_rows(&[q, q, q]);
        let (n, t) = (rows.len(), rows.last().expect("rows").tokens.end);
        let padded = t + 3 * q;
        let x = rule_inputs(&mut rng, &shape, padded);
        let conv_x = gpu.upload(&uniform(&mut rng, padded * (c + 3), -2.0, 2.0)).expect("upload");
        let (fused, g, beta) = (gpu.upload(&x.fused), gpu.upload(&x.g), gpu.upload(&x.beta));
        let (fused, g, beta) = (fused.expect("upload"), g.expect("upload"), beta.expect("upload"));
        let pools_rng = rng.clone();
        let run = |pad: Padding| {
            let (_, mut dev) = pools(gpu, &mut pools_rng.clone(), spec);
            let mut table = StateTable::new(gpu, padded).expect("table");
            table.upload(gpu, &rows, pad, SLOTS).expect("table upload");
            assert_eq!(table.tokens(), pad.rows * q);
            let mut conv = poisoned_f32(gpu, padded * c);
            ops::delta_conv(gpu, &conv_x, c + 3, &w_dev, &table, &mut dev, &mut conv).expect("conv");
            let mut out = poisoned_f32(gpu, padded * vd);
            ops::delta_rule(gpu, &fused, x.stride, &g, &beta, &shape, &table, &mut dev, &mut out).expect("rule");
            let (conv, out) = (gpu.download(&conv).expect("download"), gpu.download(&out).expect("download"));
            (conv[..t * c].to_vec(), out[..t * vd].to_vec(), device_states(gpu, &dev))
        };
        let (want_conv, want_out, (want_windows, want_ssm)) = run(Padding { rows: n, query: q });
        let (got_conv, got_out, (got_windows, got_ssm)) = run(Padding { rows: n + 3, query: q });
        let case = format!("{n} rows of {q} padded to {}", n + 3);
        compare("deltanet_padded", &format!("{case}: conv"), &got_conv, &want_conv, 0.0, 0.0);
        compare("deltanet_padded", &format!("{case}: rule"), &got_out, &want_out, 0.0, 0.0);
        compare("deltanet_padded", &format!("{case}: windows"), &got_windows, &want_windows, 0.0, 0.0);
        compare("deltanet_padded", &format!("{case}: states"), &got_ssm, &want_ssm, 0.0, 0.0);
    }
}

#[test]
fn cuda_deltanet_norms_and_gates_match_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_deltanet_norms_and_gates_match_cpu") else { return };
    let mut rng = rng("cuda_deltanet_norms_and_gates_match_cpu");
    for (t, k_heads, k_dim, v_heads, v_dim) in [(1, 2, 16, 4, 8), (9, 3, 40, 6, 24), (33, 16, 128, 32, 128)] {
        let case = format!("{t} tokens, {k_heads}x{k_dim} keys, {v_heads}x{v_dim} values");
        // q/k norm over rows with other channels after them.
        let (kd, stride) = (k_heads * k_dim, 2 * k_heads * k_dim + 5);
        let x = uniform(&mut rng, t * stride, -3.0, 3.0);
        let scale = 1.0 / (k_dim as f32).sqrt();
        let mut want = x.clone();
        for row in want.chunks_exact_mut(stride) {
            gated_delta::l2_normalize(&mut row[..kd], k_dim, 1e-6, scale);
            gated_delta::l2_normalize(&mut row[kd..2 * kd], k_dim, 1e-6, 1.0);
        }
        let mut dev = gpu.upload(&x).expect("upload");
        ops::delta_qk_norm(gpu, &mut dev, (t, stride), (k_heads, k_dim), scale, 1e-6).expect("qk norm");
        compare("deltanet_qk_norm", &case, &gpu.download(&dev).expect("download"), &want, 1e-5, 1e-4);

        // The gates from b and a columns of a wider row.
        let (b_off, a_off, width) = (3, 3 + v_heads + 1, 3 + 2 * v_heads + 4);
        let proj = uniform(&mut rng, t * width, -6.0, 6.0);
        let mut a: Vec<f32> = proj.chunks_exact(width).flat_map(|r| r[a_off..a_off + v_heads].to_vec()).collect();
        // Past softplus's linear threshold too.
        a[0] = 30.0;
        let mut proj = proj;
        proj[a_off] = 30.0;
        let b: Vec<f32> = proj.chunks_exact(width).flat_map(|r| r[b_off..b_off + v_heads].to_vec()).collect();
        let neg_rate = uniform(&mut rng, v_heads, -4.0, -0.1);
        let dt_bias = uniform(&mut rng, v_heads, -1.0, 1.0);
        let (want_beta, want_g) = gated_delta::gates(&b, &a, &neg_rate, &dt_bias);
        let (mut beta, mut g) = (poisoned_f32(gpu, t * v_heads), poisoned_f32(gpu, t * v_heads));
        let (pd, nd, dd) = (gpu.upload(&proj), gpu.upload(&neg_rate), gpu.upload(&dt_bias));
        let (pd, nd, dd) = (pd.expect("upload"), nd.expect("upload"), dd.expect("upload"));
        ops::delta_gates(gpu, &pd, (t, width, b_off, a_off), &nd, &dd, &mut beta, &mut g).expect("gates");
        compare("deltanet_beta", &case, &gpu.download(&beta).expect("download"), &want_beta, 1e-6, 1e-5);
        compare("deltanet_g", &case, &gpu.download(&g).expect("download"), &want_g, 1e-5, 1e-4);

        // The output norm times silu(z), z in rows of a wider projection.
        let vd = v_heads * v_dim;
        let o = uniform(&mut rng, t * vd, -2.0, 2.0);
        let z_stride = vd + 7;
        let zrows = uniform(&mut rng, t * z_stride, -4.0, 4.0);
        let norm = uniform(&mut rng, v_dim, 0.5, 1.5);
        let mut normed = o.clone();
        rms_norm_in_place(&mut normed, &norm, 1e-6, 0.0);
        let mut want: Vec<f32> = zrows.chunks_exact(z_stride).flat_map(|r| r[..vd].to_vec()).collect();
        silu_mul(&mut want, &normed);
        let (od, zd, wd) = (gpu.upload(&o), gpu.upload(&zrows), gpu.upload(&norm));
        let (od, zd, wd) = (od.expect("upload"), zd.expect("upload"), wd.expect("upload"));
        let mut out = poisoned_bf16(gpu, t * vd);
        ops::delta_out_norm(gpu, &od, &zd, z_stride, &wd, (t, v_heads, v_dim), 1e-6, &mut out).expect("out norm");
        // bf16 out: half an ulp of 2^-8 relative.
        compare("deltanet_out_norm", &case, &to_f32(&gpu.download(&out).expect("download")), &want, 1e-6, 1.0 / 128.0);
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[test]
fn cuda_sigmoid_gates_match_reference() {
    let Some((gpu, _checks)) = gpu("cuda_sigmoid_gates_match_reference") else { return };
    let mut rng = rng("cuda_sigmoid_gates_match_reference");
    for (t, width) in [(1, 16), (7, 48), (130, 1024)] {
        let case = format!("[{t}, {width}]");
        // A gated attention output: gates in rows of a wider buffer.
        let stride = width + 24;
        let (xh, x) = rand_bf16(&mut rng, t * width, 3.0);
        let (gh, gates) = rand_bf16(&mut rng, t * stride, 6.0);
        let want: Vec<f32> =
            x.iter().enumerate().map(|(i, &v)| v * sigmoid(gates[(i / width) * stride + i % width])).collect();
        let mut xd = gpu.upload(&xh).expect("upload");
        let gd = gpu.upload(&gh).expect("upload");
        ops::sigmoid_gate_mul(gpu, &mut xd, &gd, (t, width, stride)).expect("gate");
        compare("sigmoid_gate_mul", &case, &to_f32(&gpu.download(&xd).expect("download")), &want, 1e-6, 1.0 / 128.0);

        // A shared expert's output joining the sum through its gate's logit.
        let (oh, o) = rand_bf16(&mut rng, t * width, 2.0);
        let (yh, y) = rand_bf16(&mut rng, t * width, 2.0);
        let logits = uniform(&mut rng, t, -5.0, 5.0);
        let want: Vec<f32> =
            o.iter().zip(&y).enumerate().map(|(i, (&o, &y))| o + sigmoid(logits[i / width]) * y).collect();
        let mut od = gpu.upload(&oh).expect("upload");
        let (yd, ld) = (gpu.upload(&yh).expect("upload"), gpu.upload(&logits).expect("upload"));
        ops::add_sigmoid_scaled(gpu, &mut od, &yd, &ld, (t, width)).expect("add");
        let got = to_f32(&gpu.download(&od).expect("download"));
        compare("add_sigmoid_scaled", &case, &got, &want, 1e-6, 1.0 / 128.0);
    }
}

/// Long rows of `lens` tokens: odd rows read a random slot, even ones start a sequence; each
/// writes after 17 and 40 tokens (mid-chunk), 32 and every 64 (chunk ends) and its end (mid-
/// chunk for most lengths), to fresh slots; the last row also writes after each of its first 5
/// tokens (a verify span's states inside a chunk).
fn long_rows(lens: &[usize]) -> Vec<StateRow> {
    let (mut start, mut fresh) = (0, 8u32);
    let mut rows = Vec::new();
    for (r, &len) in lens.iter().enumerate() {
        let mut writes = Vec::new();
        for n in 1..=len {
            let per_token = r + 1 == lens.len() && n <= 5;
            for _ in 0..usize::from(per_token) + usize::from([17, 32, 40].contains(&n) || n % 64 == 0 || n == len) {
                writes.push((n, fresh));
                fresh += 1;
            }
        }
        rows.push(StateRow { tokens: start..start + len, read: (r % 2 == 1).then_some(r as u32), writes });
        start += len;
    }
    assert!(fresh as usize <= SLOTS, "{fresh} slots for rows {lens:?}");
    rows
}

/// A second step continuing `before`: row r has `lens[r]` tokens, reads its end slot and
/// writes its end there again.
fn continued_rows(before: &[StateRow], lens: &[usize]) -> Vec<StateRow> {
    let mut start = 0;
    (before.iter().zip(lens))
        .map(|(row, &len)| {
            let end = row.writes.last().expect("an end write").1;
            start += len;
            StateRow { tokens: start - len..start, read: Some(end), writes: vec![(len, end)] }
        })
        .collect()
}

#[test]
fn cuda_deltanet_chunked_scan_matches_sequential_and_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_deltanet_chunked_scan_matches_sequential_and_cpu") else { return };
    let mut rng = rng("cuda_deltanet_chunked_scan_matches_sequential_and_cpu");
    // Key widths 32, 48 (the 64-wide kernel, half of it padding), 64 and 128 (every kernel);
    // value heads within one 32-column tile and over several, a partial one too.
    let shapes = [
        DeltaShape { k_heads: 2, v_heads: 4, k_dim: 32, v_dim: 32, tiled: true },
        DeltaShape { k_heads: 1, v_heads: 3, k_dim: 48, v_dim: 40, tiled: false },
        DeltaShape { k_heads: 2, v_heads: 2, k_dim: 64, v_dim: 64, tiled: false },
        DeltaShape { k_heads: 2, v_heads: 4, k_dim: 128, v_dim: 128, tiled: true },
    ];
    let firsts: [&[usize]; 2] = [&[1, 63, 64, 65, 200, 1000], &[33, 31, 16, 15, 96]];
    // (label, chunk_min): every row through each kernel, then the default route.
    let routes = [("sequential", usize::MAX), ("chunked", 1), ("routed", DELTA_CHUNK_MIN_TOKENS)];
    for shape in shapes {
        let spec = spec_of(&shape);
        let vd = shape.v_heads * shape.v_dim;
        for lens in firsts {
            let (mut host, _) = pools(gpu, &mut rng, spec);
            let mut devs: Vec<DeviceStatePool> = routes.iter().map(|_| device_pool(gpu, &host)).collect();
            let first = long_rows(lens);
            let again: Vec<usize> = (0..lens.len()).map(|r| [70, 1, 40, 17][r % 4]).collect();
            let steps = [first.clone(), continued_rows(&first, &again)];
            for (step, rows) in steps.iter().enumerate() {
                let t = rows.last().expect("rows").tokens.end;
                let mut x = rule_inputs(&mut rng, &shape, t);
                // Slow decays (long memory), one token in 20 a sharp one (down to exp(-20)).
                for g in &mut x.g {
                    *g = if rng.random_range(0.0..1.0) < 0.05 {
                        rng.random_range(-20.0..0.0)
                    } else {
                        rng.random_range(-0.05..0.0)
                    };
                }
                let mut want = vec![0f32; t * vd];
                gated_delta::gated_delta_rule(&x.q, &x.k, &x.v, &x.g, &x.beta, &shape, &mut host, rows, &mut want)
                    .expect("cpu rule");
                let (fused, g, beta) = (gpu.upload(&x.fused), gpu.upload(&x.g), gpu.upload(&x.beta));
                let (fused, g, beta) = (fused.expect("upload"), g.expect("upload"), beta.expect("upload"));
                let mut got = Vec::new();
                for ((label, chunk_min), dev) in routes.iter().zip(&mut devs) {
                    let mut table = StateTable::new(gpu, t).expect("table");
                    table.set_chunk_min(gpu, *chunk_min).expect("route");
                    table.upload(gpu, rows, Padding { rows: rows.len(), query: 1 }, SLOTS).expect("table upload");
                    let mut out = poisoned_f32(gpu, t * vd);
                    ops::delta_rule(gpu, &fused, x.stride, &g, &beta, &shape, &table, dev, &mut out).expect("rule");
                    let (out, (_, ssm)) = (gpu.download(&out).expect("download"), device_states(gpu, dev));
                    let case = format!("{shape:?} rows {lens:?} step {step} {label}");
                    compare("deltanet_chunk_out", &case, &out, &want, 5e-5, 5e-4);
                    compare("deltanet_chunk_states", &case, &ssm, &host_states(&host).1, 5e-5, 5e-4);
                    got.push((out, ssm));
                }
                // The two kernels on the same rows, directly.
                let case = format!("{shape:?} rows {lens:?} step {step} chunked vs sequential");
                compare("deltanet_chunk_vs_seq_out", &case, &got[1].0, &got[0].0, 5e-5, 5e-4);
                compare("deltanet_chunk_vs_seq_states", &case, &got[1].1, &got[0].1, 5e-5, 5e-4);
            }
        }
    }
}
