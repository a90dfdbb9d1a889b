//! A layer's KV pools on the device and the writes into them: bf16, or int8 / int4
//! group-affine and fp8 e4m3 codes read in place by the attention kernels (`kv_format.cuh`).
//!
//! A pool holds `[block][kv_head][slot][head_dim]` values in two regions, as a host pool
//! (`kv_quant`) does, so a block's bytes copy between the tiers the same way:
//!
//! - bf16: the values; no parameters.
//! - int8 / int4: the codes (one byte a value; two a byte, value `2j` in the low nibble of
//!   byte `j`) and per group of G values of a token's head an f16 `(scale, bias)`, quantized
//!   on write exactly as the CPU quantizes (the same codes from the same values).
//! - fp8: e4m3 codes, and per (block, KV head) the f32 scale they were written with. Writes
//!   use the layer's scale of each head (`fp8_scales`): a checkpoint's, set with
//!   `set_fp8_scales`, or else calibrated by the first write into the pool — the largest
//!   magnitude of the step's keys (values) of that head, with 8× headroom (it maps to 56 of
//!   e4m3's 448) — and fixed from then on. A value beyond 448 × scale saturates to ±448 ×
//!   scale. Each block carries the scale of each of its heads, so a block restored from the
//!   SSD tier written by another process (another calibration) still reads right.
//!
//! Every write path quantizes the same bf16 values: `write_kv`, RoPE with the KV store (a
//! quantized cache is stored by `write_kv` after the rotation) and the decode attention kernel
//! that stores the new key and value itself. `convert_blocks` quantizes whole bf16 blocks into
//! a quantized pool (a row turning quantized after a full-precision start).

use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;

use crate::cuda::context::{cfg, Gpu};
use crate::cuda::error::{CudaError, CudaResult};
use crate::cuda::ops::attention::AttentionMeta;
use crate::kv::KvDtype;
use crate::kv_quant::KV_GROUP_SIZES;

/// One device pool (K or V of a layer).
pub struct DevicePool {
    /// bf16 values, or a quantized pool's codes.
    pub data: CudaSlice<u8>,
    /// int8 / int4: an f16 `(scale, bias)` per group; fp8: an f32 scale per (block, KV
    /// head); none for bf16.
    pub params: Option<CudaSlice<u8>>,
}

impl DevicePool {
    /// The two regions, in a block's byte order.
    pub(crate) fn parts(&self) -> [Option<&CudaSlice<u8>>; 2] {
        [Some(&self.data), self.params.as_ref()]
    }
}

/// One layer's paged K and V pools on the device.
pub struct DeviceKv {
    pub k: DevicePool,
    pub v: DevicePool,
    /// What the pools hold (`KvDtype::F16`: bf16).
    pub dtype: KvDtype,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// fp8: the scales writes use, K heads then V heads (0 until calibrated or set).
    fp8_scales: Option<CudaSlice<f32>>,
    /// fp8: whether the scales are set (the host's view; the first write calibrates them).
    calibrated: bool,
}

/// The kernels' view of a cache: codes, parameters, log2 of the group size, fp8 scales.
pub(crate) struct KvArgs {
    pub k: u64,
    pub v: u64,
    pub k_params: u64,
    pub v_params: u64,
    pub shift: i32,
    pub fp8_scales: u64,
}

impl DeviceKv {
    /// Zeroed bf16 pools of `num_blocks` blocks of `block_size` positions.
    pub fn new(
        gpu: &Gpu,
        num_blocks: usize,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> CudaResult<DeviceKv> {
        DeviceKv::with_dtype(gpu, num_blocks, block_size, n_kv_heads, head_dim, KvDtype::F16)
    }

    /// Zeroed pools holding `dtype` (`F16`: bf16; int8, int4 or fp8); an error for f32 or a
    /// group size the head dim does not take.
    pub fn with_dtype(
        gpu: &Gpu,
        num_blocks: usize,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> CudaResult<DeviceKv> {
        let shape = KvShape { dtype, n_kv_heads, head_dim, block_size };
        shape.check()?;
        let [data, params] = shape.block_parts().map(|n| n * num_blocks);
        let pool = || -> CudaResult<DevicePool> {
            Ok(DevicePool { data: gpu.alloc(data)?, params: if params > 0 { Some(gpu.alloc(params)?) } else { None } })
        };
        let fp8_scales = if dtype == KvDtype::Fp8 { Some(gpu.alloc(2 * n_kv_heads)?) } else { None };
        Ok(DeviceKv {
            k: pool()?,
            v: pool()?,
            dtype,
            n_kv_heads,
            head_dim,
            block_size,
            num_blocks,
            fp8_scales,
            calibrated: false,
        })
    }

    fn shape(&self) -> KvShape {
        KvShape { dtype: self.dtype, n_kv_heads: self.n_kv_heads, head_dim: self.head_dim, block_size: self.block_size }
    }

    /// The kernels' format index (`functions::KV_FORMATS`): bf16, int8, int4, fp8.
    pub(crate) fn format(&self) -> usize {
        match self.dtype {
            KvDtype::Int8 { .. } => 1,
            KvDtype::Int4 { .. } => 2,
            KvDtype::Fp8 => 3,
            KvDtype::F16 | KvDtype::F32 => 0,
        }
    }

    /// Bytes one block of one pool (K or V) takes, both regions.
    pub fn block_bytes(&self) -> usize {
        self.shape().block_parts().iter().sum()
    }

    /// Bytes of one block in each region of a pool: (values or codes, parameters).
    pub(crate) fn block_part_bytes(&self) -> [usize; 2] {
        self.shape().block_parts()
    }

    /// Whether both pools hold `num_blocks` blocks of this shape.
    pub(crate) fn sized(&self) -> bool {
        let [data, params] = self.shape().block_parts().map(|n| n * self.num_blocks);
        [&self.k, &self.v].iter().all(|p| p.data.len() >= data && p.params.as_ref().map_or(0, |p| p.len()) >= params)
    }

    pub(crate) fn args(&self, gpu: &Gpu) -> KvArgs {
        let opt = |p: &Option<CudaSlice<u8>>| p.as_ref().map_or(0, |p| gpu.ptr(p));
        KvArgs {
            k: gpu.ptr(&self.k.data),
            v: gpu.ptr(&self.v.data),
            k_params: opt(&self.k.params),
            v_params: opt(&self.v.params),
            shift: self.dtype.quantized().map_or(0, |(_, g)| g.trailing_zeros() as i32),
            fp8_scales: self.fp8_scales.as_ref().map_or(0, |s| gpu.ptr(s)),
        }
    }

    /// Set an fp8 cache's scales (K heads, then V heads), e.g. a checkpoint's; the first write
    /// then calibrates nothing.
    pub fn set_fp8_scales(&mut self, gpu: &Gpu, scales: &[f32]) -> CudaResult<()> {
        let n = 2 * self.n_kv_heads;
        let ok = |s: &f32| s.is_finite() && (2f32.powi(-20)..=128.0).contains(s);
        match &mut self.fp8_scales {
            Some(dst) if scales.len() == n && scales.iter().all(ok) => {
                gpu.upload_into(scales, dst)?;
                self.calibrated = true;
                Ok(())
            }
            _ => Err(CudaError::Shape(format!(
                "fp8 scales: {} given for a {} cache of {} KV heads (2^-20..=128 each)",
                scales.len(),
                self.dtype,
                self.n_kv_heads
            ))),
        }
    }

    /// An fp8 cache's scales (K heads, then V heads; zeros before the first write).
    pub fn fp8_scales(&self) -> Option<&CudaSlice<f32>> {
        self.fp8_scales.as_ref()
    }

    /// Calibrate an fp8 cache's scales from the step's keys and values about to be stored
    /// (rows of `kv_stride` bf16 at device addresses `kp` and `vp`; keys times `k_factor`),
    /// if this is the first write. Nothing for other formats.
    pub(crate) fn calibrate(
        &mut self,
        gpu: &Gpu,
        (kp, vp): (u64, u64),
        kv_stride: usize,
        meta: &AttentionMeta,
        k_factor: f32,
    ) -> CudaResult<()> {
        let Some(scales) = self.fp8_scales.as_mut().filter(|_| !self.calibrated) else { return Ok(()) };
        let sp = gpu.ptr(&meta.slots().0);
        let scp = gpu.ptr_mut(scales);
        let [st, t, nkv, hd] = [kv_stride, meta.tokens, self.n_kv_heads, self.head_dim].map(|x| x as i32);
        let grid = (2 * self.n_kv_heads) as u32;
        gpu.launch(
            &gpu.fns.fp8_calibrate,
            cfg((grid, 1, 1), 256, 0),
            &[&kp, &vp, &st, &sp, &t, &nkv, &hd, &k_factor, &scp],
        )?;
        self.calibrated = true;
        Ok(())
    }
}

/// A pool's shape, for sizes.
#[derive(Clone, Copy)]
struct KvShape {
    dtype: KvDtype,
    n_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
}

impl KvShape {
    fn check(&self) -> CudaResult<()> {
        let bad = |why: String| Err(CudaError::Unsupported(why));
        match self.dtype {
            KvDtype::F32 => bad("an f32 KV cache on the GPU (its pools hold bf16, int8, int4 or fp8)".into()),
            _ if !self.head_dim.is_multiple_of(8) => bad(format!("a KV cache of head dim {}", self.head_dim)),
            KvDtype::Int8 { group } | KvDtype::Int4 { group }
                if !KV_GROUP_SIZES.contains(&group) || !self.head_dim.is_multiple_of(group) =>
            {
                bad(format!(
                    "KV group size {group} for head dim {} (one of {KV_GROUP_SIZES:?} dividing it)",
                    self.head_dim
                ))
            }
            _ => Ok(()),
        }
    }

    /// Bytes of one block of one pool in each region: (values or codes, parameters).
    fn block_parts(&self) -> [usize; 2] {
        let values = self.n_kv_heads * self.block_size * self.head_dim;
        match self.dtype {
            KvDtype::F32 => [4 * values, 0],
            KvDtype::F16 => [std::mem::size_of::<bf16>() * values, 0],
            KvDtype::Fp8 => [values, 4 * self.n_kv_heads],
            KvDtype::Int8 { group } => [values, 4 * values / group],
            KvDtype::Int4 { group } => [values / 2, 4 * values / group],
        }
    }
}

/// Store the step's new keys and values (`[tokens, *]` rows of `kv_stride` values, the KV
/// heads first) into the cache at the slots `meta` assigned, quantizing them for a quantized
/// cache.
pub fn write_kv(
    gpu: &Gpu,
    k: &impl DevicePtr<bf16>,
    v: &impl DevicePtr<bf16>,
    kv_stride: usize,
    meta: &AttentionMeta,
    kv: &mut DeviceKv,
) -> CudaResult<()> {
    let width = kv.n_kv_heads * kv.head_dim;
    let need = (meta.tokens.max(1) - 1) * kv_stride + width;
    if kv_stride < width || k.len() < need || v.len() < need {
        return Err(CudaError::Shape(format!(
            "write_kv: k {}, v {} for {} tokens of {width} (stride {kv_stride})",
            k.len(),
            v.len(),
            meta.tokens
        )));
    }
    store_rows(gpu, (gpu.ptr(k), gpu.ptr(v)), kv_stride, meta, kv, 1.0)
}

/// `write_kv` from device addresses the caller has checked: `meta.tokens` rows of `kv_stride`
/// bf16 at `kp` and `vp`. An fp8 cache's first write calibrates its scales, keys times
/// `k_factor`.
pub(crate) fn store_rows(
    gpu: &Gpu,
    (kp, vp): (u64, u64),
    kv_stride: usize,
    meta: &AttentionMeta,
    kv: &mut DeviceKv,
    k_factor: f32,
) -> CudaResult<()> {
    let (slots, block_size) = meta.slots();
    if block_size != kv.block_size || !kv.sized() {
        return Err(CudaError::Shape(format!(
            "write_kv into a cache of block size {} (meta: {block_size}), {} blocks",
            kv.block_size, kv.num_blocks
        )));
    }
    if meta.tokens == 0 {
        return Ok(());
    }
    let sp = gpu.ptr(&slots);
    let [st, t, nkv, hd, bs] = [kv_stride, meta.tokens, kv.n_kv_heads, kv.head_dim, kv.block_size].map(|x| x as i32);
    if kv.format() == 0 {
        let (kc, vc) = (gpu.ptr(&kv.k.data), gpu.ptr(&kv.v.data));
        let grid = gpu.grid_for(meta.tokens * kv.n_kv_heads * kv.head_dim, 256);
        return gpu.launch(
            &gpu.fns.write_kv,
            cfg((grid, 1, 1), 256, 0),
            &[&kp, &vp, &st, &sp, &kc, &vc, &t, &nkv, &hd, &bs],
        );
    }
    kv.calibrate(gpu, (kp, vp), kv_stride, meta, k_factor)?;
    let a = kv.args(gpu);
    let grid = gpu.grid_for(meta.tokens * 2 * kv.n_kv_heads * kv.head_dim / 8, 256);
    gpu.launch(
        &gpu.fns.write_kv_quant[kv.format() - 1],
        cfg((grid, 1, 1), 256, 0),
        &[&kp, &vp, &st, &sp, &a.k, &a.v, &a.k_params, &a.v_params, &t, &nkv, &hd, &bs, &a.shift, &a.fp8_scales],
    )
}

/// Quantize whole blocks of the bf16 pools `src` into the quantized pools `dst` (same heads,
/// head dim and block size): block `from` of `src` becomes block `to` of `dst` for each pair,
/// each value quantized as a write of it would be. An fp8 `dst` not yet calibrated takes its
/// scales from these blocks. `pairs` travels to the device first (a small copy).
pub fn convert_blocks(gpu: &Gpu, src: &DeviceKv, dst: &mut DeviceKv, pairs: &[(u32, u32)]) -> CudaResult<()> {
    let same = src.n_kv_heads == dst.n_kv_heads && src.head_dim == dst.head_dim && src.block_size == dst.block_size;
    let in_range = pairs.iter().all(|&(f, t)| (f as usize) < src.num_blocks && (t as usize) < dst.num_blocks);
    if src.format() != 0 || dst.format() == 0 || !same || !in_range || !src.sized() || !dst.sized() {
        return Err(CudaError::Shape(format!(
            "convert {} blocks of a {} cache ({} x {}, {} blocks) into a {} cache ({} x {}, {} blocks)",
            pairs.len(),
            src.dtype,
            src.n_kv_heads,
            src.head_dim,
            src.num_blocks,
            dst.dtype,
            dst.n_kv_heads,
            dst.head_dim,
            dst.num_blocks
        )));
    }
    if pairs.is_empty() {
        return Ok(());
    }
    let flat: Vec<i32> = pairs.iter().flat_map(|&(f, t)| [f as i32, t as i32]).collect();
    let pairs_d = gpu.upload(&flat)?;
    let (pp, np) = (gpu.ptr(&pairs_d), pairs.len() as i32);
    let (ks, vs) = (gpu.ptr(&src.k.data), gpu.ptr(&src.v.data));
    let [nkv, bs, hd] = [dst.n_kv_heads, dst.block_size, dst.head_dim].map(|x| x as i32);
    if let Some(scales) = dst.fp8_scales.as_mut().filter(|_| !dst.calibrated) {
        let scp = gpu.ptr_mut(scales);
        let grid = (2 * dst.n_kv_heads) as u32;
        gpu.launch(
            &gpu.fns.fp8_calibrate_blocks,
            cfg((grid, 1, 1), 256, 0),
            &[&ks, &vs, &pp, &np, &nkv, &bs, &hd, &scp],
        )?;
        dst.calibrated = true;
    }
    let a = dst.args(gpu);
    let grid = gpu.grid_for(pairs.len() * 2 * dst.n_kv_heads * dst.block_size * dst.head_dim / 8, 256);
    gpu.launch(
        &gpu.fns.convert_blocks[dst.format() - 1],
        cfg((grid, 1, 1), 256, 0),
        &[&ks, &vs, &a.k, &a.v, &a.k_params, &a.v_params, &pp, &np, &nkv, &bs, &hd, &a.shift, &a.fp8_scales],
    )
    // `pairs_d` is freed in stream order, after the launches that read it.
}
