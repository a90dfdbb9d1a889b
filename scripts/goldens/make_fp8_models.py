#!/usr/bin/env python3
"""Tiny random-weight models quantized to FP8 (e4m3) by compressed-tensors, saved as the FP8
checkpoints users download, with transformers' outputs on the dequantized weights as the reference.

How to run (from the repository root):

    pip install torch transformers==5.17.0 safetensors numpy compressed-tensors==0.20.1
    python scripts/goldens/make_fp8_models.py              # writes tests/fixtures/models/fp8-*/
    python scripts/goldens/make_fp8_models.py fp8-llama-block   # only the named fixtures

The quantization is compressed-tensors' own (the library llm-compressor writes FP8 checkpoints with):
`calculate_qparams` on the per-strategy min/max gives the symmetric scales (amax / 448), `quantize`
the e4m3 codes (`torch.float8_e4m3fn`), `dequantize` the float32 weights the reference model holds.
Every linear layer of the decoder is quantized; the embedding, the norms and the LM head stay in
float32 (compressed-tensors' usual `ignore: ["lm_head"]`).

Checkpoint layouts written (each module: `weight` F8_E4M3 `[out, in]` plus its scale, float32):
  fp8-llama-channel   compressed-tensors, strategy channel: `weight_scale` `[out, 1]`; dynamic per-token
                      activations (the `-FP8-dynamic` checkpoints)
  fp8-llama-tensor    compressed-tensors, strategy tensor: `weight_scale` `[1]`
  fp8-llama-block     transformers' fine-grained FP8 (`quant_method: fp8`, `weight_block_size` [128, 128]):
                      `weight_scale_inv` `[ceil(out / 128), ceil(in / 128)]` (k/v projections of 64 rows
                      make partial blocks)
  fp8-qwen2-channel   qwen2 (q/k/v biases, kept in float32), compressed-tensors channel

reference.json also holds `w8a8_logits`: the same prompts' logits with every quantized linear's input
quantized as ferrite's FP8 GEMM does for many-token steps (per token: scale max|x| / 448, codes
`float8_e4m3fn` rounded to nearest even, then `codes · scale`), the reference of the GPU's prefill.

Everything else follows make_tiny_models.py (llama dims of make_mlx_models.py: vocab 307, hidden 128,
intermediate 256, 2 layers, 4 heads of 32, 2 KV heads, untied): the same prompts, logits of every
prompt position, 32 greedy tokens, f32, eager attention, the seed search with MIN_MARGIN 0.05.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_mlx_models import COMMON  # noqa: E402
from make_tiny_models import OUT_DIR, finish_rewritten, init_weights, r6list, run_quantized, write_fixture  # noqa: E402
from transformers import LlamaConfig, Qwen2Config  # noqa: E402

GENERATOR = "scripts/goldens/make_fp8_models.py"


def fixtures():
    """name -> (config, base seed, strategy, checkpoint layout: "ct" compressed-tensors or "hf")."""
    llama = LlamaConfig(**COMMON)
    qwen2 = Qwen2Config(**{k: v for k, v in COMMON.items() if k != "head_dim"}, use_sliding_window=False)
    return {
        "fp8-llama-channel": (llama, 31000, "channel", "ct"),
        "fp8-llama-tensor": (llama, 32000, "tensor", "ct"),
        "fp8-llama-block": (llama, 33000, "block", "hf"),
        "fp8-qwen2-channel": (qwen2, 34000, "channel", "ct"),
    }


def args_for(strategy: str) -> QuantizationArgs:
    extra = {"block_structure": [128, 128]} if strategy == "block" else {}
    return QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False, **extra)


def minmax(w: torch.Tensor, strategy: str):
    """Per-strategy min and max of a float32 [out, in] matrix, shaped as the scales are."""
    if strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    out, k = w.shape
    rb, cb = -(-out // 128), -(-k // 128)
    lo = torch.empty(rb, cb)
    hi = torch.empty(rb, cb)
    for i in range(rb):
        for j in range(cb):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            lo[i, j], hi[i, j] = tile.amin(), tile.amax()
    return lo, hi


def fp8_quantize(w: torch.Tensor, strategy: str):
    """compressed-tensors' FP8 quantization of a float32 matrix: (codes, scale, dequantized float32)."""
    args = args_for(strategy)
    scale, zp = calculate_qparams(*minmax(w, strategy), args)
    codes = quantize(w, scale, zp, args, dtype=torch.float8_e4m3fn)
    deq = dequantize(codes, scale, zp, args, dtype=torch.float32)
    return codes, scale.float().contiguous(), deq


def quantizing_init(strategy: str, stash: dict):
    """`init(model, seed)`: make_tiny_models' weights, then every decoder linear replaced by its
    dequantized FP8 weights (the codes and scales kept in `stash`)."""

    @torch.no_grad()
    def init(model, seed):
        init_weights(model, seed)
        stash.clear()
        for path, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and path.startswith("model.layers."):
                codes, scale, deq = fp8_quantize(mod.weight.detach().float(), strategy)
                mod.weight.copy_(deq)
                stash[path] = (codes, scale)

    return init


def quantization_config(strategy: str, layout: str) -> dict:
    if layout == "hf":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ["lm_head"],
    }


def per_token_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x quantized per token to e4m3 (scale max|x| / 448, 1 for a zero row) and back."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x / s).to(torch.float8_e4m3fn).float() * s


@torch.no_grad()
def w8a8_logits(d: Path, prompts) -> list:
    """Prompt logits of the saved float model with each decoder linear's input per-token e4m3."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    for path, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and path.startswith("model.layers."):
            mod.register_forward_pre_hook(lambda _m, args: (per_token_e4m3(args[0]),))
    return [[r6list(row) for row in model(torch.tensor([p])).logits[0]] for p in prompts]


def write_fp8_fixture(name, config, base_seed, strategy, layout, prompts):
    stash: dict = {}
    summary = write_fixture(name, config, base_seed, prompts, GENERATOR, init=quantizing_init(strategy, stash))
    d = OUT_DIR / name
    quantized_inputs = w8a8_logits(d, prompts)
    floats = load_file(d / "model.safetensors")
    scale_name = "weight_scale_inv" if layout == "hf" else "weight_scale"
    out = {}
    for key, t in floats.items():
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        if module in stash:
            codes, scale = stash[module]
            # The saved float32 weights are what the codes and scales give (an independent product).
            s = scale
            if strategy == "block":
                s = scale.repeat_interleave(128, 0)[: t.shape[0]].repeat_interleave(128, 1)[:, : t.shape[1]]
            assert torch.equal(codes.float() * s, t), f"{name}: {key} dequantizes differently"
            out[key] = codes
            out[f"{module}.{scale_name}"] = scale
        else:
            out[key] = t
    (d / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in sorted(out.items())}, d / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(strategy, layout)
    cfg["dtype"] = "float32"
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    ref = json.loads((d / "reference.json").read_text())
    ref["meta"]["fp8"] = {"strategy": strategy, "layout": layout, "tool": "compressed-tensors 0.20.1"}
    ref["w8a8_logits"] = quantized_inputs
    (d / "reference.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n")
    return finish_rewritten(d, name, summary)


def main():
    run_quantized(fixtures(), write_fp8_fixture)


if __name__ == "__main__":
    main()
