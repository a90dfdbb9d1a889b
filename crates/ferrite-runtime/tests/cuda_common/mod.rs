//! Shared by the CUDA tests (`tests/cuda_*.rs`): the `FERRITE_TEST_CUDA=1` gate, one `Gpu`
//! per test process, fresh random bf16 inputs and quantized blocks (GGUF, MLX), NaN-poisoned
//! outputs, and the
//! comparison that asserts a tolerance and prints a `TABLE|…` row for `scripts/gpu_tests.sh`'s
//! summary.
//!
//! Tolerances are `|gpu - cpu| <= atol + rtol * |cpu|` per element, with each test saying why
//! its numbers fit bf16; NaN never passes, so an output element the kernel failed to write
//! (still the poison) fails the test. A failed comparison is recorded and the test goes on, so
//! one run on the device reports every failing case; the test fails when it ends.

#![allow(dead_code)] // each test binary uses its own part of these helpers

pub mod attention;
pub mod fp8;

use std::cell::RefCell;
use std::sync::OnceLock;

use ferrite_runtime::cuda::ops::DevicePool;
use ferrite_runtime::cuda::{CudaSlice, Gpu};
use ferrite_runtime::quant::dequantize_row;
use ferrite_runtime::{DType, MlxScale};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The GPU when `FERRITE_TEST_CUDA=1`; otherwise None after saying the test is skipped.
pub fn gpu(test: &str) -> Option<(&'static Gpu, Checks)> {
    if std::env::var("FERRITE_TEST_CUDA").as_deref() != Ok("1") {
        eprintln!("SKIP {test}: set FERRITE_TEST_CUDA=1 on a machine with an NVIDIA GPU to run it");
        return None;
    }
    static GPU: OnceLock<Gpu> = OnceLock::new();
    let gpu = GPU.get_or_init(|| match Gpu::new(0) {
        Ok(g) => g,
        Err(e) => panic!("FERRITE_TEST_CUDA=1 but CUDA device 0 is unusable: {e}"),
    });
    Some((gpu, Checks))
}

/// A fresh RNG; its seed is printed so a failure can be replayed with `FERRITE_TEST_SEED`.
pub fn rng(test: &str) -> StdRng {
    let seed =
        std::env::var("FERRITE_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| rand::rng().random());
    eprintln!("{test}: seed {seed}");
    StdRng::seed_from_u64(seed)
}

/// `n` bf16 values uniform in [-amp, amp), and the same values as f32.
pub fn rand_bf16(rng: &mut StdRng, n: usize, amp: f32) -> (Vec<bf16>, Vec<f32>) {
    let h: Vec<bf16> = (0..n).map(|_| bf16::from_f32(rng.random_range(-amp..amp))).collect();
    let f = h.iter().map(|v| v.to_f32()).collect();
    (h, f)
}

pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Fill a bf16 device KV pool with `values` (from its start).
pub fn fill_pool(gpu: &Gpu, values: &[bf16], pool: &mut DevicePool) {
    gpu.upload_into(bytemuck::cast_slice::<bf16, u8>(values), &mut pool.data).expect("upload");
}

/// A bf16 device KV pool's values as f32.
pub fn pool_f32(gpu: &Gpu, pool: &DevicePool) -> Vec<f32> {
    let bytes = gpu.download(&pool.data).expect("download");
    bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
}

/// A device buffer of `n` bf16 NaNs (an output poisoned before the kernel writes it).
pub fn poisoned_bf16(gpu: &Gpu, n: usize) -> CudaSlice<bf16> {
    gpu.upload(&vec![bf16::NAN; n]).expect("upload")
}

pub fn poisoned_f32(gpu: &Gpu, n: usize) -> CudaSlice<f32> {
    gpu.upload(&vec![f32::NAN; n]).expect("upload")
}

thread_local! {
    /// Failed comparisons of the running test, reported when its `Checks` guard drops.
    static FAILURES: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Held for the length of a test: every comparison runs (one run on the device shows every
/// failing case), and the test fails at the end if any did.
pub struct Checks;

impl Drop for Checks {
    fn drop(&mut self) {
        let failures = FAILURES.with(|f| std::mem::take(&mut *f.borrow_mut()));
        if !failures.is_empty() && !std::thread::panicking() {
            panic!("{} comparisons failed:\n{}", failures.len(), failures.join("\n"));
        }
    }
}

/// Record a failure for the running test's `Checks`.
pub fn fail(message: String) {
    eprintln!("FAIL {message}");
    FAILURES.with(|f| f.borrow_mut().push(message));
}

/// Compare `got` with `want` element-wise; print the table row; record a failure past the
/// tolerance.
pub fn compare(test: &str, case: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{test} {case}: lengths");
    let (mut max_err, mut worst, mut num, mut den) = (0f64, None, 0f64, 0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - f64::from(w)).abs();
        let ok = err <= f64::from(atol) + f64::from(rtol) * f64::from(w).abs();
        if !ok && worst.is_none() {
            worst = Some((i, g, w));
        }
        if err.is_finite() {
            max_err = max_err.max(err);
        }
        num += err * err;
        den += f64::from(w) * f64::from(w);
    }
    let rel = (num / den.max(1e-300)).sqrt();
    let pass = worst.is_none();
    println!(
        "TABLE|{test}|{case}|n={}|max_abs={max_err:.2e}|rel_l2={rel:.2e}|{}",
        got.len(),
        if pass { "ok" } else { "FAIL" }
    );
    if let Some((i, g, w)) = worst {
        fail(format!("{test} {case}: element {i} is {g}, want {w} (atol {atol}, rtol {rtol}; rel L2 {rel:.2e})"));
    }
}

/// Print a measurement row for the summary table.
pub fn measure(test: &str, case: &str, value: String) {
    println!("TABLE|{test}|{case}|{value}");
}

/// Byte offsets of a block's f16 scales: random bytes there could be inf or NaN.
fn scale_offsets(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q4_1 | DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q6K => &[208],
        _ => &[0],
    }
}

/// `v` in an MLX scale type, as its little-endian bytes.
fn scale_bytes(scale: MlxScale, v: f32) -> Vec<u8> {
    match scale {
        MlxScale::Bf16 => bf16::from_f32(v).to_le_bytes().to_vec(),
        MlxScale::F16 => f16::from_f32(v).to_le_bytes().to_vec(),
        MlxScale::F32 => v.to_le_bytes().to_vec(),
    }
}

/// `rows` rows of `k` values of random `dtype` blocks: random bytes, finite random scales (an
/// MLX group: a scale of about 0.03 over its code range, a bias in [-0.03, 0.03)).
pub fn random_blocks(rng: &mut StdRng, dtype: DType, rows: usize, k: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = (0..rows * dtype.row_bytes(k).unwrap()).map(|_| rng.random()).collect();
    for block in bytes.chunks_exact_mut(dtype.block_bytes()) {
        if let DType::Mlx(f) = dtype {
            let levels = ((1u32 << f.bits()) - 1) as f32;
            let header = [rng.random_range(0.001f32..0.06) / levels, rng.random_range(-0.03f32..0.03)]
                .iter()
                .flat_map(|&v| scale_bytes(f.scale(), v))
                .collect::<Vec<u8>>();
            block[..header.len()].copy_from_slice(&header);
            continue;
        }
        for &o in scale_offsets(dtype) {
            let d = f16::from_f32(rng.random_range(-0.03f32..0.03));
            block[o..o + 2].copy_from_slice(&d.to_le_bytes());
        }
    }
    bytes
}

pub fn dequantized(dtype: DType, bytes: &[u8], k: usize) -> Vec<f32> {
    let rb = dtype.row_bytes(k).unwrap();
    let mut out = vec![0f32; bytes.len() / rb * k];
    for (row, dst) in bytes.chunks_exact(rb).zip(out.chunks_exact_mut(k)) {
        dequantize_row(dtype, row, dst).unwrap();
    }
    out
}
