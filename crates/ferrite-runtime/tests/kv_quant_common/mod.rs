//! Helpers of `cuda_kv_quant.rs`: quantized KV pools filled the same way on the device and
//! on the host, the values the kernels read back from them, and a reference e4m3 codec.
//!
//! int8 / int4 pools are filled by the CPU's quantizer (`QuantPool::write`) and their bytes
//! copied to the device, so both sides hold the same codes. fp8 pools are filled by the
//! reference codec below with chosen per-head scales. `dequantized` turns a device pool's
//! bytes back into f32 values exactly as each kernel reads them: decode in f32
//! (`code.mul_add(scale, bias)` for int8 / int4, the fused multiply-add the kernel does;
//! `e4m3(code) · scale` for fp8), prefill rounded to bf16 on top (its tensor-core tiles are
//! bf16).

#![allow(dead_code)]

use ferrite_runtime::cuda::ops::{DeviceKv, DevicePool};
use ferrite_runtime::cuda::Gpu;
use ferrite_runtime::kv::{KvDtype, KvLayerSpec, KvPool, LayerKv};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::Rng;

/// An e4m3 byte's value (0x7f / 0xff, NaN, never written, read as 480 like the kernel).
pub fn e4m3_decode(b: u8) -> f32 {
    let (e, m) = (i32::from((b >> 3) & 0xf), f32::from(b & 7));
    let mag = if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) };
    if b & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

/// `x` as e4m3: round to nearest, ties to an even code, saturating at ±448 (what the
/// device's `cvt.rn.satfinite.e4m3x2.f32` does).
pub fn e4m3_encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    let code = if a >= 448.0 {
        0x7e
    } else if a < 2f32.powi(-6) {
        // Subnormal: steps of 2^-9 (8 of them is the smallest normal, code 0x08).
        (a * 512.0).round_ties_even() as u8
    } else {
        let e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
        let m = ((a / 2f32.powi(e) - 1.0) * 8.0).round_ties_even() as i32;
        let (e, m) = if m == 8 { (e + 1, 0) } else { (e, m) };
        (((e + 7) << 3) | m).min(0x7e) as u8
    };
    sign | code
}

/// `e4m3_encode` by search over every finite code (slow; checks the fast one).
pub fn e4m3_encode_by_search(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    let mut best = 0u8;
    for c in 1..=0x7eu8 {
        let (d, db) = ((e4m3_decode(c) - a).abs(), (e4m3_decode(best) - a).abs());
        if d < db || (d == db && c % 2 == 0) {
            best = c;
        }
    }
    sign | best
}

/// The int8 / int4 formats (every group size dividing `hd`) and fp8.
pub fn formats(hd: usize) -> Vec<KvDtype> {
    let groups = [16, 32, 64, 128].into_iter().filter(|g| hd.is_multiple_of(*g));
    groups.flat_map(|group| [KvDtype::Int8 { group }, KvDtype::Int4 { group }]).chain([KvDtype::Fp8]).collect()
}

/// A device pool of `dtype` filled with random values, and for int8 / int4 the CPU's
/// quantized pools holding the same codes (the CPU kernels' reference).
pub struct Pools {
    pub dtype: KvDtype,
    pub dkv: DeviceKv,
    pub cpu: Option<LayerKv>,
    /// fp8: the scales the pools were written with (K heads, then V heads).
    pub scales: Vec<f32>,
}

/// `blocks` blocks of `block_size` of `spec`'s heads, every value random in (-1, 1) as bf16
/// (as a model's keys and values are), quantized.
pub fn filled(gpu: &Gpu, rng: &mut StdRng, dtype: KvDtype, spec: KvLayerSpec, blocks: usize, bs: usize) -> Pools {
    let (nkv, hd) = (spec.n_kv_heads, spec.head_dim);
    let n = blocks * bs * nkv * hd;
    let mut dkv = DeviceKv::with_dtype(gpu, blocks, bs, nkv, hd, dtype).expect("device pools");
    let values = |rng: &mut StdRng| -> Vec<f32> {
        (0..n).map(|_| bf16::from_f32(rng.random_range(-1.0..1.0)).to_f32()).collect()
    };
    let (kf, vf) = (values(rng), values(rng));
    match dtype {
        KvDtype::Fp8 => {
            // Scales of the size calibration gives values of |x| < 1 (1 · 8 / 448), varied.
            let scales: Vec<f32> = (0..2 * nkv).map(|_| rng.random_range(0.01..0.03f32)).collect();
            dkv.set_fp8_scales(gpu, &scales).expect("scales");
            for (sel, (pool, x)) in [(&mut dkv.k, &kf), (&mut dkv.v, &vf)].into_iter().enumerate() {
                let head_scale = |i: usize| scales[sel * nkv + (i / (bs * hd)) % nkv];
                let codes: Vec<u8> =
                    x.iter().enumerate().map(|(i, &v)| e4m3_encode(v * (1.0 / head_scale(i)))).collect();
                let block_scales: Vec<u8> =
                    (0..blocks * nkv).flat_map(|bh| scales[sel * nkv + bh % nkv].to_le_bytes()).collect();
                upload(gpu, pool, [&codes, &block_scales]);
            }
            Pools { dtype, dkv, cpu: None, scales }
        }
        _ => {
            let pool = |x: &[f32]| {
                let mut p = KvPool::zeroed(dtype, n);
                let KvPool::Quant(q) = &mut p else { panic!("{dtype} is not quantized") };
                assert!(q.write(0, x));
                p
            };
            let layer = LayerKv::new(spec, pool(&kf), pool(&vf));
            upload(gpu, &mut dkv.k, layer.k.raw_parts());
            upload(gpu, &mut dkv.v, layer.v.raw_parts());
            Pools { dtype, dkv, cpu: Some(layer), scales: Vec::new() }
        }
    }
}

/// Copy a pool's two regions (codes, parameters) to the device.
pub fn upload(gpu: &Gpu, pool: &mut DevicePool, [data, params]: [&[u8]; 2]) {
    gpu.upload_into(data, &mut pool.data).expect("upload codes");
    gpu.upload_into(params, pool.params.as_mut().expect("a quantized pool has parameters")).expect("upload params");
}

/// A device pool's two regions.
pub fn download(gpu: &Gpu, pool: &DevicePool) -> [Vec<u8>; 2] {
    let params = pool.params.as_ref().map_or(Vec::new(), |p| gpu.download(p).expect("download params"));
    [gpu.download(&pool.data).expect("download codes"), params]
}

/// The values of a device pool of `dtype` (`head_dim`, `n_kv_heads`, `bs` slots a block) as
/// the decode kernel reads them, or rounded to bf16 as the prefill kernel reads them.
pub fn values(
    gpu: &Gpu,
    pool: &DevicePool,
    dtype: KvDtype,
    shape: (usize, usize, usize),
    bf16_tiles: bool,
) -> Vec<f32> {
    let (nkv, hd, bs) = shape;
    let [codes, params] = download(gpu, pool);
    let f32s: Vec<f32> = match dtype {
        KvDtype::Fp8 => {
            let scale = |bh: usize| f32::from_le_bytes(params[4 * bh..4 * bh + 4].try_into().expect("4 bytes"));
            codes.iter().enumerate().map(|(i, &c)| e4m3_decode(c) * scale(i / (bs * hd))).collect()
        }
        KvDtype::Int8 { group } | KvDtype::Int4 { group } => {
            let n = if matches!(dtype, KvDtype::Int8 { .. }) { codes.len() } else { 2 * codes.len() };
            let h = |at: usize| f16::from_le_bytes([params[at], params[at + 1]]).to_f32();
            (0..n)
                .map(|i| {
                    let code = match dtype {
                        KvDtype::Int8 { .. } => codes[i],
                        _ => (codes[i / 2] >> (4 * (i % 2))) & 0xf,
                    };
                    let g = 4 * (i / group);
                    f32::from(code).mul_add(h(g), h(g + 2))
                })
                .collect()
        }
        _ => panic!("{dtype} is not a quantized format"),
    };
    debug_assert_eq!(f32s.len() % (nkv * hd), 0);
    if bf16_tiles {
        f32s.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
    } else {
        f32s
    }
}

/// f32 host pools of a device cache's values as `values` reads them.
pub fn reference_layer(gpu: &Gpu, p: &Pools, spec: KvLayerSpec, bs: usize, bf16_tiles: bool) -> LayerKv {
    let shape = (spec.n_kv_heads, spec.head_dim, bs);
    let k = values(gpu, &p.dkv.k, p.dtype, shape, bf16_tiles);
    let v = values(gpu, &p.dkv.v, p.dtype, shape, bf16_tiles);
    LayerKv::new(spec, KvPool::F32(k[..].into()), KvPool::F32(v[..].into()))
}
