//! The full-precision twin pools of a quantized device KV cache (a delayed quantized start),
//! gated on `FERRITE_TEST_CUDA=1`.
//!
//! - `KvCache::convert_blocks` on a device cache against the host's: rows written into the
//!   twins (bf16 on the device, f16 on the host) through the KV write, their blocks converted
//!   into the quantized pools, keys less the layers' key offsets. The values are bf16 numbers
//!   f16 holds exactly (|x| ≥ 2^-14), so both sides quantize the same values and must store the
//!   same bytes: every int8 / int4 group size dividing the head dim, a layer kept at full
//!   precision copied (bf16 against f16: the same values). The converted pools also equal a
//!   cache written directly in the quantized pools (a row quantized from its first position).
//!   (fp8 has no host pool; its conversion is held to the device's own write in
//!   `cuda_kv_quant.rs`.)
//! - Rows of both pool sets in one step: a row in the twins and a row in the quantized pools,
//!   written and attended together (prefill, then decode with the same plan), give each the
//!   bits it gets alone.

mod cuda_common;
mod kv_quant_common;

use cuda_common::attention::{params, Heads};
use cuda_common::{gpu, poisoned_bf16, pool_f32, rng};
use ferrite_runtime::batch::{RowLogits, RowOptions};
use ferrite_runtime::cpu;
use ferrite_runtime::cuda::ops::{self, AttentionMeta, DecodePlan, DecodeScratch};
use ferrite_runtime::kv::{KvDtype, KvLayerSpec, KvSkip};
use ferrite_runtime::{ForwardBatch, KvCache, KvGroupKind, KvLayout, KvScheme};
use half::bf16;
use kv_quant_common::download;
use rand::rngs::StdRng;
use rand::Rng;

const BLOCK: usize = 16;

/// `n` bf16 values of magnitude 2^-4..4 (f16 holds each exactly), random signs; and as f32.
fn values(rng: &mut StdRng, n: usize) -> (Vec<bf16>, Vec<f32>) {
    let h: Vec<bf16> = (0..n)
        .map(|_| {
            let x = 2f32.powf(rng.random_range(-4.0..2.0));
            bf16::from_f32(if rng.random_bool(0.5) { x } else { -x })
        })
        .collect();
    let f = h.iter().map(|x| x.to_f32()).collect();
    (h, f)
}

/// One row of `tokens` tokens over `table`, before its quantized start or not.
fn row(tokens: usize, table: Vec<u32>, full_precision: bool) -> ForwardBatch {
    let mut batch = ForwardBatch::default();
    let options = RowOptions { adapter: None, full_precision };
    batch.push_row_with(&vec![0; tokens], tokens, vec![table], RowLogits::None, options);
    batch
}

#[test]
fn cuda_twin_conversion_matches_the_host() {
    let Some((gpu, _checks)) = gpu("cuda_twin_conversion_matches_the_host") else { return };
    let mut rng = rng("twin_conversion");
    for (nkv, hd) in [(2, 64), (1, 128), (4, 32)] {
        let spec = KvLayerSpec { n_kv_heads: nkv, head_dim: hd, group: 0 };
        let layout = KvLayout { groups: vec![KvGroupKind::Full], layers: vec![spec; 2], states: Vec::new() };
        let width = nkv * hd;
        for group in [16, 32, 64, 128].into_iter().filter(|g| hd.is_multiple_of(*g)) {
            for dtype in [KvDtype::Int8 { group }, KvDtype::Int4 { group }] {
                let case = format!("{dtype} {nkv}x{hd}");
                // Layer 1 stays full precision.
                let scheme = KvScheme { dtype, skip: KvSkip::List(vec![1]) };
                let mut dev = KvCache::on_device_with_scheme(gpu, &layout, &[6], BLOCK, &scheme).unwrap();
                let mut direct = KvCache::on_device_with_scheme(gpu, &layout, &[6], BLOCK, &scheme).unwrap();
                let mut host = KvCache::with_scheme(&layout, &[6], BLOCK, &scheme).unwrap();
                dev.add_full_precision(&[4]).unwrap();
                host.add_full_precision(&[4]).unwrap();
                assert!(dev.add_full_precision(&[4]).is_err(), "{case}: twins twice");
                let mu: Vec<f32> = (0..width).map(|_| rng.random_range(-6.0..6.0)).collect();
                for kv in [&mut dev, &mut direct, &mut host] {
                    kv.set_key_offsets(&[Some(mu.clone()), Some(mu.clone())]).unwrap();
                    assert!(kv.scheme().ends_with("-key-offsets"), "{case}: {}", kv.scheme());
                }
                let tokens = 3 * BLOCK;
                let (twins, quantized) = (vec![2u32, 0, 3], vec![5u32, 1, 0]);
                let (full_row, own_row) = (row(tokens, twins.clone(), true), row(tokens, quantized.clone(), false));
                for i in 0..2 {
                    let (kh, kf) = values(&mut rng, tokens * width);
                    let (vh, vf) = values(&mut rng, tokens * width);
                    let (kd, vd) = (gpu.upload(&kh).unwrap(), gpu.upload(&vh).unwrap());
                    for (kv, batch) in [(&mut dev, &full_row), (&mut direct, &own_row)] {
                        let meta = AttentionMeta::upload(gpu, batch, 0, BLOCK).unwrap();
                        ops::write_kv(gpu, &kd, &vd, width, &meta, kv.device_layer_mut(i).unwrap()).unwrap();
                    }
                    cpu::write_kv(&kf, &vf, &full_row, host.layer_mut(i).unwrap(), BLOCK).unwrap();
                }
                let moves: Vec<(u32, u32)> = twins.iter().copied().zip(quantized.iter().copied()).collect();
                dev.convert_blocks(0, &moves).unwrap();
                host.convert_blocks(0, &moves).unwrap();
                assert!(dev.convert_blocks(0, &[(4, 0)]).is_err(), "{case}: twin block 4 does not exist");
                let d0 = dev.device_layer_mut(0).unwrap();
                let got = [download(gpu, &d0.k), download(gpu, &d0.v)];
                let h0 = host.layer_mut(0).unwrap();
                let want = [&h0.k, &h0.v].map(|p| p.raw_parts().map(<[u8]>::to_vec));
                assert!(got == want, "{case}: the device's converted bytes differ from the host's");
                let r0 = direct.device_layer_mut(0).unwrap();
                let written = [download(gpu, &r0.k), download(gpu, &r0.v)];
                assert!(got == written, "{case}: converted bytes differ from a direct write of the same values");
                let d1 = dev.device_layer_mut(1).unwrap();
                let got = [pool_f32(gpu, &d1.k), pool_f32(gpu, &d1.v)];
                let h1 = host.layer_mut(1).unwrap();
                assert!(got == [h1.k.to_f32(), h1.v.to_f32()], "{case}: the full-precision layer's copy");
                println!("TABLE|twin conversion|{case} == host convert_blocks|bytes|ok");
            }
        }
    }
}

#[test]
fn cuda_rows_of_both_pool_sets_attend_as_alone() {
    let Some((gpu, _checks)) = gpu("cuda_rows_of_both_pool_sets_attend_as_alone") else { return };
    let mut rng = rng("twin_rows");
    let h = Heads { nh: 8, nkv: 2, hd: 64 };
    let p = params(h, None, None);
    let spec = KvLayerSpec { n_kv_heads: h.nkv, head_dim: h.hd, group: 0 };
    let layout = KvLayout { groups: vec![KvGroupKind::Full], layers: vec![spec], states: Vec::new() };
    let (qw, kw) = (h.nh * h.hd, h.nkv * h.hd);
    for dtype in [KvDtype::Int8 { group: 32 }, KvDtype::Int4 { group: 16 }, KvDtype::Fp8] {
        let scheme = KvScheme { dtype, ..KvScheme::default() };
        // Row 0 in the twins (blocks 1, 0), row 1 in the quantized pools (blocks 3, 2): a
        // prefill of 20 and 27 tokens, then a decode step each.
        let tables = [vec![1u32, 0], vec![3u32, 2]];
        let step = |lens: [usize; 2], ctx: [usize; 2], which: &[usize]| {
            let mut batch = ForwardBatch::default();
            for &r in which {
                let options = RowOptions { adapter: None, full_precision: r == 0 };
                batch.push_row_with(&vec![0; lens[r]], ctx[r], vec![tables[r].clone()], RowLogits::None, options);
            }
            batch
        };
        let steps = [([20, 27], [20, 27]), ([1, 1], [21, 28])];
        let inputs: Vec<_> = steps
            .iter()
            .map(|&(lens, _)| {
                let n = lens[0] + lens[1];
                let (q, _) = cuda_common::rand_bf16(&mut rng, n * qw, 1.0);
                let (k, _) = cuda_common::rand_bf16(&mut rng, n * kw, 1.0);
                let (v, _) = cuda_common::rand_bf16(&mut rng, n * kw, 1.0);
                (q, k, v)
            })
            .collect();
        // Both rows in one step, then each alone over its own cache; every output row compared.
        let mut outs: Vec<Vec<Vec<bf16>>> = Vec::new();
        for which in [&[0usize, 1][..], &[0], &[1]] {
            let mut kv = KvCache::on_device_with_scheme(gpu, &layout, &[4], BLOCK, &scheme).unwrap();
            kv.add_full_precision(&[2]).unwrap();
            if dtype == KvDtype::Fp8 {
                // Fixed scales: a calibration from another step's keys would differ.
                kv.device_layer_mut(0).unwrap().set_fp8_scales(gpu, &[0.01; 4]).unwrap();
            }
            let mut got = Vec::new();
            for (&(lens, ctx), (q, k, v)) in steps.iter().zip(&inputs) {
                let batch = step(lens, ctx, which);
                // The rows' own slices of the step's inputs.
                let span = |r: usize| if r == 0 { 0..lens[0] } else { lens[0]..lens[0] + lens[1] };
                let pick = |x: &[bf16], w: usize| -> Vec<bf16> {
                    which.iter().flat_map(|&r| x[span(r).start * w..span(r).end * w].to_vec()).collect()
                };
                let (q, k, v) = (pick(q, qw), pick(k, kw), pick(v, kw));
                let (qd, kd, vd) = (gpu.upload(&q).unwrap(), gpu.upload(&k).unwrap(), gpu.upload(&v).unwrap());
                let meta = AttentionMeta::upload(gpu, &batch, 0, BLOCK).unwrap();
                let layer = kv.device_layer_mut(0).unwrap();
                ops::write_kv(gpu, &kd, &vd, kw, &meta, layer).unwrap();
                let plan = DecodePlan { partition: 64, splits: 1 };
                let mut scratch = DecodeScratch::new(gpu, 2, h.nh, h.hd, 1).unwrap();
                let mut out = poisoned_bf16(gpu, batch.num_tokens() * qw);
                ops::attention(gpu, &qd, qw, &meta, layer, &p, Some(plan), &mut scratch, &mut out, qw).unwrap();
                let out = gpu.download(&out).unwrap();
                let mut at = 0;
                for &r in which {
                    let n = lens[r] * qw;
                    got.push(out[at..at + n].to_vec());
                    at += n;
                }
            }
            outs.push(got);
        }
        // outs[0]: (step 0: row 0, row 1), (step 1: row 0, row 1); outs[1]: row 0's steps;
        // outs[2]: row 1's.
        for s in 0..2 {
            for r in 0..2 {
                let (mixed, alone) = (&outs[0][2 * s + r], &outs[1 + r][s]);
                assert!(mixed.iter().all(|x| x.is_finite()), "{dtype}: step {s}, row {r}: unwritten output");
                assert!(mixed == alone, "{dtype}: step {s}, row {r}: batched with the other pool set != alone");
            }
        }
        println!("TABLE|twin rows|{dtype}: twin and quantized rows batched == alone|bits|ok");
    }
}
