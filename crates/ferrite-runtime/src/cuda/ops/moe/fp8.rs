//! FP8 routed experts: stacked expert matrices of e4m3 codes in `moe_fp8.cuh`'s row layout,
//! which the experts' kernels (`moe_gemm.cuh`, module `moe_fp8`) read like any other row type.
//!
//! A row of `cols` values is its scale runs (`ceil(cols / run)` f32 scales, zero-padded to
//! whole 16-byte words), then its `cols` codes; a run is a power of two of at least 16 values.
//! A checkpoint's scales (one per row and run of `col_block` columns, `fp8.rs`'s form) are
//! repeated into runs of the largest power of two dividing `col_block` (one scale a row when a
//! run spans it). `--quantization fp8` and synthetic models give one scale a row, made on the
//! device by the dense FP8 path's kernels (`fp8_quantize_rows`, `fp8_random`) writing into the
//! rows.

use crate::cuda::context::Gpu;
use crate::cuda::error::{CudaError, CudaResult};
use crate::cuda::ops::fp8::{quantize_rows, random_rows, RowsAt};
use crate::cuda::ops::Fp8Matrix;
use crate::dtype::DType;

use super::{check, ExpertMatrix};

/// The layout of FP8 expert rows of `cols` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fp8Rows {
    cols: usize,
    /// log2 of the run / 16.
    shift: u32,
    /// 16-byte words of scales ahead of a row's codes.
    scale_words: usize,
}

impl Fp8Rows {
    /// Rows of `cols` values whose scales change every `col_block` columns (`col_block >=
    /// cols`: one scale a row); both multiples of 16.
    fn new(cols: usize, col_block: usize) -> CudaResult<Fp8Rows> {
        check(cols > 0 && cols.is_multiple_of(16) && col_block > 0 && col_block.is_multiple_of(16), || {
            format!("FP8 expert rows of {cols} values with scales every {col_block} (multiples of 16)")
        })?;
        let run = if col_block >= cols { cols.next_power_of_two() } else { 1 << col_block.trailing_zeros() };
        let runs = cols.div_ceil(run);
        Ok(Fp8Rows { cols, shift: (run / 16).trailing_zeros(), scale_words: runs.div_ceil(4) })
    }

    fn run(&self) -> usize {
        16 << self.shift
    }

    fn row_bytes(&self) -> usize {
        16 * self.scale_words + self.cols
    }

    /// The kernels' `fmt`: bits 0-4 the run's shift, the scale words above.
    fn fmt(&self) -> i32 {
        (self.shift | (self.scale_words as u32) << 5) as i32
    }

    /// Rows of `codes` (`rows × cols`) with `scales` (`rows × ceil(cols / col_block)`) laid
    /// out.
    fn pack(&self, codes: &[u8], scales: &[f32], col_block: usize) -> Vec<u8> {
        let (cols, run) = (self.cols, self.run());
        let ncb = cols.div_ceil(col_block);
        let mut out = Vec::with_capacity(codes.len() / cols * self.row_bytes());
        for (row, s) in codes.chunks_exact(cols).zip(scales.chunks_exact(ncb)) {
            let runs = cols.div_ceil(run);
            out.extend((0..runs).flat_map(|b| s[(b * run) / col_block].to_le_bytes()));
            out.resize(out.len() + 16 * self.scale_words - 4 * runs, 0);
            out.extend_from_slice(row);
        }
        out
    }
}

fn unsupported(gpu: &Gpu) -> CudaResult<()> {
    if Fp8Matrix::supported_on(gpu) {
        return Ok(());
    }
    let (major, minor) = gpu.info().compute_capability;
    Err(CudaError::Unsupported(format!(
        "FP8 experts need compute capability 8.9 or newer (Ada, Hopper); this GPU is {major}.{minor}"
    )))
}

impl ExpertMatrix {
    /// FP8 experts from a checkpoint: `codes` (`experts × rows × cols` e4m3 bytes, expert
    /// after expert) and `scales` (one per row and run of `col_block` columns).
    pub fn upload_fp8(
        gpu: &Gpu,
        (experts, rows, cols): (usize, usize, usize),
        codes: &[u8],
        scales: &[f32],
        col_block: usize,
    ) -> CudaResult<ExpertMatrix> {
        unsupported(gpu)?;
        let layout = Fp8Rows::new(cols, col_block)?;
        let n = experts * rows;
        check(n > 0 && codes.len() == n * cols && scales.len() == n * cols.div_ceil(col_block), || {
            format!(
                "{experts} FP8 experts of [{rows}, {cols}] (scales every {col_block}): {} codes, {} scales",
                codes.len(),
                scales.len()
            )
        })?;
        let data = gpu.upload(&layout.pack(codes, scales, col_block))?;
        Ok(ExpertMatrix { dtype: DType::F8E4M3, experts, rows, cols, data, fmt: layout.fmt() })
    }

    /// `w` (bf16 experts) quantized to FP8 per row on the device, a scale a row (max|w| / 448),
    /// as `Fp8Matrix::quantize` quantizes a dense matrix (`--quantization fp8`).
    pub fn quantize_fp8(gpu: &Gpu, w: &ExpertMatrix) -> CudaResult<ExpertMatrix> {
        check(w.dtype == DType::BF16, || format!("FP8 quantization of {} experts (bf16 ones are quantized)", w.dtype))?;
        let mut m = Self::fp8_alloc(gpu, (w.experts, w.rows, w.cols))?;
        let at = m.rows_at(gpu);
        quantize_rows(gpu, gpu.ptr(&w.data), at, w.experts * w.rows, w.cols)?;
        Ok(m)
    }

    /// Random FP8 experts from `seed`, a scale a row: values in [-amp, amp].
    pub(super) fn random_fp8(gpu: &Gpu, shape: (usize, usize, usize), seed: u64, amp: f32) -> CudaResult<ExpertMatrix> {
        let mut m = Self::fp8_alloc(gpu, shape)?;
        let at = m.rows_at(gpu);
        random_rows(gpu, at, shape.0 * shape.1, shape.2, seed, amp)?;
        Ok(m)
    }

    /// Uninitialized FP8 experts of one scale a row.
    fn fp8_alloc(gpu: &Gpu, (experts, rows, cols): (usize, usize, usize)) -> CudaResult<ExpertMatrix> {
        unsupported(gpu)?;
        let layout = Fp8Rows::new(cols, cols)?;
        check(experts * rows > 0, || format!("{experts} FP8 experts of [{rows}, {cols}]"))?;
        let data = gpu.alloc::<u8>(experts * rows * layout.row_bytes())?;
        Ok(ExpertMatrix { dtype: DType::F8E4M3, experts, rows, cols, data, fmt: layout.fmt() })
    }

    /// Where a one-scale-a-row FP8 matrix's codes and scales are (`fp8_alloc`'s layout).
    fn rows_at(&mut self, gpu: &Gpu) -> RowsAt {
        let row_bytes = Fp8Rows::new(self.cols, self.cols).map_or(0, |l| l.row_bytes()) as u64;
        let base = gpu.ptr_mut(&mut self.data);
        RowsAt { codes: base + 16, code_ld: row_bytes, scales: base, scale_ld: row_bytes / 4 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_powers_of_two_dividing_the_checkpoints() {
        // A 128-column block of a 768-wide row: 6 runs of 128, two words of scales.
        let l = Fp8Rows::new(768, 128).unwrap();
        assert_eq!((l.run(), l.scale_words, l.row_bytes()), (128, 2, 32 + 768));
        assert_eq!(l.fmt(), 3 | 2 << 5);
        // One scale a row (a channel scale, a block wider than the row): a run past the row.
        let l = Fp8Rows::new(80, 80).unwrap();
        assert_eq!((l.run(), l.scale_words, l.fmt()), (128, 1, 3 | 1 << 5));
        assert_eq!(Fp8Rows::new(64, 128).unwrap().run(), 64);
        // A group of 96 refines to runs of 32.
        assert_eq!(Fp8Rows::new(192, 96).unwrap().run(), 32);
        assert!(Fp8Rows::new(72, 72).is_err());
        assert!(Fp8Rows::new(64, 8).is_err());
    }

    #[test]
    fn packed_rows_hold_their_scales_then_their_codes() {
        // Two rows of 64 with a scale every 32 columns, refined nowhere (runs of 32).
        let codes: Vec<u8> = (0..128).map(|i| i as u8).collect();
        let scales = [1.0f32, 2.0, 3.0, 4.0];
        let l = Fp8Rows::new(64, 32).unwrap();
        let p = l.pack(&codes, &scales, 32);
        assert_eq!(p.len(), 2 * l.row_bytes());
        let f = |at: usize| f32::from_le_bytes(p[at..at + 4].try_into().unwrap());
        assert_eq!((f(0), f(4), f(8)), (1.0, 2.0, 0.0));
        assert_eq!(&p[16..80], &codes[..64]);
        assert_eq!((f(80), f(84)), (3.0, 4.0));
        assert_eq!(&p[96..160], &codes[64..]);
        // A 96-column group (runs of 32): each scale repeated over its three runs.
        let l = Fp8Rows::new(192, 96).unwrap();
        let p = l.pack(&[0u8; 192], &[5.0, 6.0], 96);
        let runs: Vec<f32> = p[..24].chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        assert_eq!(runs, [5.0, 5.0, 5.0, 6.0, 6.0, 6.0]);
    }
}
