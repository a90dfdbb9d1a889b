//! Random weights of a given dtype for synthetic models (benchmarks without files): random
//! codes with scales set so the values lie about in `[-amp, amp]` — the CPU's counterpart of
//! the CUDA kernels' `random_blocks` (`kernels/quant.cuh`), the same scale rules per type.

use rayon::prelude::*;

use super::mlx;
use crate::dtype::DType;
use crate::error::{Result, RuntimeError};

/// The splitmix64 finalizer of `x`.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The f16 header fields `(byte offset, value)` of one `dtype` block for values in
/// `[-amp, amp]`; `None` for dtypes without a rule.
fn gguf_scales(dtype: DType, amp: f32) -> Option<Vec<(usize, f32)>> {
    Some(match dtype {
        DType::Q4_0 => vec![(0, amp / 8.0)],
        DType::Q4_1 => vec![(0, 2.0 * amp / 15.0), (2, -amp)],
        DType::Q5_0 => vec![(0, amp / 16.0)],
        DType::Q5_1 => vec![(0, 2.0 * amp / 31.0), (2, -amp)],
        DType::Q8_0 => vec![(0, amp / 127.0)],
        DType::Q4K => vec![(0, 2.0 * amp / (15.0 * 63.0)), (2, amp / 63.0)],
        DType::Q5K => vec![(0, 2.0 * amp / (31.0 * 63.0)), (2, amp / 63.0)],
        DType::Q6K => vec![(208, amp / (32.0 * 128.0))],
        _ => return None,
    })
}

/// `rows` rows of `k` values of `dtype` from `seed`, about uniform in `[-amp, amp]`: bf16, f16
/// and f32 values, random blocks of the GGUF types the fast kernels read (Q4_0, Q4_1, Q5_0,
/// Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and of every MLX format.
pub fn random_rows(dtype: DType, rows: usize, k: usize, seed: u64, amp: f32) -> Result<Vec<u8>> {
    let bytes =
        dtype.row_bytes(k)?.checked_mul(rows).ok_or_else(|| RuntimeError::Shape(format!("{rows} rows of {k}")))?;
    let block = dtype.block_bytes();
    // Chunks of whole blocks (or values), each from its own stream of the seed.
    let chunk = block << 16;
    let mut out = vec![0u8; bytes];
    let header = gguf_scales(dtype, amp);
    if dtype.is_quantized() && header.is_none() && !matches!(dtype, DType::Mlx(_)) {
        return Err(RuntimeError::Unsupported(format!("random {dtype} weights")));
    }
    out.par_chunks_mut(chunk).enumerate().for_each(|(c, dst)| {
        let stream = splitmix64(seed ^ splitmix64(c as u64));
        match dtype {
            DType::Mlx(f) => dst.copy_from_slice(&mlx::random_blocks(f, dst.len() / block, stream, amp)),
            DType::F32 | DType::F16 | DType::BF16 => {
                for (i, v) in dst.chunks_exact_mut(block).enumerate() {
                    let u = (splitmix64(stream ^ i as u64) >> 40) as f32 / (1u64 << 24) as f32;
                    let x = amp * (2.0 * u - 1.0);
                    match dtype {
                        DType::F32 => v.copy_from_slice(&x.to_le_bytes()),
                        DType::F16 => v.copy_from_slice(&half::f16::from_f32(x).to_le_bytes()),
                        _ => v.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
                    }
                }
            }
            _ => {
                for (i, b) in dst.chunks_exact_mut(block).enumerate() {
                    let mut r = splitmix64(stream ^ i as u64);
                    for (j, byte) in b.iter_mut().enumerate() {
                        if j % 8 == 0 {
                            r = splitmix64(r);
                        }
                        *byte = (r >> (8 * (j % 8))) as u8;
                    }
                    for &(at, v) in header.iter().flatten() {
                        b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                    }
                }
            }
        }
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::MlxFormat;

    /// Every supported type gives finite values within about `[-amp, amp]` (twice that for the
    /// K-quants, whose mins shift the range), not all alike, and a seed decides them.
    #[test]
    fn random_rows_lie_in_range() {
        let amp = 0.05;
        let types = [DType::BF16, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q4K]
            .into_iter()
            .chain([DType::Q5K, DType::Q6K])
            .chain(MlxFormat::all().map(DType::Mlx));
        for dtype in types {
            let (rows, k) = (5, 512);
            let a = random_rows(dtype, rows, k, 1, amp).unwrap();
            assert_ne!(a, random_rows(dtype, rows, k, 2, amp).unwrap(), "{dtype}");
            let mut v = vec![0f32; k];
            let mut sum = 0f32;
            for row in a.chunks_exact(dtype.row_bytes(k).unwrap()) {
                crate::quant::dequantize_row(dtype, row, &mut v).unwrap();
                assert!(v.iter().all(|x| x.is_finite() && x.abs() <= 2.02 * amp), "{dtype}");
                sum += v.iter().map(|x| x.abs()).sum::<f32>();
            }
            assert!(sum / (rows * k) as f32 > amp / 20.0, "{dtype}: values too small");
        }
        assert!(random_rows(DType::Q2K, 1, 256, 1, amp).is_err());
    }
}
