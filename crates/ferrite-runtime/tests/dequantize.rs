//! `quant::dequantize_row` against the `gguf` Python package.
//!
//! The fixtures in `tests/fixtures/quant/` (written by `scripts/goldens/quant_fixtures.py`) hold
//! raw blocks of every supported dtype and the f32 values gguf decodes them to, as bit
//! patterns. We demand bit-for-bit equality, signed zeros included, with no ulp slack: in every
//! format the products of an f16 scale, a small sub-block scale and a small quant are exact in
//! f32, so the only rounding is the final `- dmin * m` / `+ m` (or Q8_K's one f32 multiply), and
//! the result does not depend on evaluation order or FMA contraction.

use std::path::{Path, PathBuf};

use ferrite_runtime::quant::dequantize_row;
use ferrite_runtime::{DType, RuntimeError};
use serde_json::Value;

/// Every dtype must have a fixture; the floats ride along for free.
const COVERED: [DType; 14] = [
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q8_1,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Q8K,
];

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/quant")
}

fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit")).collect()
}

struct Fixture {
    dtype: DType,
    n_blocks: usize,
    blocks: Vec<u8>,
    expected: Vec<f32>,
}

fn load(dtype: DType) -> Fixture {
    let path = fixture_dir().join(format!("{}.json", dtype.name()));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: Value = serde_json::from_str(&text).expect("fixture JSON");
    let field = |k: &str| json.get(k).unwrap_or_else(|| panic!("{dtype}: no field {k}"));
    let num = |k: &str| field(k).as_u64().unwrap_or_else(|| panic!("{dtype}: {k} is not a number")) as usize;
    let hex = |k: &str| unhex(field(k).as_str().unwrap_or_else(|| panic!("{dtype}: {k} is not a string")));

    assert_eq!(field("dtype").as_str(), Some(dtype.name()));
    assert_eq!(DType::from_ggml(num("ggml_type") as u32), Some(dtype), "ggml type id");
    // Block geometry as the `gguf` package (and ggml, for Q8_1) states it.
    assert_eq!(num("block_elems"), dtype.block_elems(), "{dtype} block_elems");
    assert_eq!(num("block_bytes"), dtype.block_bytes(), "{dtype} block_bytes");

    let n_blocks = num("n_blocks");
    let blocks = hex("blocks_hex");
    let expected: Vec<f32> =
        hex("expected_f32_hex").chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    assert_eq!(blocks.len(), n_blocks * dtype.block_bytes(), "{dtype} blocks");
    assert_eq!(expected.len(), n_blocks * dtype.block_elems(), "{dtype} expected values");
    Fixture { dtype, n_blocks, blocks, expected }
}

/// Bitwise comparison; reports the first few mismatches with their block and offset.
fn assert_bits_eq(dtype: DType, what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    let be = dtype.block_elems();
    let bad: Vec<String> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| g.to_bits() != w.to_bits())
        .map(|(i, (g, w))| format!("[{i}] (block {}, +{}): got {g:e}, want {w:e}", i / be, i % be))
        .collect();
    let first = &bad[..bad.len().min(5)];
    assert!(bad.is_empty(), "{dtype} {what}: {} of {} values differ, first: {first:#?}", bad.len(), got.len());
}

#[test]
fn every_quantized_dtype_has_a_fixture() {
    for t in DType::ALL.into_iter().filter(|t| t.is_quantized()) {
        assert!(COVERED.contains(&t), "{t} has no dequantize fixture");
    }
}

#[test]
fn whole_rows_match_gguf_bitwise() {
    for dtype in COVERED {
        let f = load(dtype);
        let mut got = vec![f32::NAN; f.expected.len()];
        dequantize_row(f.dtype, &f.blocks, &mut got).unwrap();
        assert_bits_eq(f.dtype, "whole row", &got, &f.expected);
    }
}

/// Each block decoded alone from an odd byte offset, with trailing bytes after it: exercises
/// unaligned reads and shows the decoder reads only its own row.
#[test]
fn single_blocks_at_unaligned_offsets_match_gguf() {
    for dtype in COVERED {
        let f = load(dtype);
        let (bb, be) = (dtype.block_bytes(), dtype.block_elems());
        for i in 0..f.n_blocks {
            let mut src = vec![0xA5u8; 1];
            src.extend_from_slice(&f.blocks[i * bb..(i + 1) * bb]);
            src.extend_from_slice(&[0x5A; 7]);
            let mut got = vec![f32::NAN; be];
            dequantize_row(dtype, &src[1..], &mut got).unwrap();
            assert_bits_eq(dtype, &format!("block {i} alone"), &got, &f.expected[i * be..(i + 1) * be]);
        }
    }
}

#[test]
fn row_length_not_a_block_multiple_is_an_error() {
    for dtype in DType::ALL.into_iter().filter(|t| t.is_quantized()) {
        let src = vec![0u8; 4 * dtype.block_bytes()];
        for len in [1, dtype.block_elems() - 1, dtype.block_elems() + 1, 2 * dtype.block_elems() + 16] {
            let mut dst = vec![0f32; len];
            match dequantize_row(dtype, &src, &mut dst) {
                Err(RuntimeError::BlockAlignment { dtype: t, len: l, block }) => {
                    assert_eq!((t, l, block), (dtype, len, dtype.block_elems()));
                }
                other => panic!("{dtype} row of {len}: expected BlockAlignment, got {other:?}"),
            }
        }
    }
}

#[test]
fn short_buffer_is_an_error() {
    for dtype in DType::ALL {
        let n = 2 * dtype.block_elems();
        let need = 2 * dtype.block_bytes();
        for got_len in [0, 1, need - 1] {
            let src = vec![0u8; got_len];
            let mut dst = vec![0f32; n];
            match dequantize_row(dtype, &src, &mut dst) {
                Err(RuntimeError::ShortBuffer { need: nd, got, .. }) => assert_eq!((nd, got), (need, got_len)),
                other => panic!("{dtype}: {got_len} of {need} bytes: expected ShortBuffer, got {other:?}"),
            }
        }
    }
}
