//! CUDA paged attention and KV write against the CPU ops, gated on `FERRITE_TEST_CUDA=1`.
//!
//! Each case fills a cache of shuffled 16-slot blocks with random bf16 keys and values, writes
//! the step's new keys and values through both `write_kv`s (the caches must then agree
//! exactly), and compares attention outputs: decode batches (contexts 1..2048, split-K with
//! the automatic plan, a forced 64-key partition and a single partition) and mixed batches
//! (cold prefill, chunked continuation, decode rows, tile edges at 64/65/130 queries), for
//! GQA 9/3 × 64, 32/8 × 128, 16/8 × 256, 4/2 × 16, 4/1 × 32 and 8/2 × 512, plain,
//! sliding-window and soft-capped; decode also for groups wider than the 4 heads a decode CTA
//! usually takes (12/2 × 128, 8/1 × 256, 16/2 × 512, and 20/2 × 64, whose group of 10 spans two
//! CTAs).
//! Decode attention that rotates its own queries and new keys and stores K and V
//! (`decode_attention_rope`), with and without per-head q/k norms, must give the bits of
//! (`qkv_norm`,) RoPE with the KV store, then attention: outputs and caches. Verify rows (every row the same 2 to 17 query tokens) padded to a
//! graph's row bucket with empty rows (`Padding`) must give the unpadded step's bits, store
//! nothing for the padding and attend to nothing there (zeros).
//!
//! Tolerance: the output is a convex combination of values |v| < 1. The GPU rounds the output
//! to bf16 (2^-9 relative) and, in the prefill kernel, the probabilities to bf16 before P·V
//! (each weight off by at most 2^-9 relative, so the sum by at most 2^-9 · max|v|); scores
//! and sums are f32 in both. Hence |gpu − cpu| ≤ 2^-8 + 2^-7·|cpu|, with room for f32 noise.

mod cuda_common;

use cuda_common::attention::{params, shuffled_batch, variants, Heads};
use cuda_common::{compare, fill_pool, gpu, poisoned_bf16, pool_f32, rand_bf16, rng, to_f32};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::cpu::{self, AttentionParams};
use ferrite_runtime::cuda::ops::{
    self, AttentionMeta, DecodePlan, DecodeScratch, DeviceKv, QkNorms, QkvHeads, RopeShape,
};
use ferrite_runtime::cuda::Gpu;
use ferrite_runtime::kv::{KvDtype, KvLayerSpec, KvPool, LayerKv};
use ferrite_runtime::{ForwardBatch, Padding};
use rand::rngs::StdRng;
use rand::Rng;

const BLOCK: usize = 16;
const ATOL: f32 = 1.0 / 256.0;
const RTOL: f32 = 1.0 / 128.0;

const HEADS: [Heads; 6] = [
    Heads { nh: 9, nkv: 3, hd: 64 },
    Heads { nh: 32, nkv: 8, hd: 128 },
    Heads { nh: 16, nkv: 8, hd: 256 },
    // Gemma: the tiny fixtures' heads and Gemma 4's wide global heads.
    Heads { nh: 4, nkv: 2, hd: 16 },
    Heads { nh: 4, nkv: 1, hd: 32 },
    Heads { nh: 8, nkv: 2, hd: 512 },
];
/// GQA groups of more than 4 heads (the decode kernel's 8-head variant, and head chunks).
const WIDE_GROUPS: [Heads; 4] = [
    Heads { nh: 12, nkv: 2, hd: 128 },
    Heads { nh: 8, nkv: 1, hd: 256 },
    Heads { nh: 20, nkv: 2, hd: 64 },
    Heads { nh: 16, nkv: 2, hd: 512 },
];

/// Which decode split to use: the automatic plan, or a fixed partition length.
#[derive(Debug, Clone, Copy)]
enum Split {
    Auto,
    Partition(usize),
}

#[allow(clippy::too_many_arguments)]
fn run_case(
    gpu: &Gpu,
    rng: &mut StdRng,
    label: &str,
    h: Heads,
    shapes: &[(usize, usize)],
    p: AttentionParams,
    q_amp: f32,
    split: Split,
) {
    let (nh, nkv, hd) = (h.nh, h.nkv, h.hd);
    let needed: usize = shapes.iter().map(|&(ctx, _)| ctx.div_ceil(BLOCK)).sum();
    let pool = needed + 7;
    let batch = shuffled_batch(rng, shapes, pool, BLOCK);
    let tokens = batch.num_tokens();
    let n = pool * BLOCK * nkv * hd;
    let (kh, kf) = rand_bf16(rng, n, 1.0);
    let (vh, vf) = rand_bf16(rng, n, 1.0);
    let spec = KvLayerSpec { n_kv_heads: nkv, head_dim: hd, group: 0 };
    let mut layer = LayerKv::new(spec, KvPool::F32(kf[..].into()), KvPool::F32(vf[..].into()));
    let mut dkv = DeviceKv::new(gpu, pool, BLOCK, nkv, hd).unwrap();
    fill_pool(gpu, &kh, &mut dkv.k);
    fill_pool(gpu, &vh, &mut dkv.v);

    // New keys and values, interleaved per token as [k | v] (a strided view, like fused QKV).
    let width = nkv * hd;
    let (new_h, new_f) = rand_bf16(rng, tokens * 2 * width, 1.0);
    let new_k: Vec<f32> = new_f.chunks(2 * width).flat_map(|r| r[..width].to_vec()).collect();
    let new_v: Vec<f32> = new_f.chunks(2 * width).flat_map(|r| r[width..].to_vec()).collect();
    cpu::write_kv(&new_k, &new_v, &batch, &mut layer, BLOCK).unwrap();
    let meta = AttentionMeta::upload(gpu, &batch, 0, BLOCK).unwrap();
    let new_d = gpu.upload(&new_h).unwrap();
    ops::write_kv(gpu, &new_d.slice(..), &new_d.slice(width..), 2 * width, &meta, &mut dkv).unwrap();
    let case = format!("{label} {nh}/{nkv}x{hd} rows={} tokens={tokens}", shapes.len());
    compare("write_kv", &format!("{case} K"), &pool_f32(gpu, &dkv.k), &layer.k.to_f32(), 0.0, 0.0);
    compare("write_kv", &format!("{case} V"), &pool_f32(gpu, &dkv.v), &layer.v.to_f32(), 0.0, 0.0);

    let (qh, qf) = rand_bf16(rng, tokens * nh * hd, q_amp);
    let mut want = vec![0f32; qf.len()];
    cpu::paged_attention(&qf, &batch, &layer, BLOCK, &p, &mut want).unwrap();
    let plan = match split {
        Split::Auto => DecodePlan::new(gpu, meta.rows, &p, meta.max_context),
        Split::Partition(partition) => {
            let visible = p.window.map_or(meta.max_context, |w| w.min(meta.max_context));
            DecodePlan { partition, splits: visible.div_ceil(partition) }
        }
    };
    let mut scratch = DecodeScratch::new(gpu, meta.rows, nh, hd, plan.splits).unwrap();
    let mut out = poisoned_bf16(gpu, tokens * nh * hd);
    let q_d = gpu.upload(&qh).unwrap();
    ops::attention(gpu, &q_d, nh * hd, &meta, &dkv, &p, Some(plan), &mut scratch, &mut out, nh * hd).unwrap();
    let kernel = if meta.max_query == 1 {
        format!("decode splits={} partition={}", plan.splits, plan.partition)
    } else {
        "prefill".into()
    };
    let what = format!("{case} {kernel} window={:?} softcap={:?}", p.window, p.softcap);
    compare("attention", &what, &to_f32(&gpu.download(&out).unwrap()), &want, ATOL, RTOL);
}

/// RoPE storing the rotated keys and the values (one launch) against the CPU's RoPE then
/// `write_kv`, and bit for bit against the GPU's RoPE then `write_kv`: a fused QKV buffer of
/// decode rows, a prefill chunk and a padding token (slot -1), full and partial rotary.
#[test]
fn cuda_rope_with_kv_store_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_rope_with_kv_store_matches_cpu") else { return };
    let mut rng = rng("rope_kv");
    for (h, rotary) in [(HEADS[0], 64), (HEADS[1], 128), (HEADS[2], 256), (HEADS[1], 32)] {
        let (nh, nkv, hd) = (h.nh, h.nkv, h.hd);
        let shapes: [(usize, usize); 5] = [(1, 1), (40, 1), (700, 1), (37, 37), (90, 20)];
        let pool = shapes.iter().map(|&(ctx, _)| ctx.div_ceil(BLOCK)).sum::<usize>() + 3;
        let mut ids: Vec<u32> = (0..pool as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.random_range(0..=i));
        }
        let mut batch = ForwardBatch::default();
        for &(ctx, len) in &shapes {
            let table: Vec<u32> = ids.drain(..ctx.div_ceil(BLOCK)).collect();
            batch.push_row(&vec![0; len], ctx, vec![table], RowLogits::None);
        }
        let tokens = batch.num_tokens();
        let width = (nh + 2 * nkv) * hd;
        let (qkv_h, qkv_f) = rand_bf16(&mut rng, tokens * width, 1.0);
        let inv_freq: Vec<f32> =
            (0..rotary / 2).map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / rotary as f32)).collect();
        let scaling = 1.1f32;
        let r = cpu::Rope::new(inv_freq.clone(), scaling);
        let part =
            |lo: usize, hi: usize| -> Vec<f32> { qkv_f.chunks(width).flat_map(|t| t[lo..hi].to_vec()).collect() };
        let (mut q, mut k, v) = (part(0, nh * hd), part(nh * hd, (nh + nkv) * hd), part((nh + nkv) * hd, width));
        r.apply(&mut q, &batch.positions, nh, hd);
        r.apply(&mut k, &batch.positions, nkv, hd);
        let n = pool * BLOCK * nkv * hd;
        let mut layer = LayerKv::new(
            KvLayerSpec { n_kv_heads: nkv, head_dim: hd, group: 0 },
            KvPool::zeroed(KvDtype::F32, n),
            KvPool::zeroed(KvDtype::F32, n),
        );
        cpu::write_kv(&k, &v, &batch, &mut layer, BLOCK).unwrap();
        // A padding token after the rows: the metadata gives it no slot.
        let meta = {
            let mut m = AttentionMeta::with_capacity(gpu, shapes.len() + 1, tokens + 1, 64).unwrap();
            m.update(gpu, &batch, 0, BLOCK, Padding { rows: shapes.len() + 1, query: 1 }, None).unwrap();
            m
        };
        let (pad_h, _) = rand_bf16(&mut rng, width, 1.0);
        let all_h: Vec<_> = qkv_h.iter().chain(&pad_h).copied().collect();
        let mut positions = batch.positions.clone();
        positions.push(5);
        let (pos_d, f_d) = (gpu.upload(&positions).unwrap(), gpu.upload(&inv_freq).unwrap());
        let shape = RopeShape { tokens: tokens + 1, n_heads: nh + nkv, head_dim: hd, stride: width };
        let mut fused = DeviceKv::new(gpu, pool, BLOCK, nkv, hd).unwrap();
        let mut qkv_d = gpu.upload(&all_h).unwrap();
        ops::rope(gpu, &mut qkv_d, &pos_d, &f_d, scaling, shape, Some((&meta, &mut fused))).unwrap();
        let case = format!("{nh}/{nkv}x{hd} rot={rotary} tokens={tokens}+1 pad");
        // As cuda_ops' RoPE test: half a bf16 ulp of |x| < 1 plus the result's rounding.
        let got_k = pool_f32(gpu, &fused.k);
        compare("rope+kv", &format!("{case} K"), &got_k, &layer.k.to_f32(), 4e-3 * scaling, 1.0 / 256.0);
        let got_v = pool_f32(gpu, &fused.v);
        compare("rope+kv", &format!("{case} V"), &got_v, &layer.v.to_f32(), 0.0, 0.0);
        let got = to_f32(&gpu.download(&qkv_d).unwrap());
        let got_q: Vec<f32> = got.chunks(width).take(tokens).flat_map(|t| t[..nh * hd].to_vec()).collect();
        compare("rope+kv", &format!("{case} q"), &got_q, &q, 4e-3 * scaling, 1.0 / 256.0);
        // The two ops it replaces, on the same input: the same bits everywhere.
        let mut apart = DeviceKv::new(gpu, pool, BLOCK, nkv, hd).unwrap();
        let mut qkv2 = gpu.upload(&all_h).unwrap();
        ops::rope(gpu, &mut qkv2, &pos_d, &f_d, scaling, shape, None).unwrap();
        ops::write_kv(gpu, &qkv2.slice(nh * hd..), &qkv2.slice((nh + nkv) * hd..), width, &meta, &mut apart).unwrap();
        compare("rope+kv", &format!("{case} == two ops: qkv"), &got, &to_f32(&gpu.download(&qkv2).unwrap()), 0.0, 0.0);
        let apart_k = pool_f32(gpu, &apart.k);
        compare("rope+kv", &format!("{case} == two ops: K"), &got_k, &apart_k, 0.0, 0.0);
    }
}

#[test]
fn cuda_decode_attention_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_decode_attention_matches_cpu") else { return };
    let mut rng = rng("decode");
    let rows: Vec<(usize, usize)> = [1, 15, 16, 17, 100, 511, 513, 1000, 2047, 2048].iter().map(|&c| (c, 1)).collect();
    for h in HEADS.into_iter().chain(WIDE_GROUPS) {
        for (p, amp) in variants(h) {
            for split in [Split::Auto, Split::Partition(64), Split::Partition(4096)] {
                run_case(gpu, &mut rng, &format!("{split:?}"), h, &rows, p, amp, split);
            }
        }
        // A single long row: split-K is the only parallelism.
        run_case(gpu, &mut rng, "single", h, &[(1999, 1)], params(h, None, None), 2.0, Split::Auto);
    }
}

#[test]
fn cuda_prefill_attention_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_prefill_attention_matches_cpu") else { return };
    let mut rng = rng("prefill");
    let mixed = [(300, 1), (37, 5), (100, 40), (1, 1), (250, 17), (2048, 200), (130, 130), (64, 64), (65, 65)];
    for h in HEADS {
        for (p, amp) in variants(h) {
            run_case(gpu, &mut rng, "mixed", h, &mixed, p, amp, Split::Auto);
        }
        run_case(gpu, &mut rng, "cold 1000", h, &[(1000, 1000)], params(h, None, None), 2.0, Split::Auto);
    }
}

/// Random bf16 keys and values for a cache of `pool` blocks, and a maker of device caches that
/// each start from them (for cases that run two paths from the same cache).
fn random_cache<'g>(gpu: &'g Gpu, rng: &mut StdRng, pool: usize, nkv: usize, hd: usize) -> impl Fn() -> DeviceKv + 'g {
    let n = pool * BLOCK * nkv * hd;
    let (kh, _) = rand_bf16(rng, n, 1.0);
    let (vh, _) = rand_bf16(rng, n, 1.0);
    move || {
        let mut c = DeviceKv::new(gpu, pool, BLOCK, nkv, hd).unwrap();
        fill_pool(gpu, &kh, &mut c.k);
        fill_pool(gpu, &vh, &mut c.v);
        c
    }
}

#[test]
fn cuda_decode_attention_with_rope_equals_rope_then_attention() {
    let Some((gpu, _checks)) = gpu("cuda_decode_attention_with_rope_equals_rope_then_attention") else { return };
    let mut rng = rng("decode_rope");
    let contexts = [1usize, 17, 100, 513, 2000];
    for (h, rotary) in [(HEADS[0], 64), (HEADS[1], 128), (HEADS[2], 256), (HEADS[1], 32), (WIDE_GROUPS[2], 64)] {
        let (nh, nkv, hd) = (h.nh, h.nkv, h.hd);
        for (p, amp) in variants(h) {
            let pool = contexts.iter().map(|c| c.div_ceil(BLOCK)).sum::<usize>() + 3;
            let mut ids: Vec<u32> = (0..pool as u32).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, rng.random_range(0..=i));
            }
            let mut batch = ForwardBatch::default();
            for &ctx in &contexts {
                let table: Vec<u32> = ids.drain(..ctx.div_ceil(BLOCK)).collect();
                batch.push_row(&[0], ctx, vec![table], RowLogits::None);
            }
            // One padding row after them (context 0), as a graph bucket adds.
            let rows = contexts.len() + 1;
            let mut meta = AttentionMeta::with_capacity(gpu, rows, rows, 2048 / BLOCK).unwrap();
            meta.update(gpu, &batch, 0, BLOCK, Padding { rows, query: 1 }, None).unwrap();
            let width = (nh + 2 * nkv) * hd;
            let (qkv_h, _) = rand_bf16(&mut rng, rows * width, amp);
            let fresh = random_cache(gpu, &mut rng, pool, nkv, hd);
            let inv_freq: Vec<f32> =
                (0..rotary / 2).map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / rotary as f32)).collect();
            let f_d = gpu.upload(&inv_freq).unwrap();
            let scaling = 1.1f32;
            let mut positions = batch.positions.clone();
            positions.push(0);
            let pos_d = gpu.upload(&positions).unwrap();
            let plan = DecodePlan::new(gpu, rows, &p, 2048);
            let mut scratch = DecodeScratch::new(gpu, rows, nh, hd, plan.splits).unwrap();

            let mut weights =
                || gpu.upload(&(0..hd).map(|_| rng.random_range(0.5f32..1.5)).collect::<Vec<_>>()).unwrap();
            let (wq, wk) = (weights(), weights());
            let heads = QkvHeads { tokens: rows, stride: width, head_dim: hd, n_q: nh, n_k: nkv, n_v: 0 };
            // Per-head q/k norms first (Qwen3): qkv_norm, or folded into the decode kernel.
            for normed in [false, true] {
                let (mut two, mut qkv_two) = (fresh(), gpu.upload(&qkv_h).unwrap());
                if normed {
                    ops::qkv_norm(gpu, &mut qkv_two, heads, Some(&wq), Some(&wk), 1e-6).unwrap();
                }
                let shape = RopeShape { tokens: rows, n_heads: nh + nkv, head_dim: hd, stride: width };
                ops::rope(gpu, &mut qkv_two, &pos_d, &f_d, scaling, shape, Some((&meta, &mut two))).unwrap();
                let mut want = poisoned_bf16(gpu, rows * nh * hd);
                ops::attention(gpu, &qkv_two, width, &meta, &two, &p, Some(plan), &mut scratch, &mut want, nh * hd)
                    .unwrap();

                let (mut one, mut qkv_one) = (fresh(), gpu.upload(&qkv_h).unwrap());
                let norms = normed.then_some(QkNorms { q: &wq, k: &wk, eps: 1e-6 });
                let mut got = poisoned_bf16(gpu, rows * nh * hd);
                let rope = (&f_d, scaling);
                ops::decode_attention_rope(
                    gpu,
                    &mut qkv_one,
                    width,
                    &meta,
                    &mut one,
                    &p,
                    rope,
                    norms,
                    plan,
                    &mut scratch,
                    &mut got,
                    nh * hd,
                )
                .unwrap();
                let case = format!(
                    "{nh}/{nkv}x{hd} rot={rotary} window={:?} softcap={:?} normed={normed}",
                    p.window, p.softcap
                );
                let (got, want) = (to_f32(&gpu.download(&got).unwrap()), to_f32(&gpu.download(&want).unwrap()));
                compare("decode+rope", &format!("{case} == rope then attention: out"), &got, &want, 0.0, 0.0);
                let (k1, k2) = (pool_f32(gpu, &one.k), pool_f32(gpu, &two.k));
                compare("decode+rope", &format!("{case} == rope then attention: K"), &k1, &k2, 0.0, 0.0);
                let (v1, v2) = (pool_f32(gpu, &one.v), pool_f32(gpu, &two.v));
                compare("decode+rope", &format!("{case} == rope then attention: V"), &v1, &v2, 0.0, 0.0);
            }
        }
    }
}

/// Verify rows padded to a row bucket with empty rows of the same query length (what a
/// replayed verify graph runs) against the same rows unpadded: the padded metadata's table
/// stride is a context bucket's, its extra rows have no context and no slot. The real rows'
/// outputs and the cache must be the same bits; the padding's outputs zeros.
#[test]
fn cuda_padded_verify_rows_equal_unpadded() {
    let Some((gpu, _checks)) = gpu("cuda_padded_verify_rows_equal_unpadded") else { return };
    let mut rng = rng("padded_verify");
    let cases: [(&[usize], usize, usize); 3] =
        [(&[37, 300, 1000], 5, 4), (&[17, 700], 17, 8), (&[2, 64, 65, 129, 2000], 2, 8)];
    for h in HEADS {
        let (nh, nkv, hd) = (h.nh, h.nkv, h.hd);
        for (p, amp) in variants(h) {
            for &(contexts, q, bucket) in &cases {
                let shapes: Vec<(usize, usize)> = contexts.iter().map(|&c| (c, q)).collect();
                let pool = contexts.iter().map(|c| c.div_ceil(BLOCK)).sum::<usize>() + 5;
                let batch = shuffled_batch(&mut rng, &shapes, pool, BLOCK);
                let pad = Padding { rows: bucket, query: q };
                let (tokens, padded) = (batch.num_tokens(), pad.tokens(&batch));
                assert_eq!(padded, bucket * q);
                let unpadded = AttentionMeta::upload(gpu, &batch, 0, BLOCK).unwrap();
                let stride = 2048 / BLOCK;
                let mut meta = AttentionMeta::with_capacity(gpu, bucket, padded, stride).unwrap();
                meta.update(gpu, &batch, 0, BLOCK, pad, Some(stride)).unwrap();
                assert_eq!((meta.rows, meta.tokens, meta.max_query), (bucket, padded, q));

                let fresh = random_cache(gpu, &mut rng, pool, nkv, hd);
                let (mut alone, mut padded_kv) = (fresh(), fresh());
                // New keys and values of every token, padding included ([k | v] per token).
                let width = nkv * hd;
                let (new_h, _) = rand_bf16(&mut rng, padded * 2 * width, 1.0);
                let new_d = gpu.upload(&new_h).unwrap();
                ops::write_kv(gpu, &new_d.slice(..), &new_d.slice(width..), 2 * width, &unpadded, &mut alone).unwrap();
                ops::write_kv(gpu, &new_d.slice(..), &new_d.slice(width..), 2 * width, &meta, &mut padded_kv).unwrap();
                let case = format!(
                    "{nh}/{nkv}x{hd} rows={} q={q} bucket={bucket} window={:?} softcap={:?}",
                    contexts.len(),
                    p.window,
                    p.softcap
                );
                let what = "padded verify";
                compare(what, &format!("{case}: K"), &pool_f32(gpu, &padded_kv.k), &pool_f32(gpu, &alone.k), 0.0, 0.0);
                compare(what, &format!("{case}: V"), &pool_f32(gpu, &padded_kv.v), &pool_f32(gpu, &alone.v), 0.0, 0.0);

                let (qh, _) = rand_bf16(&mut rng, padded * nh * hd, amp);
                let q_d = gpu.upload(&qh).unwrap();
                let mut scratch = DecodeScratch::new(gpu, bucket, nh, hd, 1).unwrap();
                let mut want = poisoned_bf16(gpu, tokens * nh * hd);
                ops::attention(gpu, &q_d, nh * hd, &unpadded, &alone, &p, None, &mut scratch, &mut want, nh * hd)
                    .unwrap();
                let mut got = poisoned_bf16(gpu, padded * nh * hd);
                ops::attention(gpu, &q_d, nh * hd, &meta, &padded_kv, &p, None, &mut scratch, &mut got, nh * hd)
                    .unwrap();
                let (got, want) = (to_f32(&gpu.download(&got).unwrap()), to_f32(&gpu.download(&want).unwrap()));
                let (real, extra) = got.split_at(tokens * nh * hd);
                compare(what, &format!("{case}: real rows"), real, &want, 0.0, 0.0);
                compare(what, &format!("{case}: padding rows"), extra, &vec![0.0; extra.len()], 0.0, 0.0);
            }
        }
    }
}
