//! CUDA attention over quantized KV caches (int8 / int4 group-affine, fp8 e4m3), gated on
//! `FERRITE_TEST_CUDA=1`.
//!
//! Each case fills a cache of shuffled 16-slot blocks with random quantized keys and values
//! (`kv_quant_common`: the CPU's quantizer for int8 / int4, so host and device hold the same
//! codes), writes the step's new keys and values on both sides and checks the device's bytes,
//! then compares attention outputs:
//!
//! - with "dequantize, then attend": the CPU's f32 attention over the values the kernel reads
//!   (the decode kernel dequantizes to f32; the prefill kernel into bf16 tiles, so its
//!   reference rounds them to bf16 too). Tolerance as `cuda_attention.rs`: the output is a
//!   convex combination of values |v| ≤ 1, rounded to bf16 once, P·V in bf16 in prefill:
//!   |gpu − cpu| ≤ 2^-8 + 2^-7·|cpu|.
//! - with the CPU's own quantized kernels (int8 / int4, reading the same codes in place): the
//!   decode kernel within the same tolerance (both dequantize in f32, the GPU with a fused
//!   multiply-add); the prefill kernel within 2^-6 + 2^-5·|cpu|: rounding K and V to bf16
//!   alone moves these outputs by at most 0.008 (measured on the CPU over these shapes, the
//!   soft-capped case with q up to ±8 the worst), on top of the tolerance above.
//!
//! Shapes: decode contexts 1..2048 (block edges 15/16/17, 511/513, 2047/2048) with the
//! automatic split and a forced 64-key partition, mixed prefill batches (cold, chunked,
//! decode rows, tile edges 64/65/130), GQA 9/3 × 64, 32/8 × 128, 16/8 × 256, 4/2 × 16,
//! 4/1 × 32, 8/2 × 512 and 12/2 × 128 (8-head decode CTAs); every group size dividing the
//! head dim, int8, int4 and fp8; plain, sliding window and soft cap.
//!
//! The write paths: `write_kv` against the CPU quantizer (int8 / int4: the same codes and
//! parameters, byte for byte; the device rounds as the CPU does, half away from zero) and
//! against the reference e4m3 codec (fp8: the same bytes; round to nearest even, saturating);
//! RoPE with the KV store and the decode kernel's own store against `write_kv` (the same
//! bytes); `convert_blocks` against `write_kv` of the same values; the fp8 calibration; block
//! copies through host memory in the host pools' byte order.

mod cuda_common;
mod kv_quant_common;

use cuda_common::attention::{params, shuffled_batch, variants, Heads};
use cuda_common::{compare, fail, gpu, poisoned_bf16, rand_bf16, rng, to_f32};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::cpu::{self, AttentionParams};
use ferrite_runtime::cuda::ops::{
    self, AttentionMeta, DecodePlan, DecodeScratch, DeviceKv, QkNorms, QkvHeads, RopeShape,
};
use ferrite_runtime::cuda::Gpu;
use ferrite_runtime::kv::{KvDtype, KvLayerSpec};
use ferrite_runtime::{BlockMove, ForwardBatch, KvCache, KvGroupKind, KvLayout, KvScheme, Padding};
use kv_quant_common::{download, e4m3_encode, e4m3_encode_by_search, filled, formats, reference_layer, Pools};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BLOCK: usize = 16;
const ATOL: f32 = 1.0 / 256.0;
const RTOL: f32 = 1.0 / 128.0;
/// Prefill against the CPU's quantized kernels (see the module docs).
const LOOSE: (f32, f32) = (1.0 / 64.0, 1.0 / 32.0);

const HEADS: [Heads; 7] = [
    Heads { nh: 9, nkv: 3, hd: 64 },
    Heads { nh: 32, nkv: 8, hd: 128 },
    Heads { nh: 16, nkv: 8, hd: 256 },
    Heads { nh: 4, nkv: 2, hd: 16 },
    Heads { nh: 4, nkv: 1, hd: 32 },
    Heads { nh: 8, nkv: 2, hd: 512 },
    Heads { nh: 12, nkv: 2, hd: 128 },
];

fn pool_blocks(shapes: &[(usize, usize)]) -> usize {
    shapes.iter().map(|&(ctx, _)| ctx.div_ceil(BLOCK)).sum::<usize>() + 5
}

/// The fp8 codes `write_kv` stores for the step's new rows (`[tokens, nkv · hd]` keys or
/// values) into `codes` (a pool's code region) and the (block, head) scales into `params`.
fn expect_fp8_write(
    [codes, params]: &mut [Vec<u8>; 2],
    new: &[f32],
    batch: &ForwardBatch,
    (nkv, hd): (usize, usize),
    scales: &[f32],
) {
    for row in &batch.rows {
        for t in row.query_start..row.query_start + row.query_len {
            let pos = batch.positions[t] as usize;
            let block = row.block_tables[0][pos / BLOCK] as usize;
            for h in 0..nkv {
                let at = ((block * nkv + h) * BLOCK + pos % BLOCK) * hd;
                let inv = 1.0 / scales[h];
                for d in 0..hd {
                    codes[at + d] = e4m3_encode(new[t * nkv * hd + h * hd + d] * inv);
                }
                params[4 * (block * nkv + h)..][..4].copy_from_slice(&scales[h].to_le_bytes());
            }
        }
    }
}

/// Write the step's new keys and values into `p` on the device (and into its CPU pools),
/// and check the device's bytes against the CPU quantizer or the e4m3 codec.
fn write_step(gpu: &Gpu, rng: &mut StdRng, p: &mut Pools, batch: &ForwardBatch, meta: &AttentionMeta, case: &str) {
    let (nkv, hd) = (p.dkv.n_kv_heads, p.dkv.head_dim);
    let (tokens, width) = (batch.num_tokens(), nkv * hd);
    // Interleaved per token as [k | v] (a strided view, like fused QKV).
    let (new_h, new_f) = rand_bf16(rng, tokens * 2 * width, 1.0);
    let new_k: Vec<f32> = new_f.chunks(2 * width).flat_map(|r| r[..width].to_vec()).collect();
    let new_v: Vec<f32> = new_f.chunks(2 * width).flat_map(|r| r[width..].to_vec()).collect();
    let before = [download(gpu, &p.dkv.k), download(gpu, &p.dkv.v)];
    let new_d = gpu.upload(&new_h).unwrap();
    ops::write_kv(gpu, &new_d.slice(..), &new_d.slice(width..), 2 * width, meta, &mut p.dkv).unwrap();
    let got = [download(gpu, &p.dkv.k), download(gpu, &p.dkv.v)];
    let want: [[Vec<u8>; 2]; 2] = match &mut p.cpu {
        Some(layer) => {
            cpu::write_kv(&new_k, &new_v, batch, layer, BLOCK).unwrap();
            [layer.k.raw_parts().map(<[u8]>::to_vec), layer.v.raw_parts().map(<[u8]>::to_vec)]
        }
        None => {
            let mut want = before;
            for (sel, new) in [&new_k, &new_v].into_iter().enumerate() {
                expect_fp8_write(&mut want[sel], new, batch, (nkv, hd), &p.scales[sel * nkv..(sel + 1) * nkv]);
            }
            want
        }
    };
    for (sel, name) in ["K", "V"].iter().enumerate() {
        for (part, region) in ["codes", "params"].iter().enumerate() {
            let (g, w) = (&got[sel][part], &want[sel][part]);
            if let Some(i) = (0..g.len().max(w.len())).find(|&i| g.get(i) != w.get(i)) {
                fail(format!("write_kv {case} {name} {region}: byte {i} is {:?}, want {:?}", g.get(i), w.get(i)));
            }
        }
    }
    println!("TABLE|write_kv|{case}|bytes|{}", if got == want { "ok" } else { "FAIL" });
}

#[allow(clippy::too_many_arguments)]
fn run_case(
    gpu: &Gpu,
    rng: &mut StdRng,
    dtype: KvDtype,
    h: Heads,
    shapes: &[(usize, usize)],
    p: AttentionParams,
    q_amp: f32,
    partition: Option<usize>,
) {
    let (nh, nkv, hd) = (h.nh, h.nkv, h.hd);
    let pool = pool_blocks(shapes);
    let batch = shuffled_batch(rng, shapes, pool, BLOCK);
    let spec = KvLayerSpec { n_kv_heads: nkv, head_dim: hd, group: 0 };
    let mut pools = filled(gpu, rng, dtype, spec, pool, BLOCK);
    let meta = AttentionMeta::upload(gpu, &batch, 0, BLOCK).unwrap();
    let tokens = batch.num_tokens();
    let case = format!("{dtype} {nh}/{nkv}x{hd} rows={} tokens={tokens}", shapes.len());
    write_step(gpu, rng, &mut pools, &batch, &meta, &case);

    let decode = meta.max_query == 1;
    let plan = match partition {
        None => DecodePlan::new(gpu, meta.rows, &p, meta.max_context),
        Some(partition) => {
            let visible = p.window.map_or(meta.max_context, |w| w.min(meta.max_context));
            DecodePlan { partition, splits: visible.div_ceil(partition) }
        }
    };
    let (qh, qf) = rand_bf16(rng, tokens * nh * hd, q_amp);
    let mut scratch = DecodeScratch::new(gpu, meta.rows, nh, hd, plan.splits).unwrap();
    let mut out = poisoned_bf16(gpu, tokens * nh * hd);
    let q_d = gpu.upload(&qh).unwrap();
    ops::attention(gpu, &q_d, nh * hd, &meta, &pools.dkv, &p, Some(plan), &mut scratch, &mut out, nh * hd).unwrap();
    let got = to_f32(&gpu.download(&out).unwrap());
    let kernel =
        if decode { format!("decode splits={} partition={}", plan.splits, plan.partition) } else { "prefill".into() };
    let what = format!("{case} {kernel} window={:?} softcap={:?}", p.window, p.softcap);

    let reference = reference_layer(gpu, &pools, spec, BLOCK, !decode);
    let mut want = vec![0f32; qf.len()];
    cpu::paged_attention(&qf, &batch, &reference, BLOCK, &p, &mut want).unwrap();
    compare("dequantize-then-attend", &what, &got, &want, ATOL, RTOL);
    if let Some(layer) = &pools.cpu {
        cpu::paged_attention(&qf, &batch, layer, BLOCK, &p, &mut want).unwrap();
        let (atol, rtol) = if decode { (ATOL, RTOL) } else { LOOSE };
        compare("cpu-quantized", &what, &got, &want, atol, rtol);
    }
}

/// The formats one variant runs: every format for the plain case, one int8, one int4 and
/// fp8 for the others (every group size is covered by the plain case).
fn formats_for(hd: usize, plain: bool) -> Vec<KvDtype> {
    let all = formats(hd);
    if plain {
        return all;
    }
    let g = if hd >= 64 { 64 } else { 16 };
    all.into_iter()
        .filter(|d| matches!(d, KvDtype::Int8 { group } | KvDtype::Int4 { group } if *group == g) || *d == KvDtype::Fp8)
        .collect()
}

#[test]
fn e4m3_reference_codec_rounds_to_nearest_even() {
    let mut rng = rng("e4m3");
    for _ in 0..20_000 {
        let x = rng.random_range(-500.0..500.0f32) * 2f32.powi(rng.random_range(-12..1));
        assert_eq!(e4m3_encode(x), e4m3_encode_by_search(x), "{x}");
    }
    assert_eq!((e4m3_encode(1e6), e4m3_encode(-1e6)), (0x7e, 0xfe), "saturates");
    assert_eq!(kv_quant_common::e4m3_decode(0x7e), 448.0);
}

#[test]
fn cuda_quantized_decode_attention_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_quantized_decode_attention_matches_cpu") else { return };
    let mut rng = rng("quant_decode");
    let rows: Vec<(usize, usize)> = [1, 15, 16, 17, 100, 511, 513, 1000, 2047, 2048].iter().map(|&c| (c, 1)).collect();
    for h in HEADS {
        for (i, (p, amp)) in variants(h).into_iter().enumerate() {
            for dtype in formats_for(h.hd, i == 0) {
                run_case(gpu, &mut rng, dtype, h, &rows, p, amp, None);
                if i == 0 {
                    run_case(gpu, &mut rng, dtype, h, &rows, p, amp, Some(64));
                }
            }
        }
    }
}

#[test]
fn cuda_quantized_prefill_attention_matches_cpu() {
    let Some((gpu, _checks)) = gpu("cuda_quantized_prefill_attention_matches_cpu") else { return };
    let mut rng = rng("quant_prefill");
    let mixed = [(300, 1), (37, 5), (100, 40), (1, 1), (250, 17), (1000, 150), (130, 130), (64, 64), (65, 65)];
    for h in HEADS {
        for (i, (p, amp)) in variants(h).into_iter().enumerate() {
            for dtype in formats_for(h.hd, i == 0) {
                run_case(gpu, &mut rng, dtype, h, &mixed, p, amp, None);
            }
        }
    }
}

/// A fused QKV buffer of decode rows (contexts `contexts`, one padding row after them), its
/// metadata, RoPE frequencies and positions.
struct RopeStep {
    meta: AttentionMeta,
    qkv: Vec<half::bf16>,
    inv_freq: Vec<f32>,
    positions: Vec<u32>,
}

fn rope_step(gpu: &Gpu, rng: &mut StdRng, h: Heads, contexts: &[usize], rotary: usize, pool: usize) -> RopeStep {
    let shapes: Vec<(usize, usize)> = contexts.iter().map(|&c| (c, 1)).collect();
    let batch = shuffled_batch(rng, &shapes, pool, BLOCK);
    let rows = contexts.len() + 1;
    let mut meta = AttentionMeta::with_capacity(gpu, rows, rows, 4096 / BLOCK).unwrap();
    meta.update(gpu, &batch, 0, BLOCK, Padding { rows, query: 1 }, None).unwrap();
    let width = (h.nh + 2 * h.nkv) * h.hd;
    let (qkv, _) = rand_bf16(rng, rows * width, 1.0);
    let inv_freq = (0..rotary / 2).map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / rotary as f32)).collect();
    let mut positions = batch.positions.clone();
    positions.push(0);
    RopeStep { meta, qkv, inv_freq, positions }
}

/// The decode kernel that rotates and stores the new keys itself (with and without per-head
/// q/k norms), and RoPE with the KV store, against (q/k norms,) RoPE, then `write_kv`, then
/// attention: the same cache bytes and the same outputs.
#[test]
fn cuda_quantized_kv_stores_agree() {
    let Some((gpu, _checks)) = gpu("cuda_quantized_kv_stores_agree") else { return };
    let mut rng = rng("quant_stores");
    let contexts = [1usize, 17, 100, 513, 2000];
    for (h, rotary) in [(HEADS[0], 64), (HEADS[1], 128), (HEADS[2], 256), (HEADS[1], 32), (HEADS[5], 128)] {
        let (nh, nkv, hd) = (h.nh, h.nkv, h.hd);
        let width = (nh + 2 * nkv) * hd;
        let pool = contexts.iter().map(|c| c.div_ceil(BLOCK)).sum::<usize>() + 3;
        let spec = KvLayerSpec { n_kv_heads: nkv, head_dim: hd, group: 0 };
        for dtype in formats_for(hd, false) {
            let s = rope_step(gpu, &mut rng, h, &contexts, rotary, pool);
            let rows = contexts.len() + 1;
            let p = params(h, None, None);
            let scaling = 1.1f32;
            let (f_d, pos_d) = (gpu.upload(&s.inv_freq).unwrap(), gpu.upload(&s.positions).unwrap());
            let plan = DecodePlan::new(gpu, rows, &p, 2048);
            let mut scratch = DecodeScratch::new(gpu, rows, nh, hd, plan.splits).unwrap();
            let seed: u64 = rng.random();
            let fresh = |gpu: &Gpu| filled(gpu, &mut StdRng::seed_from_u64(seed), dtype, spec, pool, BLOCK);
            let shape = RopeShape { tokens: rows, n_heads: nh + nkv, head_dim: hd, stride: width };
            let mut weights =
                || gpu.upload(&(0..hd).map(|_| rng.random_range(0.5f32..1.5)).collect::<Vec<_>>()).unwrap();
            let (wq_d, wk_d) = (weights(), weights());
            let heads = QkvHeads { tokens: rows, stride: width, head_dim: hd, n_q: nh, n_k: nkv, n_v: 0 };
            // Per-head q/k norms first (Qwen3): qkv_norm in the separate paths, folded into the
            // decode kernel (an fp8 pool: its own qkv_norm launch).
            for normed in [false, true] {
                let case = format!("{dtype} {nh}/{nkv}x{hd} rot={rotary} normed={normed}");
                let qkv_of = |gpu: &Gpu| {
                    let mut x = gpu.upload(&s.qkv).unwrap();
                    if normed {
                        ops::qkv_norm(gpu, &mut x, heads, Some(&wq_d), Some(&wk_d), 1e-6).unwrap();
                    }
                    x
                };

                // RoPE, then write_kv of the rotated rows, then attention.
                let (mut apart, mut qkv_a) = (fresh(gpu), qkv_of(gpu));
                ops::rope(gpu, &mut qkv_a, &pos_d, &f_d, scaling, shape, None).unwrap();
                let (k_rows, v_rows) = (qkv_a.slice(nh * hd..), qkv_a.slice((nh + nkv) * hd..));
                ops::write_kv(gpu, &k_rows, &v_rows, width, &s.meta, &mut apart.dkv).unwrap();
                let mut want = poisoned_bf16(gpu, rows * nh * hd);
                ops::attention(
                    gpu,
                    &qkv_a,
                    width,
                    &s.meta,
                    &apart.dkv,
                    &p,
                    Some(plan),
                    &mut scratch,
                    &mut want,
                    nh * hd,
                )
                .unwrap();
                let want_bytes = [download(gpu, &apart.dkv.k), download(gpu, &apart.dkv.v)];

                // RoPE storing K and V (one call).
                let (mut fused, mut qkv_f) = (fresh(gpu), qkv_of(gpu));
                ops::rope(gpu, &mut qkv_f, &pos_d, &f_d, scaling, shape, Some((&s.meta, &mut fused.dkv))).unwrap();
                let got_bytes = [download(gpu, &fused.dkv.k), download(gpu, &fused.dkv.v)];
                let same = got_bytes == want_bytes;
                println!("TABLE|rope+kv|{case} == rope, write_kv|bytes|{}", if same { "ok" } else { "FAIL" });
                if !same {
                    fail(format!("rope+kv {case}: cache bytes differ from rope then write_kv"));
                }

                // The decode kernel rotating and storing by itself.
                let (mut one, mut qkv_o) = (fresh(gpu), gpu.upload(&s.qkv).unwrap());
                let norms = normed.then_some(QkNorms { q: &wq_d, k: &wk_d, eps: 1e-6 });
                let mut got = poisoned_bf16(gpu, rows * nh * hd);
                let rope = (&f_d, scaling);
                ops::decode_attention_rope(
                    gpu,
                    &mut qkv_o,
                    width,
                    &s.meta,
                    &mut one.dkv,
                    &p,
                    rope,
                    norms,
                    plan,
                    &mut scratch,
                    &mut got,
                    nh * hd,
                )
                .unwrap();
                let got_bytes = [download(gpu, &one.dkv.k), download(gpu, &one.dkv.v)];
                let same = got_bytes == want_bytes;
                println!("TABLE|decode+rope|{case} == rope, write_kv|bytes|{}", if same { "ok" } else { "FAIL" });
                if !same {
                    fail(format!("decode+rope {case}: cache bytes differ from rope then write_kv"));
                }
                let (got, want) = (to_f32(&gpu.download(&got).unwrap()), to_f32(&gpu.download(&want).unwrap()));
                compare("decode+rope", &format!("{case} == rope, write_kv, attention: out"), &got, &want, 0.0, 0.0);
            }
        }
    }
}

/// `convert_blocks` quantizes bf16 blocks as `write_kv` of the same values does, and an fp8
/// pool calibrates from them.
#[test]
fn cuda_convert_blocks_equals_write() {
    let Some((gpu, _checks)) = gpu("cuda_convert_blocks_equals_write") else { return };
    let mut rng = rng("convert_blocks");
    for h in [HEADS[0], HEADS[1], HEADS[3], HEADS[5]] {
        let (nkv, hd) = (h.nkv, h.hd);
        let (blocks, width) = (9, nkv * hd);
        for dtype in formats(hd) {
            // Rows of 3 blocks' worth of tokens each into blocks 0..3 of a bf16 pool and, by
            // write_kv, blocks 5, 3, 7 of a quantized one.
            let mut src = DeviceKv::new(gpu, blocks, BLOCK, nkv, hd).unwrap();
            let mut direct = DeviceKv::with_dtype(gpu, blocks, BLOCK, nkv, hd, dtype).unwrap();
            let tokens = 3 * BLOCK;
            let (new_h, _) = rand_bf16(&mut rng, tokens * 2 * width, 1.0);
            let new_d = gpu.upload(&new_h).unwrap();
            let (k_rows, v_rows) = (new_d.slice(..), new_d.slice(width..));
            for (dst, table) in [(&mut src, vec![0u32, 1, 2]), (&mut direct, vec![5, 3, 7])] {
                let mut batch = ForwardBatch::default();
                batch.push_row(&vec![0; tokens], tokens, vec![table], RowLogits::None);
                let meta = AttentionMeta::upload(gpu, &batch, 0, BLOCK).unwrap();
                ops::write_kv(gpu, &k_rows, &v_rows, 2 * width, &meta, dst).unwrap();
            }
            let mut converted = DeviceKv::with_dtype(gpu, blocks, BLOCK, nkv, hd, dtype).unwrap();
            ops::convert_blocks(gpu, &src, &mut converted, &[(0, 5), (1, 3), (2, 7)]).unwrap();
            let case = format!("{dtype} {nkv}x{hd}");
            if dtype == KvDtype::Fp8 {
                // Both calibrated from the same values: the same scales.
                let (a, b) = (
                    gpu.download(direct.fp8_scales().unwrap()).unwrap(),
                    gpu.download(converted.fp8_scales().unwrap()).unwrap(),
                );
                compare("convert_blocks", &format!("{case} fp8 scales"), &a, &b, 0.0, 0.0);
            }
            let same = [download(gpu, &converted.k), download(gpu, &converted.v)]
                == [download(gpu, &direct.k), download(gpu, &direct.v)];
            println!("TABLE|convert_blocks|{case} == write_kv|bytes|{}", if same { "ok" } else { "FAIL" });
            if !same {
                fail(format!("convert_blocks {case}: bytes differ from write_kv of the same values"));
            }
        }
    }
}

/// The first write into an fp8 pool sets each head's scale to its largest magnitude × 8 /
/// 448 (later writes keep it), and a value beyond 448 × scale saturates.
#[test]
fn cuda_fp8_calibrates_once_and_saturates() {
    let Some((gpu, _checks)) = gpu("cuda_fp8_calibrates_once_and_saturates") else { return };
    let mut rng = rng("fp8_calibration");
    let (nkv, hd, tokens) = (4, 64, 20);
    let width = nkv * hd;
    let mut kv = DeviceKv::with_dtype(gpu, 4, BLOCK, nkv, hd, KvDtype::Fp8).unwrap();
    let step = |tokens: usize, first: u32| {
        let mut batch = ForwardBatch::default();
        batch.push_row(&vec![0; tokens], first as usize + tokens, vec![vec![0, 1, 2, 3]], RowLogits::None);
        batch
    };
    // Head h's values within ±(h + 1).
    let amp = |i: usize| ((i % width) / hd + 1) as f32;
    let first: Vec<half::bf16> =
        (0..tokens * width).map(|i| half::bf16::from_f32(rng.random_range(-1.0..1.0) * amp(i))).collect();
    let d = gpu.upload(&first).unwrap();
    let meta = AttentionMeta::upload(gpu, &step(tokens, 0), 0, BLOCK).unwrap();
    ops::write_kv(gpu, &d, &d, width, &meta, &mut kv).unwrap();
    let scales = gpu.download(kv.fp8_scales().unwrap()).unwrap();
    let want: Vec<f32> = (0..2 * nkv)
        .map(|i| {
            let h = i % nkv;
            let m = first
                .chunks(width)
                .map(|t| t[h * hd..(h + 1) * hd].iter().map(|x| x.to_f32().abs()).fold(0f32, f32::max))
                .fold(0f32, f32::max);
            m * (8.0 / 448.0)
        })
        .collect();
    compare("fp8 calibration", "scales = amax * 8 / 448", &scales, &want, 0.0, 1e-6);
    // A second write, 100x larger: the scales stay, the codes saturate at ±448.
    let big: Vec<half::bf16> = first.iter().map(|x| half::bf16::from_f32(x.to_f32() * 100.0)).collect();
    let d = gpu.upload(&big).unwrap();
    let meta = AttentionMeta::upload(gpu, &step(tokens, tokens as u32), 0, BLOCK).unwrap();
    ops::write_kv(gpu, &d, &d, width, &meta, &mut kv).unwrap();
    let again = gpu.download(kv.fp8_scales().unwrap()).unwrap();
    compare("fp8 calibration", "scales fixed after the first write", &again, &scales, 0.0, 0.0);
    let spec = KvLayerSpec { n_kv_heads: nkv, head_dim: hd, group: 0 };
    let pools = Pools { dtype: KvDtype::Fp8, dkv: kv, cpu: None, scales };
    let layer = reference_layer(gpu, &pools, spec, BLOCK, false);
    let k = layer.k.to_f32();
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for t in tokens..2 * tokens {
        for (i, x) in big[(t - tokens) * width..][..width].iter().enumerate() {
            let (h, d) = (i / hd, i % hd);
            let at = layer.offset(BLOCK, t / BLOCK, h, t % BLOCK) + d;
            let limit = 448.0 * pools.scales[h];
            got.push(k[at]);
            want.push(x.to_f32().clamp(-limit, limit));
        }
    }
    // Within e4m3's half step (2^-4 relative) of the value clamped to ±448 · scale.
    compare("fp8 calibration", "saturated second write", &got, &want, 1e-4, 1.0 / 16.0);
}

/// A quantized device cache's blocks copy to host memory in the host pools' byte order: the
/// same bytes as a host cache of that format written with the same values, and back.
#[test]
fn cuda_quantized_blocks_copy_like_host_blocks() {
    let Some((gpu, _checks)) = gpu("cuda_quantized_blocks_copy_like_host_blocks") else { return };
    let mut rng = rng("quant_blocks");
    let layout = KvLayout {
        groups: vec![KvGroupKind::Full, KvGroupKind::Sliding { window: 32 }],
        layers: vec![
            KvLayerSpec { n_kv_heads: 2, head_dim: 64, group: 0 },
            KvLayerSpec { n_kv_heads: 4, head_dim: 32, group: 1 },
            KvLayerSpec { n_kv_heads: 2, head_dim: 64, group: 0 },
        ],
        states: Vec::new(),
    };
    let blocks = [6, 6];
    for dtype in [KvDtype::Int8 { group: 32 }, KvDtype::Int4 { group: 16 }] {
        // Layer 1 (sliding) stays full precision: bf16 on the device, f16 on the host; the
        // comparison covers the quantized layers' bytes.
        let scheme = KvScheme { dtype, skip: "sliding".parse().unwrap() };
        let mut dev = KvCache::on_device_with_scheme(gpu, &layout, &blocks, BLOCK, &scheme).unwrap();
        let mut host = KvCache::with_scheme(&layout, &blocks, BLOCK, &scheme).unwrap();
        let mut batch = ForwardBatch::default();
        batch.push_row(&[0; 2 * BLOCK], 2 * BLOCK, vec![vec![4, 1], vec![2, 5]], RowLogits::None);
        for (i, spec) in layout.layers.iter().enumerate() {
            let width = spec.n_kv_heads * spec.head_dim;
            let (kh, kf) = rand_bf16(&mut rng, 2 * BLOCK * width, 1.0);
            let (vh, vf) = rand_bf16(&mut rng, 2 * BLOCK * width, 1.0);
            let meta = AttentionMeta::upload(gpu, &batch, spec.group, BLOCK).unwrap();
            let (kd, vd) = (gpu.upload(&kh).unwrap(), gpu.upload(&vh).unwrap());
            ops::write_kv(gpu, &kd, &vd, width, &meta, dev.device_layer_mut(i).unwrap()).unwrap();
            cpu::write_kv(&kf, &vf, &batch, host.layer_mut(i).unwrap(), BLOCK).unwrap();
        }
        let (mut dev_blocks, mut host_blocks) = (dev.host_blocks(2).unwrap(), host.host_blocks(2).unwrap());
        assert_eq!(dev.block_bytes(), host.block_bytes(), "{dtype}: a block's bytes");
        for (group, block) in [(0, 4), (0, 1)] {
            let to_slot = |slot| [BlockMove { group, block, slot }];
            dev.save_blocks(&to_slot(0), &mut dev_blocks).unwrap();
            host.save_blocks(&to_slot(0), &mut host_blocks).unwrap();
            let at = dev.group_offset(group);
            let n = dev.group_block_bytes(group);
            let same = dev_blocks.bytes(0).unwrap()[at..at + n] == host_blocks.bytes(0).unwrap()[at..at + n];
            println!(
                "TABLE|block copy|{dtype} group {group} block {block}: device == host bytes||{}",
                if same { "ok" } else { "FAIL" }
            );
            if !same {
                fail(format!("block copy {dtype}: device block {block} of group {group} differs from the host's"));
            }
            // Back into another block of the device cache: the same bytes there.
            dev.load_blocks(&[BlockMove { group, block: 0, slot: 0 }], &dev_blocks).unwrap();
            dev.fence().unwrap();
            dev.save_blocks(&[BlockMove { group, block: 0, slot: 1 }], &mut dev_blocks).unwrap();
            let back = dev_blocks.bytes(1).unwrap()[at..at + n] == host_blocks.bytes(0).unwrap()[at..at + n];
            if !back {
                fail(format!("block copy {dtype}: block {block} of group {group} did not survive a round trip"));
            }
        }
    }
}
