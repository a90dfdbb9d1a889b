#!/usr/bin/env python3
"""Tiny random-weight models quantized with MLX's affine scheme, saved as MLX checkpoints
(the layout of the mlx-community safetensors), with transformers' outputs on the dequantized
weights as the reference.

How to run (from the repository root):

    pip install torch transformers==5.17.0 safetensors numpy
    python scripts/goldens/make_mlx_models.py              # writes tests/fixtures/models/mlx-*/
    python scripts/goldens/make_mlx_models.py mlx-llama-q4-g64   # only the named fixtures

MLX itself is not used: its affine quantization is re-implemented here in numpy from the format's
definition (the `mlx.core.quantize` documentation). For each group of `group_size` consecutive values
of a row:

    bias  = min(w)                                  beta in MLX's notation
    scale = max((max(w) - min(w)) / (2^bits - 1), 1e-7)   (MLX keeps an all-equal group finite)
    q     = clip(round_half_even((w - bias) / scale), 0, 2^bits - 1)

computed in float32; scale and bias are then stored in the checkpoint's float type (bf16 as MLX writes
for a bf16 model, f16 or f32 for some fixtures), and the codes packed into uint32 words from the lowest
bits up (4-bit: 8 codes a word, value 0 in bits 0..3; 8-bit: 4 a word). A module's `weight` is the words
`[out, in * bits / 32]`, `scales` and `biases` are `[out, in / group_size]`. Every nn.Linear and the
embedding are quantized (the LM head too when untied), unless the config says otherwise.

The reference model holds the dequantized weights, `float32(scale) * q + float32(bias)` in float32 (the
product of a 16-bit scale and a code is exact, so this is the value whatever the evaluation order), and
the norm weights rounded to the checkpoint's float type, as they are stored. Everything else follows
make_tiny_models.py (whose helpers this imports): the same three prompts (lengths 5, 17, 40), prompt
logits of every position from one forward pass, 32 greedy tokens with a KV cache, f32, eager attention,
and the deterministic seed search, here with a larger top-1/top-2 margin (MIN_MARGIN 0.05) so the greedy
tokens also hold through ferrite's fast kernels, which quantize activations to 14 or 15 bits.

config.json carries `quantization` and the same object as `quantization_config`, as mlx-lm writes them:
`{"group_size": G, "bits": B, "mode": "affine"}` plus an entry per module path that differs, its own
`{"group_size", "bits"}` or `false` (left in floats). The safetensors metadata says `format: mlx`.

Fixtures (llama: vocab 307, hidden 128, intermediate 256, 2 layers, 4 heads of 32, 2 KV heads, untied;
every width a multiple of 128 so each group size divides every matrix):
  mlx-llama-q4-g32    4-bit, groups of 32, bf16 scales
  mlx-llama-q4-g64    4-bit, groups of 64, bf16 scales (mlx-lm's default)
  mlx-llama-q4-g128   4-bit, groups of 128, f16 scales
  mlx-llama-q8-g32    8-bit, groups of 32, f32 scales
  mlx-llama-q8-g64    8-bit, groups of 64, bf16 scales
  mlx-llama-q8-g128   8-bit, groups of 128, bf16 scales
  mlx-llama-mixed     4-bit g64 by default; embed_tokens 4-bit g32, layer 0 down_proj 8-bit g32, lm_head
                      8-bit g128, layer 1 v_proj left in bf16 (`false`)
  mlx-qwen3-q4-g64    qwen3 (per-head q/k norms), tied embeddings: the quantized embedding is the head
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_models import BOS, EOS, OUT_DIR, VOCAB, finish_rewritten, init_weights, run_quantized, write_fixture  # noqa: E402
from transformers import LlamaConfig, Qwen3Config  # noqa: E402

GENERATOR = "scripts/goldens/make_mlx_models.py"

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=BOS,
    eos_token_id=EOS,
    tie_word_embeddings=False,
)

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def fixtures():
    """name -> (config, base seed, quantization object, scale dtype)."""
    llama = LlamaConfig(**COMMON)
    qwen3 = Qwen3Config(**{**COMMON, "tie_word_embeddings": True, "use_sliding_window": False, "attention_bias": False})

    def q(bits, group, **modules):
        return {"group_size": group, "bits": bits, "mode": "affine", **modules}

    return {
        "mlx-llama-q4-g32": (llama, 21000, q(4, 32), "bf16"),
        "mlx-llama-q4-g64": (llama, 22000, q(4, 64), "bf16"),
        "mlx-llama-q4-g128": (llama, 23000, q(4, 128), "f16"),
        "mlx-llama-q8-g32": (llama, 24000, q(8, 32), "f32"),
        "mlx-llama-q8-g64": (llama, 25000, q(8, 64), "bf16"),
        "mlx-llama-q8-g128": (llama, 26000, q(8, 128), "bf16"),
        "mlx-llama-mixed": (
            llama,
            27000,
            q(
                4,
                64,
                **{
                    "model.embed_tokens": {"group_size": 32, "bits": 4},
                    "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
                    "model.layers.1.self_attn.v_proj": False,
                    "lm_head": {"group_size": 128, "bits": 8},
                },
            ),
            "bf16",
        ),
        "mlx-qwen3-q4-g64": (qwen3, 28000, q(4, 64), "bf16"),
    }


def mlx_quantize(w: np.ndarray, bits: int, group: int, scale_dtype: str):
    """MLX affine quantization of a float32 [out, in] matrix (see the module docs): the packed words,
    the stored scales and biases (torch, in `scale_dtype`) and the dequantized float32 matrix."""
    out, k = w.shape
    assert k % group == 0, (w.shape, group)
    levels = (1 << bits) - 1
    g = w.reshape(out, k // group, group).astype(np.float32)
    lo, hi = g.min(axis=2), g.max(axis=2)
    scale = np.maximum((hi - lo) / np.float32(levels), np.float32(1e-7)).astype(np.float32)
    q = np.clip(np.rint((g - lo[..., None]) / scale[..., None]), 0, levels).astype(np.uint32)
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    words = (q.reshape(out, k // per, per) << shifts).sum(axis=2, dtype=np.uint64).astype(np.uint32)
    scales = torch.from_numpy(scale).to(TORCH_DTYPES[scale_dtype])
    biases = torch.from_numpy(lo.astype(np.float32)).to(TORCH_DTYPES[scale_dtype])
    s32, b32 = scales.float().numpy(), biases.float().numpy()
    deq = (s32[..., None] * q.astype(np.float32) + b32[..., None]).astype(np.float32).reshape(out, k)
    return torch.from_numpy(words), scales, biases, deq


def mlx_dequantize(words: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int):
    """The inverse read of a saved module, written independently of `mlx_quantize` (a self-check)."""
    out = words.shape[0]
    per = 32 // bits
    codes = np.stack([(words >> np.uint32(bits * i)) & np.uint32((1 << bits) - 1) for i in range(per)], axis=2)
    codes = codes.reshape(out, -1).astype(np.float32)
    s = np.repeat(scales.astype(np.float32), group, axis=1)
    b = np.repeat(biases.astype(np.float32), group, axis=1)
    return (s * codes + b).astype(np.float32)


def module_params(quant: dict, path: str):
    """(bits, group) of module `path`, or None when it stays in floats."""
    entry = quant.get(path, True)
    if entry is False:
        return None
    if isinstance(entry, dict):
        return entry["bits"], entry["group_size"]
    return quant["bits"], quant["group_size"]


def quantizing_init(quant: dict, scale_dtype: str, stash: dict):
    """`init(model, seed)` for the seed search: make_tiny_models' weights, then every quantized module
    replaced by its dequantized weights (the MLX tensors kept in `stash`), the rest rounded to the
    checkpoint's float type."""

    @torch.no_grad()
    def init(model, seed):
        init_weights(model, seed)
        stash.clear()
        tied = model.config.tie_word_embeddings
        for path, mod in model.named_modules():
            if not isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
                continue
            if path == "lm_head" and tied:
                continue
            params = module_params(quant, path)
            if params is None:
                mod.weight.copy_(mod.weight.to(TORCH_DTYPES[scale_dtype]).float())
                stash[f"{path}.weight"] = mod.weight.detach().to(TORCH_DTYPES[scale_dtype]).clone()
                continue
            words, scales, biases, deq = mlx_quantize(mod.weight.detach().numpy(), *params, scale_dtype)
            mod.weight.copy_(torch.from_numpy(deq))
            stash[f"{path}.weight"] = words
            stash[f"{path}.scales"] = scales
            stash[f"{path}.biases"] = biases
        for path, p in model.named_parameters():
            if f"{path}" in stash or path.endswith((".scales", ".biases")):
                continue
            if path == "lm_head.weight" and tied:
                continue
            if path.endswith("weight") and p.dim() == 1:
                p.copy_(p.to(TORCH_DTYPES[scale_dtype]).float())
                stash[path] = p.detach().to(TORCH_DTYPES[scale_dtype]).clone()

    return init


def write_mlx_fixture(name, config, base_seed, quant, scale_dtype, prompts):
    stash: dict = {}
    summary = write_fixture(name, config, base_seed, prompts, GENERATOR, init=quantizing_init(quant, scale_dtype, stash))
    d = OUT_DIR / name
    # The saved float32 model (what the reference ran) against an independent read of the MLX tensors.
    from safetensors.torch import load_file

    floats = load_file(d / "model.safetensors")
    for key, t in floats.items():
        module = key[: -len(".weight")]
        if f"{module}.scales" in stash:
            params = module_params(quant, module)
            deq = mlx_dequantize(
                stash[key].numpy(), stash[f"{module}.scales"].float().numpy(), stash[f"{module}.biases"].float().numpy(), *params
            )
            assert np.array_equal(deq, t.numpy()), f"{name}: {key} dequantizes differently"
        else:
            assert torch.equal(stash[key].float(), t), f"{name}: {key} differs"
    assert set(floats) | {k for k in stash if k.endswith((".scales", ".biases"))} == set(stash), name
    (d / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in sorted(stash.items())}, d / "model.safetensors", metadata={"format": "mlx"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization"] = quant
    cfg["quantization_config"] = quant
    cfg["dtype"] = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[scale_dtype]
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    ref = json.loads((d / "reference.json").read_text())
    ref["meta"]["mlx"] = {"quantization": quant, "scale_dtype": scale_dtype}
    (d / "reference.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n")
    return finish_rewritten(d, name, summary)


def main():
    run_quantized(fixtures(), write_mlx_fixture)


if __name__ == "__main__":
    main()
