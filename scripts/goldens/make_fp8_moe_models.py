#!/usr/bin/env python3
"""A tiny random-weight Qwen3-MoE checkpoint in transformers' fine-grained FP8 format (the
DeepSeek/Qwen3 `-FP8` checkpoints: every expert and attention projection e4m3 with block scales),
with transformers' outputs on the dequantized weights as the reference.

How to run (from the repository root):

    pip install torch transformers==5.24.0 safetensors numpy
    python scripts/goldens/make_fp8_moe_models.py         # writes tests/fixtures/models/fp8-qwen3-moe-block/

The checkpoint layout is transformers' `quant_method: fp8` with `weight_block_size` [64, 64] (the
published checkpoints use [128, 128]; 64 gives this small model's gate and up projections two scale
blocks along a row, and its down projections, 32 columns wide, one block wider than the row): each
quantized module stores `weight` F8_E4M3 `[out, in]` and `weight_scale_inv` float32
`[ceil(out / 64), ceil(in / 64)]`, a multiplier despite its name. Quantized: the attention q/k/v/o
projections and every expert's gate/up/down (`mlp.experts.E.{gate,up,down}_proj`, one tensor per
expert as the published checkpoints store them); the embedding, the norms, the routers
(`mlp.gate`) and the LM head stay float32, as in Qwen3-30B-A3B-FP8. The quantization is
DeepSeek's block recipe: scale = max|w| / 448 over the block, codes `(w / scale)` cast to
`torch.float8_e4m3fn` (round to nearest even), the model's weights then `codes · scale` in float32
(one rounding, as ferrite's CPU dequantizes them).

Everything else follows make_moe_models.py's qwen3-moe fixture (its weight init and router margin
rule, 1e-5 over every reference forward; here also 3e-3 over the 5-token prompt's prefill, so that
the GPU's bf16 activations route it as the CPU's f32 ones and cuda_goldens asserts it rather than
measuring it; `moe_route_margins.py` reports every prompt's margin) and make_tiny_models.py (the same prompts, logits of every prompt position, 32 greedy tokens, f32,
eager attention, the seed search with the quantized fixtures' MIN_MARGIN 0.05):
  fp8-qwen3-moe-block  Qwen3MoeConfig: vocab 307, hidden 128, 4 heads of 32, 2 KV heads, 2 layers,
                       both sparse, 4 experts, top-2, moe_intermediate_size 32, norm_topk_prob
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_tiny_models  # noqa: E402
from make_moe_models import MIN_ROUTER_GAP, SHAPE, init_moe_weights, router_gap  # noqa: E402
from make_tiny_models import OUT_DIR, finish_rewritten, make_prompts, write_fixture  # noqa: E402
from transformers import Qwen3MoeConfig  # noqa: E402

GENERATOR = "scripts/goldens/make_fp8_moe_models.py"
NAME = "fp8-qwen3-moe-block"
BLOCK = 64
FP8_MAX = 448.0
MIN_PROMPT_ROUTER_GAP = 3e-3


def config() -> Qwen3MoeConfig:
    # make_moe_models' shape with heads twice as wide (hidden 128: two 64-wide scale blocks).
    return Qwen3MoeConfig(
        **{**SHAPE, "hidden_size": 128, "head_dim": 32},
        intermediate_size=96,
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    )


def block_quantize(w: torch.Tensor):
    """A float32 [out, in] matrix in BLOCK x BLOCK blocks: (codes, scale_inv, dequantized float32)."""
    out, k = w.shape
    rb, cb = -(-out // BLOCK), -(-k // BLOCK)
    scale = torch.empty(rb, cb, dtype=torch.float32)
    for i in range(rb):
        for j in range(cb):
            amax = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].abs().amax()
            scale[i, j] = amax / FP8_MAX if amax > 0 else 1.0
    full = scale.repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :k]
    codes = (w / full).to(torch.float8_e4m3fn)
    return codes, scale, codes.float() * full


def quantizing_init(stash: dict):
    """`init(model, seed)`: make_moe_models' weights, then every attention projection and expert
    matrix replaced by its dequantized FP8 weights (codes and scales kept in `stash` by the saved
    module name)."""

    @torch.no_grad()
    def init(model, seed):
        init_moe_weights(model, seed)
        stash.clear()
        for path, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".self_attn." in path:
                codes, scale, deq = block_quantize(mod.weight.float())
                mod.weight.copy_(deq)
                stash[path] = (codes, scale)
            elif path.endswith("mlp.experts"):
                inter = mod.gate_up_proj.shape[1] // 2
                for e in range(mod.gate_up_proj.shape[0]):
                    for proj, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
                        codes, scale, deq = block_quantize(mod.gate_up_proj[e, rows].float())
                        mod.gate_up_proj[e, rows] = deq
                        stash[f"{path}.{e}.{proj}"] = (codes, scale)
                    codes, scale, deq = block_quantize(mod.down_proj[e].float())
                    mod.down_proj[e] = deq
                    stash[f"{path}.{e}.down_proj"] = (codes, scale)

    return init


def main():
    torch.set_num_threads(8)
    torch.use_deterministic_algorithms(True)
    make_tiny_models.MIN_MARGIN = 0.05
    prompts = make_prompts()
    stash: dict = {}
    summary = write_fixture(
        NAME,
        config(),
        35000,
        prompts,
        GENERATOR,
        init=quantizing_init(stash),
        accept=lambda m: router_gap(m, prompts[:1], decode=False) >= MIN_PROMPT_ROUTER_GAP
        and router_gap(m, prompts) >= MIN_ROUTER_GAP,
    )
    d = OUT_DIR / NAME
    floats = load_file(d / "model.safetensors")
    out = {}
    for key, t in floats.items():
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        if module in stash:
            codes, scale = stash[module]
            full = scale.repeat_interleave(BLOCK, 0)[: t.shape[0]].repeat_interleave(BLOCK, 1)[:, : t.shape[1]]
            # The saved float32 weights are what the codes and scales give.
            assert torch.equal(codes.float() * full, t), f"{key} dequantizes differently"
            out[key] = codes
            out[f"{module}.weight_scale_inv"] = scale
        else:
            out[key] = t
    quantized = sum(1 for k in out if k.endswith("weight_scale_inv"))
    assert quantized == 2 * (4 + 4 * 3), f"{quantized} quantized modules"
    (d / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in sorted(out.items())}, d / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": ["lm_head", "gate"],
    }
    cfg["dtype"] = "float32"
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    ref = json.loads((d / "reference.json").read_text())
    ref["meta"]["fp8"] = {"layout": "hf fine-grained", "weight_block_size": [BLOCK, BLOCK]}
    (d / "reference.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n")
    finish_rewritten(d, NAME, summary)


if __name__ == "__main__":
    main()
