//! MLX affine quantization as one block type per format (`DType::Mlx`).
//!
//! An MLX checkpoint stores a quantized `[out, in]` matrix as three tensors: `weight`, uint32
//! words holding `32 / bits` codes each, lowest bits first (`[out, in * bits / 32]`), and
//! `scales` and `biases`, one per group of `group` consecutive values of a row
//! (`[out, in / group]`, in the model's float type). A value is `scale * code + bias`.
//!
//! A tensor of MLX blocks reads its rows as one row of blocks, one block per group, so that
//! every consumer of a row of blocks (the matmul kernels, embedding gathers, row slices, the
//! GPU upload) reads MLX weights like any GGUF block type:
//!
//! ```text
//! scale: S | bias: S | codes[group * bits / 8]      S = bf16, f16 or f32 (little-endian)
//! ```
//!
//! The codes are the group's bytes of the packed row as MLX wrote them: 4-bit value `i` is
//! nibble `i % 2` (low first) of byte `i / 2`, 8-bit value `i` is byte `i`.
//!
//! A checkpoint's three tensors stay as they are mapped (`MlxParts`, a tensor's buffer) until a
//! reader needs the whole matrix as blocks: the integer GEMM's re-layout and an embedding
//! gather assemble the rows they read, so a packed matrix is held once (its packed copy; the
//! file's pages are handed back); the row kernels and a GPU upload read the matrix assembled
//! once (the mapped pages then handed back too).
//!
//! Dequantization is `scale * code + bias` in f32, the product rounded, then the sum: with a
//! 16-bit scale (at most 11 significant bits) times a code of at most 8 bits the product is
//! exact, so the one rounding is the add's and any evaluation order (FMA or not) gives the
//! same bits; an f32 scale's product rounds too.

use std::ops::Range;
use std::sync::OnceLock;

use crate::dtype::{MlxFormat, MlxScale};
use crate::error::{Result, RuntimeError};
use crate::tensor::Buffer;

/// A float of `scale`'s type at `b` (little-endian), widened exactly to f32.
pub(crate) fn read_scale(scale: MlxScale, b: &[u8]) -> f32 {
    match scale {
        MlxScale::Bf16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        MlxScale::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
        MlxScale::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

/// `v` rounded to `scale`'s type, as its little-endian bytes (2 or 4).
pub(crate) fn write_scale(scale: MlxScale, v: f32, out: &mut [u8]) {
    match scale {
        MlxScale::Bf16 => out[..2].copy_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        MlxScale::F16 => out[..2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes()),
        MlxScale::F32 => out[..4].copy_from_slice(&v.to_le_bytes()),
    }
}

/// The scale and bias of `block`.
pub(crate) fn scale_bias(f: MlxFormat, block: &[u8]) -> (f32, f32) {
    let s = f.scale().bytes();
    (read_scale(f.scale(), &block[..s]), read_scale(f.scale(), &block[s..2 * s]))
}

/// Code `i` of a group's packed `codes`.
#[inline]
pub(crate) fn code(bits: u32, codes: &[u8], i: usize) -> u8 {
    if bits == 8 {
        codes[i]
    } else {
        (codes[i / 2] >> (4 * (i % 2))) & 15
    }
}

/// Dequantize whole blocks of `f` in `src` into `dst` (`dst.len()` a multiple of the group).
pub(super) fn dequantize_row(f: MlxFormat, src: &[u8], dst: &mut [f32]) {
    let h = f.header_bytes();
    for (block, out) in src.chunks_exact(h + f.code_bytes()).zip(dst.chunks_exact_mut(f.group())) {
        let (scale, bias) = scale_bias(f, block);
        for (i, y) in out.iter_mut().enumerate() {
            *y = scale * f32::from(code(f.bits(), &block[h..], i)) + bias;
        }
    }
}

/// Check that `words`, `scales` and `biases` (byte counts) hold an `[rows, k]` matrix of `f`.
fn check_parts(f: MlxFormat, rows: usize, k: usize, words: usize, scales: usize, biases: usize) -> Result<()> {
    let g = f.group();
    if k == 0 || !k.is_multiple_of(g) {
        return Err(RuntimeError::Shape(format!("{} rows of {k} values: not whole groups of {g}", f.name())));
    }
    let (groups, s) = (k / g, f.scale().bytes());
    let need = |what: &str, got: usize, want: usize| {
        if got == want {
            Ok(())
        } else {
            Err(RuntimeError::ShortBuffer {
                what: format!("{what} of a [{rows}, {k}] {} matrix", f.name()),
                need: want,
                got,
            })
        }
    };
    need("packed codes", words, rows * k * f.bits() as usize / 8)?;
    need("scales", scales, rows * groups * s)?;
    need("biases", biases, rows * groups * s)
}

/// Rows `range` of a checked `[_, k]` matrix of `f` as blocks into `out` (cleared first).
fn assemble_rows(
    f: MlxFormat,
    k: usize,
    range: Range<usize>,
    words: &[u8],
    scales: &[u8],
    biases: &[u8],
    out: &mut Vec<u8>,
) {
    let (groups, code_row, s) = (k / f.group(), k * f.bits() as usize / 8, f.scale().bytes());
    let block = f.header_bytes() + f.code_bytes();
    out.clear();
    out.resize(range.len() * groups * block, 0);
    for (i, dst) in out.chunks_exact_mut(block).enumerate() {
        // Block i is group i % groups of row range.start + i / groups; its codes follow in the
        // packed row.
        let (r, g) = (range.start + i / groups, i % groups);
        let b = r * groups + g;
        dst[..s].copy_from_slice(&scales[b * s..(b + 1) * s]);
        dst[s..2 * s].copy_from_slice(&biases[b * s..(b + 1) * s]);
        let at = r * code_row + g * f.code_bytes();
        dst[2 * s..].copy_from_slice(&words[at..at + f.code_bytes()]);
    }
}

/// The rows of an `[rows, k]` matrix of format `f` as blocks, from an MLX checkpoint's
/// `weight` words, `scales` and `biases` (their raw little-endian bytes, row-major). The
/// caller names the tensors in errors; this checks only the byte counts.
pub fn assemble(f: MlxFormat, rows: usize, k: usize, words: &[u8], scales: &[u8], biases: &[u8]) -> Result<Vec<u8>> {
    check_parts(f, rows, k, words.len(), scales.len(), biases.len())?;
    let mut out = Vec::new();
    assemble_rows(f, k, 0..rows, words, scales, biases, &mut out);
    Ok(out)
}

/// An `[rows, k]` MLX matrix as its checkpoint stores it: the packed words, scales and biases
/// (views of the mapped file, usually), assembled into blocks on the first whole read.
pub struct MlxParts {
    format: MlxFormat,
    rows: usize,
    k: usize,
    words: Buffer,
    scales: Buffer,
    biases: Buffer,
    blocks: OnceLock<Vec<u8>>,
}

impl MlxParts {
    /// The parts of an `[rows, k]` matrix of `f`, their byte counts checked.
    pub fn new(f: MlxFormat, rows: usize, k: usize, words: Buffer, scales: Buffer, biases: Buffer) -> Result<MlxParts> {
        check_parts(f, rows, k, words.len(), scales.len(), biases.len())?;
        Ok(MlxParts { format: f, rows, k, words, scales, biases, blocks: OnceLock::new() })
    }

    pub fn format(&self) -> MlxFormat {
        self.format
    }

    /// Bytes of the matrix as blocks.
    pub(crate) fn len(&self) -> usize {
        self.rows * self.k / self.format.group() * (self.format.header_bytes() + self.format.code_bytes())
    }

    /// The whole matrix as blocks (assembled on the first call, then kept; the parts' mapped
    /// pages are then handed back, as the blocks hold what they hold).
    pub(crate) fn blocks(&self) -> &[u8] {
        self.blocks.get_or_init(|| {
            let mut out = Vec::new();
            self.rows_into(0..self.rows, &mut out);
            self.release_pages();
            out
        })
    }

    /// Rows `range` (within the matrix) as blocks into `out`.
    pub(crate) fn rows_into(&self, range: Range<usize>, out: &mut Vec<u8>) {
        let (w, s, b) = (self.words.bytes(), self.scales.bytes(), self.biases.bytes());
        assemble_rows(self.format, self.k, range, w, s, b, out);
    }

    /// Whether the whole matrix has been assembled.
    pub(crate) fn assembled(&self) -> bool {
        self.blocks.get().is_some()
    }

    /// Rows `range` (within the matrix) as parts of their own: views of the same buffers.
    pub(crate) fn slice_rows(&self, range: Range<usize>) -> Result<MlxParts> {
        let f = self.format;
        let (code_row, scale_row) = (self.k * f.bits() as usize / 8, self.k / f.group() * f.scale().bytes());
        let part = |b: &Buffer, row: usize| b.slice(range.start * row..range.end * row);
        MlxParts::new(
            f,
            range.len(),
            self.k,
            part(&self.words, code_row),
            part(&self.scales, scale_row),
            part(&self.biases, scale_row),
        )
    }

    /// Hand the mapped parts' pages back (they fault in again if read).
    pub(crate) fn release_pages(&self) {
        for b in [&self.words, &self.scales, &self.biases] {
            b.release_pages();
        }
    }
}

/// Quantize `row` (whole groups) into blocks of `f` as MLX's affine quantization defines it:
/// per group `bias = min`, `scale = (max - min) / (2^bits - 1)` (at least 1e-7, as MLX
/// keeps an all-equal group finite), `code = round((w - bias) / scale)` to nearest, ties to
/// even, in `0..2^bits`; the scale and bias are then stored in `f`'s scale type.
pub fn quantize_row(f: MlxFormat, row: &[f32], out: &mut [u8]) {
    let (h, levels) = (f.header_bytes(), (1u32 << f.bits()) - 1);
    for (x, block) in row.chunks_exact(f.group()).zip(out.chunks_exact_mut(h + f.code_bytes())) {
        let (lo, hi) = x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| (a.min(v), b.max(v)));
        let scale = ((hi - lo) / levels as f32).max(1e-7);
        write_scale(f.scale(), scale, &mut block[..h / 2]);
        write_scale(f.scale(), lo, &mut block[h / 2..h]);
        let codes = &mut block[h..];
        codes.fill(0);
        for (i, &v) in x.iter().enumerate() {
            let q = ((v - lo) / scale).round_ties_even().clamp(0.0, levels as f32) as u8;
            if f.bits() == 8 {
                codes[i] = q;
            } else {
                codes[i / 2] |= q << (4 * (i % 2));
            }
        }
    }
}

/// `blocks` random blocks of `f` from `seed` (splitmix64): random codes, every group with
/// scale `2 amp / (2^bits - 1)` and bias `-amp`, so the values lie in `[-amp, amp]`
/// (synthetic models, tests).
pub fn random_blocks(f: MlxFormat, blocks: usize, seed: u64, amp: f32) -> Vec<u8> {
    let (h, block) = (f.header_bytes(), f.header_bytes() + f.code_bytes());
    let mut out = vec![0u8; blocks * block];
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let levels = ((1u32 << f.bits()) - 1) as f32;
    for b in out.chunks_exact_mut(block) {
        write_scale(f.scale(), 2.0 * amp / levels, &mut b[..h / 2]);
        write_scale(f.scale(), -amp, &mut b[h / 2..h]);
        for chunk in b[h..].chunks_mut(8) {
            let r = next().to_le_bytes();
            chunk.copy_from_slice(&r[..chunk.len()]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Words, scales and biases as MLX lays them out, for values `codes[r][j]`.
    fn mlx_parts(f: MlxFormat, codes: &[Vec<u32>], scales: &[f32], biases: &[f32]) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let per = 32 / f.bits() as usize;
        let mut words = Vec::new();
        for row in codes {
            for w in row.chunks_exact(per) {
                let word = w.iter().enumerate().fold(0u32, |acc, (i, &c)| acc | c << (f.bits() as usize * i));
                words.extend_from_slice(&word.to_le_bytes());
            }
        }
        let enc = |v: &[f32]| {
            v.iter()
                .flat_map(|&x| {
                    let mut b = [0u8; 4];
                    write_scale(f.scale(), x, &mut b);
                    b[..f.scale().bytes()].to_vec()
                })
                .collect::<Vec<u8>>()
        };
        (words, enc(scales), enc(biases))
    }

    /// Assembled blocks dequantize to `scale * code + bias` of each value's own group, for
    /// every format: the packed word order, the group order and the header read back.
    #[test]
    fn assembled_blocks_dequantize_as_mlx_defines() {
        for f in MlxFormat::all() {
            let (rows, k) = (3, 2 * f.group());
            let groups = k / f.group();
            let codes: Vec<Vec<u32>> =
                (0..rows).map(|r| (0..k).map(|j| ((r * 7 + j * 5) % (1 << f.bits())) as u32).collect()).collect();
            let scales: Vec<f32> = (0..rows * groups).map(|i| 0.25 + i as f32 / 8.0).collect();
            let biases: Vec<f32> = (0..rows * groups).map(|i| -1.0 + i as f32 / 4.0).collect();
            let (w, s, b) = mlx_parts(f, &codes, &scales, &biases);
            let blocks = assemble(f, rows, k, &w, &s, &b).unwrap();
            let mut got = vec![0f32; rows * k];
            let row_bytes = groups * (f.header_bytes() + f.code_bytes());
            for (src, dst) in blocks.chunks_exact(row_bytes).zip(got.chunks_exact_mut(k)) {
                dequantize_row(f, src, dst);
            }
            for r in 0..rows {
                for j in 0..k {
                    let g = r * groups + j / f.group();
                    let want = scales[g] * codes[r][j] as f32 + biases[g];
                    assert_eq!(got[r * k + j], want, "{} row {r} value {j}", f.name());
                }
            }
            // A byte count that does not match is an error, not a panic.
            assert!(assemble(f, rows, k, &w[4..], &s, &b).is_err());
            assert!(assemble(f, rows, k + 1, &w, &s, &b).is_err());
        }
    }

    /// A tensor over the parts reads as the assembled blocks — whole, by rows, sliced — and
    /// reading a few rows (or slicing) assembles nothing.
    #[test]
    fn parts_read_as_assembled_blocks() {
        use crate::dtype::DType;
        use crate::tensor::Tensor;
        use std::sync::Arc;
        let f = MlxFormat::new(4, 32, MlxScale::Bf16).unwrap();
        let (rows, k) = (5, 96);
        let codes: Vec<Vec<u32>> = (0..rows).map(|r| (0..k).map(|j| ((r * 3 + j) % 16) as u32).collect()).collect();
        let groups = rows * k / 32;
        let scales: Vec<f32> = (0..groups).map(|i| 0.5 + i as f32 / 16.0).collect();
        let biases: Vec<f32> = (0..groups).map(|i| i as f32 / 8.0 - 1.0).collect();
        let (w, s, b) = mlx_parts(f, &codes, &scales, &biases);
        let blocks = assemble(f, rows, k, &w, &s, &b).unwrap();
        let owned = |v: &Vec<u8>| Buffer::Bytes(Arc::new(v.clone()));
        let parts = MlxParts::new(f, rows, k, owned(&w), owned(&s), owned(&b)).unwrap();
        let t = Tensor::new(DType::Mlx(f), vec![rows, k], Buffer::Mlx(Arc::new(parts))).unwrap();
        let plain = Tensor::new(DType::Mlx(f), vec![rows, k], Buffer::Bytes(Arc::new(blocks.clone()))).unwrap();
        let mut scratch = Vec::new();
        assert_eq!(t.row_blocks(1..3, &mut scratch), plain.row_range_bytes(1..3));
        let sliced = t.slice_rows(2..5).unwrap();
        let Buffer::Mlx(p) = &t.buffer_for_tests() else { panic!("parts") };
        assert!(!p.assembled(), "reading rows or slicing assembled the matrix");
        assert_eq!(sliced.to_f32_vec().unwrap(), plain.slice_rows(2..5).unwrap().to_f32_vec().unwrap());
        assert_eq!(t.to_f32_vec().unwrap(), plain.to_f32_vec().unwrap());
        assert_eq!(t.bytes(), blocks.as_slice());
        // Parts that do not make the matrix are an error.
        assert!(MlxParts::new(f, rows, k, owned(&w), owned(&s), Buffer::Bytes(Arc::new(vec![0; 4]))).is_err());
    }

    /// MLX's quantizer: the group's extremes come back within half a step, codes span the
    /// range, and an all-equal group stays finite.
    #[test]
    fn quantize_row_follows_the_definition() {
        for f in MlxFormat::all().filter(|f| f.scale() == MlxScale::F32) {
            let k = 2 * f.group();
            let mut x: Vec<f32> = (0..k).map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 0.3).collect();
            x[f.group()..].fill(0.125);
            let mut blocks = vec![0u8; k / f.group() * (f.header_bytes() + f.code_bytes())];
            quantize_row(f, &x, &mut blocks);
            let mut y = vec![0f32; k];
            dequantize_row(f, &blocks, &mut y);
            let (scale, _) = scale_bias(f, &blocks);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= scale / 2.0 + 1e-6, "{}: {a} vs {b}", f.name());
            }
            assert!(y[f.group()..].iter().all(|&v| (v - 0.125).abs() < 1e-5), "{}", f.name());
        }
    }
}
