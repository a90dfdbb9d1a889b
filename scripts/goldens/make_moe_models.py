#!/usr/bin/env python3
"""Tiny random-weight mixture-of-experts models (qwen3_moe, mixtral): transformers' reference outputs
plus a GGUF of the same weights as llama.cpp's converter names them.

How to run (from the repository root):

    pip install torch transformers==5.24.0 safetensors numpy gguf
    python scripts/goldens/make_moe_models.py              # writes tests/fixtures/models/{qwen3-moe,mixtral}/
    python scripts/goldens/make_moe_models.py mixtral      # only the named fixtures

Same recipe and reference.json format as make_tiny_models.py (whose helpers this imports): the same
three prompts (lengths 5, 17, 40), prompt logits of every position from one forward pass, 32 greedy
tokens with a KV cache (checked against generate() and a no-cache re-run), f32, eager attention,
deterministic seed search with the same margin rule. transformers saves the experts one tensor per
expert and projection (`mlp.experts.E.gate_proj.weight`, Mixtral `block_sparse_moe.experts.E.w1.weight`);
each directory also gets `model.gguf` (scripts/goldens/roster_gguf.py), where the experts of a layer
are stacked into `ffn_{gate,up,down}_exps` and the router is `ffn_gate_inp`.

Weights are make_tiny_models.init_weights (embeddings N(0, 0.5), linears N(0, 0.15), untied lm_head
N(0, 0.5), RMSNorm weights 1 + N(0, 0.1)), plus: experts N(0, 0.15), routers N(0, 0.25) (router logits
of std ~2 over the normed input, so routing is decisive). A seed is accepted only when, over every
reference forward, the k-th and (k+1)-th router probabilities differ by >= 1e-5 (so float noise cannot
flip an expert choice).

Fixtures (vocab 307, hidden 64, 4 heads, 2 KV heads, head_dim 16, bos 1, eos 306, untied):
  qwen3-moe  Qwen3MoeConfig: 3 layers, 8 experts, top-2, moe_intermediate_size 16, norm_topk_prob,
             mlp_only_layers [1]: layer 1 is a dense SwiGLU MLP of intermediate_size 96, layers 0 and 2
             sparse; per-head q/k norms. GGUF arch qwen3moe (llama.cpp itself has no dense layers in a
             qwen3moe file: ferrite reads a layer without `ffn_gate_inp` as dense)
  mixtral    MixtralConfig: 2 layers, 4 experts, top-2, expert width (intermediate_size) 32, rope theta
             1e6. GGUF arch llama with expert tensors, q/k rows permuted as llama.cpp's converter does;
             also `model-q8_0.gguf`, every matrix (stacked experts included) in Q8_0 blocks
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gguf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_models import (  # noqa: E402
    BOS,
    EOS,
    OUT_DIR,
    VOCAB,
    full_logits,
    greedy_cached,
    init_weights,
    make_prompts,
    write_fixture,
)
from roster_gguf import write_gguf  # noqa: E402
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig  # noqa: E402

GENERATOR = "scripts/goldens/make_moe_models.py"
MIN_ROUTER_GAP = 1e-5

SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=None,
    tie_word_embeddings=False,
)


def configs():
    return {
        "qwen3-moe": (
            Qwen3MoeConfig(
                **SHAPE,
                intermediate_size=96,
                num_hidden_layers=3,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[1],
                rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            ),
            31000,
        ),
        "mixtral": (
            MixtralConfig(
                **SHAPE,
                intermediate_size=32,
                num_hidden_layers=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            ),
            32000,
        ),
    }


def is_router(mod) -> bool:
    return type(mod).__name__.endswith("TopKRouter")


@torch.no_grad()
def init_moe_weights(model, seed: int):
    init_weights(model, seed)
    for mod in model.modules():
        if is_router(mod):
            mod.weight.normal_(0.0, 0.25)
        elif hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj") and type(mod).__name__.endswith("Experts"):
            mod.gate_up_proj.normal_(0.0, 0.15)
            mod.down_proj.normal_(0.0, 0.15)


def router_gap(model, prompts, decode=True):
    """Smallest gap between the k-th and (k+1)-th router probability over all reference forwards
    (the prompts' prefills, and with `decode` their greedy continuations)."""
    gaps = []

    def hook(mod, _inp, out):
        probs = torch.softmax(out[0].float(), dim=-1)
        top = torch.topk(probs, mod.top_k + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if is_router(m)]
    try:
        for p in prompts:
            full_logits(model, p)
            if decode:
                greedy_cached(model, p, 32)
    finally:
        for h in handles:
            h.remove()
    assert gaps, "no router ran"
    return min(gaps)


@torch.no_grad()
def renormalize_effect(prompts):
    """How much switching norm_topk_prob off moves the saved qwen3-moe's logits on the longest prompt."""
    load = lambda: AutoModelForCausalLM.from_pretrained(OUT_DIR / "qwen3-moe", dtype=torch.float32, attn_implementation="eager").eval()  # noqa: E731
    longest = max(prompts, key=len)
    base = full_logits(load(), longest)
    model = load()
    for mod in model.modules():
        if is_router(mod):
            mod.norm_topk_prob = False
    return float((full_logits(model, longest) - base).abs().max())


def main():
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    torch.use_deterministic_algorithms(True)
    prompts = make_prompts()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    wanted = set(sys.argv[1:])
    summary = {}
    for name, (config, base_seed) in configs().items():
        if wanted and name not in wanted:
            continue

        def accept(m):
            return router_gap(m, prompts) >= MIN_ROUTER_GAP

        summary[name] = write_fixture(name, config, base_seed, prompts, GENERATOR, init_moe_weights, accept)
        if name == "qwen3-moe":
            effect = renormalize_effect(prompts)
            assert effect > 1e-2, f"norm_topk_prob does not change the logits ({effect})"
            print(f"   switching norm_topk_prob off moves the longest prompt's logits by up to {effect}", file=sys.stderr)
        summary[name]["bytes"] += write_gguf(name, OUT_DIR / name)
        if name == "mixtral":
            summary[name]["bytes"] += write_gguf(name, OUT_DIR / name, gguf.GGMLQuantizationType.Q8_0, "model-q8_0.gguf")
    total = sum(v["bytes"] for v in summary.values())
    print(f"total {total} bytes", file=sys.stderr)
    assert not wanted - summary.keys(), f"unknown fixtures {wanted - summary.keys()}"


if __name__ == "__main__":
    main()
