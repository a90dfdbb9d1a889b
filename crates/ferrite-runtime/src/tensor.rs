//! `Tensor`: a shaped, typed view over host memory that is either owned or memory-mapped.
//!
//! Weights keep their file dtype (f32, f16, bf16, a GGUF block type, or MLX blocks kept as the
//! checkpoint's parts until read whole); activations are f32 slices owned by the model. A tensor's last dimension is its row (the reduction axis of a
//! linear layer); quantized rows hold a whole number of blocks.

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use crate::dtype::DType;
use crate::error::{Result, RuntimeError};
use crate::hugemem::HugeBuf;
use crate::quant::mlx::MlxParts;

/// Host bytes behind a tensor.
#[derive(Clone)]
pub enum Buffer {
    /// Owned f32 values (always 4-byte aligned).
    F32(Arc<Vec<f32>>),
    /// Owned raw bytes in the tensor's dtype.
    Bytes(Arc<Vec<u8>>),
    /// A byte range of a memory-mapped file.
    Mapped { map: Arc<memmap2::Mmap>, range: Range<usize> },
    /// An MLX matrix's packed words, scales and biases, read as blocks (`quant::mlx`).
    Mlx(Arc<MlxParts>),
}

impl Buffer {
    /// The bytes (an MLX matrix's blocks: assembled on the first call).
    pub fn bytes(&self) -> &[u8] {
        match self {
            Buffer::F32(v) => bytemuck::cast_slice(v.as_slice()),
            Buffer::Bytes(v) => v.as_slice(),
            Buffer::Mapped { map, range } => &map[range.clone()],
            Buffer::Mlx(p) => p.blocks(),
        }
    }

    /// Bytes held (without assembling anything).
    pub fn len(&self) -> usize {
        match self {
            Buffer::Mapped { range, .. } => range.len(),
            Buffer::Mlx(p) => p.len(),
            b => b.bytes().len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes `range` (within `len()`): a view of a mapped file, a copy otherwise.
    pub fn slice(&self, range: Range<usize>) -> Buffer {
        match self {
            Buffer::Mapped { map, range: r } => {
                Buffer::Mapped { map: map.clone(), range: r.start + range.start..r.start + range.end }
            }
            b => Buffer::Bytes(Arc::new(b.bytes()[range].to_vec())),
        }
    }

    /// Hand the pages of a mapped file back to the page cache (they fault in again if read);
    /// nothing for owned memory.
    pub(crate) fn release_pages(&self) {
        match self {
            Buffer::Mapped { map, range } => {
                // SAFETY: the map is a read-only view of a file nobody writes while it is
                // loaded; dropping its pages only makes the next read fault them in again.
                let _ =
                    unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, range.start, range.len()) };
            }
            Buffer::Mlx(p) if !p.assembled() => p.release_pages(),
            _ => {}
        }
    }
}

#[derive(Clone)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    buffer: Buffer,
    /// The weights re-laid out for a CPU kernel, built on first use and shared by clones.
    derived: Arc<OnceLock<HugeBuf>>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({}, {:?})", self.dtype, self.shape)
    }
}

impl Tensor {
    /// Wrap `buffer` as a tensor, checking that its size matches `shape` and `dtype`.
    pub fn new(dtype: DType, shape: Vec<usize>, buffer: Buffer) -> Result<Tensor> {
        let need = Self::byte_len(dtype, &shape)?;
        if let Buffer::Mapped { map, range } = &buffer {
            if range.start > range.end || range.end > map.len() {
                return Err(RuntimeError::Shape(format!(
                    "byte range {range:?} of a {}-byte map for {dtype} {shape:?}",
                    map.len()
                )));
            }
        }
        if let Buffer::Mlx(p) = &buffer {
            if dtype != DType::Mlx(p.format()) {
                return Err(RuntimeError::Shape(format!("{} parts read as {dtype}", p.format().name())));
            }
        }
        let got = buffer.len();
        if got != need {
            return Err(RuntimeError::ShortBuffer { what: format!("{dtype} tensor of shape {shape:?}"), need, got });
        }
        Ok(Tensor { dtype, shape, buffer, derived: Arc::default() })
    }

    pub fn from_f32(shape: Vec<usize>, values: Vec<f32>) -> Result<Tensor> {
        Tensor::new(DType::F32, shape, Buffer::F32(Arc::new(values)))
    }

    /// Bytes needed by a tensor of `shape` in `dtype` (rows are the last dimension); an error
    /// when its element count or byte size overflows (a hostile header), so every count
    /// derived from a constructed tensor's shape fits.
    pub fn byte_len(dtype: DType, shape: &[usize]) -> Result<usize> {
        let overflow = || RuntimeError::Shape(format!("{dtype} tensor of shape {shape:?} overflows"));
        shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(overflow)?;
        let row = shape.last().copied().unwrap_or(1);
        let rows: usize = shape.iter().rev().skip(1).product();
        dtype.row_bytes(row)?.checked_mul(rows).ok_or_else(overflow)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn bytes(&self) -> &[u8] {
        self.buffer.bytes()
    }
    /// The `len` bytes `fill` derives from this tensor (a kernel's own layout of the weights)
    /// into a zeroed buffer on huge pages (`hugemem`), built on the first call and kept with
    /// the tensor and its clones.
    ///
    /// The kernel then reads only the derived bytes, so a memory-mapped tensor's pages (an
    /// MLX matrix's parts, while not assembled) are handed back to the page cache (they fault
    /// in again if read, e.g. by an embedding lookup of a tied weight): the process holds the
    /// weights once.
    pub(crate) fn derived(&self, len: usize, fill: impl FnOnce(&mut [u8])) -> &[u8] {
        self.derived
            .get_or_init(|| {
                let mut derived = HugeBuf::zeroed(len);
                fill(derived.as_mut_slice());
                self.buffer.release_pages();
                derived
            })
            .as_slice()
    }

    /// The bytes of rows `range`: a view of the tensor's bytes, or, for MLX parts not yet
    /// assembled, those rows assembled into `scratch` (so a reader of a few rows at a time
    /// never makes the whole copy).
    pub(crate) fn row_blocks<'a>(&'a self, range: Range<usize>, scratch: &'a mut Vec<u8>) -> &'a [u8] {
        match &self.buffer {
            Buffer::Mlx(p) if !p.assembled() => {
                p.rows_into(range, scratch);
                scratch
            }
            _ => self.row_range_bytes(range),
        }
    }
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }
    /// Length of one row (the last dimension).
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
    /// Number of rows (product of all but the last dimension).
    pub fn rows(&self) -> usize {
        self.shape.iter().rev().skip(1).product()
    }
    pub fn row_bytes(&self) -> usize {
        // The constructor checked the row is a whole number of blocks.
        self.row_len() / self.dtype.block_elems() * self.dtype.block_bytes()
    }

    /// The raw bytes of rows `range`.
    pub fn row_range_bytes(&self, range: Range<usize>) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes()[range.start * rb..range.end * rb]
    }

    /// Dequantize rows `range` into `out` (`range.len() * row_len` values). MLX parts are
    /// assembled for those rows only.
    pub fn dequantize_rows(&self, range: Range<usize>, out: &mut [f32]) -> Result<()> {
        let n = self.row_len();
        if range.start > range.end || out.len() != range.len() * n || range.end > self.rows() {
            return Err(RuntimeError::Shape(format!(
                "dequantize rows {range:?} of {self:?} into {} values",
                out.len()
            )));
        }
        if n == 0 {
            // Rows of no values: nothing to write (and no row size to step by).
            return Ok(());
        }
        let rb = self.row_bytes();
        // An embedding gather of MLX parts assembles only the rows it reads.
        let mut scratch = Vec::new();
        let bytes = self.row_blocks(range, &mut scratch);
        for (row, dst) in bytes.chunks_exact(rb).zip(out.chunks_exact_mut(n)) {
            crate::quant::dequantize_row(self.dtype, row, dst)?;
        }
        Ok(())
    }

    /// The whole tensor as f32 values (copies unless it already is f32).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.elem_count()];
        self.dequantize_rows(0..self.rows(), &mut out)?;
        Ok(out)
    }

    /// Borrow the values when the tensor is an owned, aligned f32 tensor.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match (&self.buffer, self.dtype) {
            (Buffer::F32(v), DType::F32) => Some(v.as_slice()),
            (_, DType::F32) => bytemuck::try_cast_slice(self.bytes()).ok(),
            _ => None,
        }
    }

    /// A tensor whose rows are this tensor's rows taken in the order `order` (used to undo
    /// llama.cpp's q/k row permutation). Works for every dtype, since rows are independent.
    pub fn permute_rows(&self, order: &[usize]) -> Result<Tensor> {
        if order.len() != self.rows() || order.iter().any(|&r| r >= self.rows()) {
            return Err(RuntimeError::Shape(format!("row order of {} for {self:?}", order.len())));
        }
        let rb = self.row_bytes();
        let src = self.bytes();
        let mut out = Vec::with_capacity(src.len());
        for &r in order {
            out.extend_from_slice(&src[r * rb..(r + 1) * rb]);
        }
        Tensor::new(self.dtype, self.shape.clone(), Buffer::Bytes(Arc::new(out)))
    }

    /// Rows `range` as a `[range.len(), row_len]` tensor (e.g. one expert of a stacked MoE
    /// weight): a view into a memory-mapped file, a copy of owned values.
    pub fn slice_rows(&self, range: Range<usize>) -> Result<Tensor> {
        if range.start > range.end || range.end > self.rows() {
            return Err(RuntimeError::Shape(format!("rows {range:?} of {self:?}")));
        }
        let rb = self.row_bytes();
        let shape = vec![range.len(), self.row_len()];
        let buffer = match &self.buffer {
            Buffer::Mapped { map, range: r } => {
                Buffer::Mapped { map: map.clone(), range: r.start + range.start * rb..r.start + range.end * rb }
            }
            Buffer::F32(v) => {
                let n = self.row_len();
                Buffer::F32(Arc::new(v[range.start * n..range.end * n].to_vec()))
            }
            Buffer::Bytes(_) => Buffer::Bytes(Arc::new(self.row_range_bytes(range).to_vec())),
            Buffer::Mlx(p) => Buffer::Mlx(Arc::new(p.slice_rows(range.clone())?)),
        };
        Tensor::new(self.dtype, shape, buffer)
    }

    #[cfg(test)]
    pub(crate) fn buffer_for_tests(&self) -> &Buffer {
        &self.buffer
    }

    /// Same bytes, new shape with the same row length and element count.
    pub fn reshape(&self, shape: Vec<usize>) -> Result<Tensor> {
        Tensor::new(self.dtype, shape, self.buffer.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_rows_takes_whole_rows() {
        let t = Tensor::from_f32(vec![2, 3, 2], (0..12).map(|v| v as f32).collect()).expect("tensor");
        let s = t.slice_rows(3..5).expect("slice");
        assert_eq!(s.shape(), &[2, 2]);
        assert_eq!(s.to_f32_vec().expect("values"), vec![6.0, 7.0, 8.0, 9.0]);
        assert!(t.slice_rows(5..7).is_err());
    }

    #[test]
    fn empty_rows_dequantize_to_nothing() {
        // Found by the gguf fuzz target: a zero row length stepped rows of zero bytes (a panic).
        for shape in [vec![3, 0], vec![0]] {
            let t = Tensor::new(DType::Q8_0, shape.clone(), Buffer::Bytes(Arc::new(Vec::new()))).expect("tensor");
            assert_eq!(t.to_f32_vec().expect("values"), Vec::<f32>::new(), "{shape:?}");
        }
        assert!(Tensor::byte_len(DType::F32, &[usize::MAX, 2]).is_err());
    }
}
