#!/usr/bin/env python3
"""Golden fixtures for GGUF block dequantization (ferrite-runtime `quant::dequantize_row`).

Needs numpy and the official `gguf` package:

    pip install gguf numpy
    python scripts/goldens/quant_fixtures.py          # from the repo root

It writes one JSON file per dtype to tests/fixtures/quant/ (overwriting them); the Rust test
crates/ferrite-runtime/tests/dequantize.rs compares `dequantize_row` against them bit for bit.
The output is deterministic for a given gguf/numpy version (fixed seed).

Each fixture holds a few blocks and the values gguf decodes them to:

    {"dtype": "Q4_K", "ggml_type": 12, "block_elems": 256, "block_bytes": 144,
     "n_blocks": 4, "reference": "...", "blocks_hex": "<raw block bytes>",
     "expected_f32_hex": "<expected values, little-endian f32 bit patterns>"}

Expected values are stored as bit patterns, not decimal floats, so nothing is lost to parsing.

How the blocks are made:
- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (which gguf can quantize): random floats at several magnitudes,
  plus an all-zero and a constant block, quantized with `gguf.quants.quantize`.
- Q2_K .. Q6_K (gguf only dequantizes these): random raw bytes, with the f16 `d`/`dmin` fields
  overwritten by finite values of moderate magnitude (either sign), plus one block whose quant
  and scale bytes are all 0xFF.
- F16, BF16: random floats at several magnitudes.
All of the above are decoded with `gguf.quants.dequantize`.
- Q8_1 and Q8_K are not in `gguf.quants` (and gguf's size table still lists Q8_1 as the old
  40-byte f32 layout; ggml's block_q8_1 is `d: f16, s: f16, qs: [i8; 32]`, 36 bytes). Q8_1 is
  built from a gguf Q8_0 quantization (same `d` and `qs` as ggml's quantize_row_q8_1_ref) with
  `s = d * sum(qs)` inserted, and its expected values are gguf's Q8_0 dequantization of the
  same `d`/`qs`. Q8_K (`d: f32, qs: [i8; 256], bsums: [i16; 16]`, ggml dequantize_row_q8_K:
  `d * q`) is checked against the one numpy multiply `float32(d) * float32(q)`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "quant"
SEED = 20240611

# ggml's sizes where gguf's Python table disagrees with ggml-common.h.
GGML_SIZES = {T.Q8_1: (32, 36)}

# Byte offsets of the f16 fields of each K super-block (ggml-common.h).
K_SCALE_FIELDS = {
    T.Q2_K: [80, 82],  # d, dmin (after scales[16], qs[64])
    T.Q3_K: [108],  # d (after hmask[32], qs[64], scales[12])
    T.Q4_K: [0, 2],  # d, dmin
    T.Q5_K: [0, 2],  # d, dmin
    T.Q6_K: [208],  # d (after ql[128], qh[64], scales[16])
}


def sizes(qtype: T) -> tuple[int, int]:
    return GGML_SIZES.get(qtype, GGML_QUANT_SIZES[qtype])


def random_values(rng: np.random.Generator, n_blocks: int, block: int) -> np.ndarray:
    """Normal values, each block at its own magnitude, plus a zero and a constant block."""
    mags = 10.0 ** rng.uniform(-3, 2, size=(n_blocks, 1))
    x = (rng.standard_normal((n_blocks, block)) * mags).astype(np.float32)
    x[0] = 0.0
    x[1] = np.float32(-0.75)
    return x.reshape(-1)


def random_f16_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 values of moderate magnitude (1e-4 .. 1), either sign."""
    mag = 10.0 ** rng.uniform(-4, 0, size=n)
    sign = rng.choice([-1.0, 1.0], size=n)
    return (mag * sign).astype(np.float16)


def quantized_fixture(rng: np.random.Generator, qtype: T, n_blocks: int) -> tuple[np.ndarray, np.ndarray, str]:
    x = random_values(rng, n_blocks, sizes(qtype)[0])
    blocks = quants.quantize(x.reshape(1, -1), qtype).reshape(-1)
    expected = quants.dequantize(blocks, qtype)
    return blocks, expected, "gguf.quants.quantize of random floats, gguf.quants.dequantize"


def float_fixture(rng: np.random.Generator, qtype: T, n: int) -> tuple[np.ndarray, np.ndarray, str]:
    x = random_values(rng, n // 32, 32)
    blocks = np.ascontiguousarray(quants.quantize(x, qtype)).view(np.uint8).reshape(-1)
    expected = quants.dequantize(blocks, qtype)
    return blocks, expected, "random floats, gguf.quants.dequantize"


def k_fixture(rng: np.random.Generator, qtype: T, n_blocks: int) -> tuple[np.ndarray, np.ndarray, str]:
    _, size = sizes(qtype)
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    blocks[0] = 0xFF  # all quant and scale bits set
    for off in K_SCALE_FIELDS[qtype]:
        blocks[:, off : off + 2] = random_f16_scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    blocks = blocks.reshape(-1)
    expected = quants.dequantize(blocks, qtype)
    return blocks, expected, "random raw blocks with sane f16 scales, gguf.quants.dequantize"


def q8_1_fixture(rng: np.random.Generator, n_blocks: int) -> tuple[np.ndarray, np.ndarray, str]:
    x = random_values(rng, n_blocks, 32)
    q8_0 = quants.quantize(x.reshape(1, -1), T.Q8_0).reshape(n_blocks, 34)
    d = q8_0[:, :2].copy().view(np.float16).astype(np.float32)
    qs = q8_0[:, 2:]
    s = (d[:, 0] * qs.view(np.int8).astype(np.float32).sum(axis=1)).astype(np.float16)
    blocks = np.concatenate([q8_0[:, :2], s.view(np.uint8).reshape(n_blocks, 2), qs], axis=1).reshape(-1)
    expected = quants.dequantize(q8_0.reshape(-1), T.Q8_0)
    return blocks, expected, "gguf Q8_0 quantization with s = d*sum(qs) inserted; gguf Q8_0 dequantize"


def q8_k_fixture(rng: np.random.Generator, n_blocks: int) -> tuple[np.ndarray, np.ndarray, str]:
    d = (rng.uniform(1e-4, 1e-1, size=n_blocks) * rng.choice([-1.0, 1.0], size=n_blocks)).astype(np.float32)
    qs = rng.integers(-128, 128, size=(n_blocks, 256), dtype=np.int8)
    bsums = qs.astype(np.int16).reshape(n_blocks, 16, 16).sum(axis=2, dtype=np.int16)
    blocks = np.concatenate(
        [d.astype("<f4").view(np.uint8).reshape(n_blocks, 4), qs.view(np.uint8), bsums.astype("<i2").view(np.uint8)],
        axis=1,
    ).reshape(-1)
    expected = d[:, None] * qs.astype(np.float32)
    return blocks, expected, "random blocks; numpy float32(d) * float32(q) (gguf has no Q8_K)"


def write(qtype: T, blocks: np.ndarray, expected: np.ndarray, reference: str) -> int:
    block_elems, block_bytes = sizes(qtype)
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1)
    expected = np.ascontiguousarray(expected, dtype=np.float32).reshape(-1)
    n_blocks = blocks.size // block_bytes
    assert blocks.size == n_blocks * block_bytes, qtype.name
    assert expected.size == n_blocks * block_elems, qtype.name
    assert np.isfinite(expected).all(), qtype.name
    fixture = {
        "dtype": qtype.name,
        "ggml_type": int(qtype),
        "block_elems": block_elems,
        "block_bytes": block_bytes,
        "n_blocks": n_blocks,
        "reference": reference,
        "blocks_hex": blocks.tobytes().hex(),
        "expected_f32_hex": expected.astype("<f4").tobytes().hex(),
    }
    path = OUT / f"{qtype.name}.json"
    text = json.dumps(fixture, indent=1) + "\n"
    path.write_text(text)
    return len(text)


def main() -> None:
    rng = np.random.default_rng(SEED)
    OUT.mkdir(parents=True, exist_ok=True)
    fixtures = []
    for qtype in (T.F16, T.BF16):
        fixtures.append((qtype, float_fixture(rng, qtype, 128)))
    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        fixtures.append((qtype, quantized_fixture(rng, qtype, 8)))
    fixtures.append((T.Q8_1, q8_1_fixture(rng, 8)))
    for qtype in K_SCALE_FIELDS:
        fixtures.append((qtype, k_fixture(rng, qtype, 4)))
    fixtures.append((T.Q8_K, q8_k_fixture(rng, 3)))

    total = 0
    for qtype, (blocks, expected, reference) in fixtures:
        size = write(qtype, blocks, expected, reference)
        total += size
        print(f"{qtype.name:5} {size:7} bytes")
    print(f"total {total} bytes in {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
