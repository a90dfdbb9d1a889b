#!/usr/bin/env python3
"""Tiny random-weight hybrid linear-attention models (qwen3_5_text, qwen3_next): transformers' reference
outputs plus a GGUF of the same weights as llama.cpp's converter lays them out (hybrid_gguf.py).

How to run (from the repository root):

    /work/venv/bin/python scripts/goldens/make_hybrid_models.py              # every fixture below
    /work/venv/bin/python scripts/goldens/make_hybrid_models.py qwen3.5      # only the named ones

Same recipe and reference.json format as make_tiny_models.py (whose helpers this imports): the same three
prompts (lengths 5, 17, 40), prompt logits of every position from one forward pass (transformers runs its
chunked gated-delta scan there), 32 greedy tokens with a cache (prefill, then the one-token recurrent
update), checked against generate() and a no-cache re-run; f32, eager attention, deterministic seed search.

Weights (larger spread than transformers' init, so greedy decoding is not decided by float noise):
embeddings N(0, 0.5), linears N(0, 0.15), untied lm_head N(0, 0.5); the zero-centred RMSNorms (applied as
1 + w) N(0, 0.1); the DeltaNet output norm (applied as w) 1 + N(0, 0.1); the depthwise conv N(0, 0.4);
A_log = log U(0.05, 1) (slow decay: the state remembers many tokens); dt_bias N(0, 0.5); MoE experts
N(0, 0.15), routers N(0, 0.25), the shared expert's gate N(0, 0.3).

A seed is accepted when every greedy step of every prompt has a top-1/top-2 logit margin >= 0.02, each
continuation has >= 4 distinct tokens, the model run in float64 picks the same 32 greedy tokens for every
prompt and gives prompt logits within 5e-5 (relative to max(|logit|, 1)) of the float32 ones (so neither the
tokens nor the 1e-4 logit tolerance of the Rust tests are decided by float32 noise), and (MoE) the k-th and (k+1)-th router
probabilities differ by >= 1e-5 in every reference forward.

Fixtures (vocab 307, hidden 64, 4 attention heads, 2 KV heads, head_dim 16, partial rotary 0.25 (4 dims),
linear attention 2 key heads of 16, 4 value heads of 8 (two value heads per key head), conv kernel 4,
rms_norm_eps 1e-6, bos 1, eos 306, untied):
  qwen3.5    Qwen3_5TextConfig, 4 layers: linear, linear, full, linear; intermediate_size 96.
             GGUF arch qwen35 (value heads tiled over key heads, A stored as -exp(A_log)).
  qwen3-next Qwen3NextConfig, 4 layers: linear, full, linear, full; layer 1 a dense MLP (mlp_only_layers),
             the others 8 experts, top-2, moe_intermediate_size 16, norm_topk_prob, a shared expert of
             width 24 with a sigmoid gate. GGUF arch qwen3next (in_proj_qkvz split into attn_qkv/attn_gate,
             in_proj_ba kept grouped as ssm_ba).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_moe_models import MIN_ROUTER_GAP, is_router  # noqa: E402
from make_tiny_models import (  # noqa: E402
    BOS,
    EOS,
    N_NEW,
    OUT_DIR,
    VOCAB,
    full_logits,
    greedy_cached,
    make_prompts,
    write_fixture,
)
from hybrid_gguf import write_hybrid_gguf  # noqa: E402
from transformers import Qwen3_5TextConfig, Qwen3NextConfig  # noqa: E402

GENERATOR = "scripts/goldens/make_hybrid_models.py"
MAX_F64_ERROR = 5e-5

SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=None,
    tie_word_embeddings=False,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
)

L, F = "linear_attention", "full_attention"


def configs():
    return {
        "qwen3.5": (
            Qwen3_5TextConfig(**SHAPE, intermediate_size=96, num_hidden_layers=4, layer_types=[L, L, F, L]),
            41000,
        ),
        "qwen3-next": (
            Qwen3NextConfig(
                **SHAPE,
                intermediate_size=96,
                num_hidden_layers=4,
                layer_types=[L, F, L, F],
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=24,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[1],
            ),
            42000,
        ),
    }


@torch.no_grad()
def init_hybrid_weights(model, seed: int):
    torch.manual_seed(seed)
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if isinstance(mod, torch.nn.Embedding):
            mod.weight.normal_(0.0, 0.5)
        elif isinstance(mod, torch.nn.Linear):
            if name == "lm_head":
                mod.weight.normal_(0.0, 0.5)
            elif name.endswith("shared_expert_gate"):
                mod.weight.normal_(0.0, 0.3)
            elif is_router(mod):
                mod.weight.normal_(0.0, 0.25)
            else:
                mod.weight.normal_(0.0, 0.15)
        elif isinstance(mod, torch.nn.Conv1d):
            mod.weight.normal_(0.0, 0.4)
        elif cls.endswith("RMSNormGated"):
            mod.weight.copy_(1.0 + 0.1 * torch.randn_like(mod.weight))
        elif "RMSNorm" in cls:
            mod.weight.normal_(0.0, 0.1)
        elif is_router(mod):
            mod.weight.normal_(0.0, 0.25)
        elif cls.endswith("Experts"):
            mod.gate_up_proj.normal_(0.0, 0.15)
            mod.down_proj.normal_(0.0, 0.15)
        if cls.endswith("GatedDeltaNet"):
            mod.A_log.copy_(torch.empty_like(mod.A_log).uniform_(0.05, 1.0).log())
            mod.dt_bias.normal_(0.0, 0.5)


def router_gap(model, prompts):
    gaps = []

    def hook(mod, _inp, out):
        probs = torch.softmax(out[0].float(), dim=-1)
        top = torch.topk(probs, mod.top_k + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if is_router(m)]
    try:
        for p in prompts:
            full_logits(model, p)
            greedy_cached(model, p, N_NEW)
    finally:
        for h in handles:
            h.remove()
    return min(gaps) if gaps else float("inf")


def f64_agrees(model, prompts) -> bool:
    """The model in float64 picks the same greedy tokens as in float32 on every prompt, and its prompt
    logits are within MAX_F64_ERROR (relative to max(|logit|, 1)) of the float32 ones: a fixture where
    float32 rounding alone moves a logit near the Rust tests' 1e-4 tolerance is refused."""
    want = [greedy_cached(model, p, N_NEW)[0] for p in prompts]
    want_logits = [full_logits(model, p).double() for p in prompts]
    # torch's grouped expert matmul has no float64 kernel: the experts run as plain loops.
    experts = model.config._experts_implementation
    model.config._experts_implementation = "eager"
    model.double()
    try:
        got = [greedy_cached(model, p, N_NEW)[0] for p in prompts]
        got_logits = [full_logits(model, p) for p in prompts]
    finally:
        model.float()
        model.config._experts_implementation = experts
    error = max(float(((a - b).abs() / b.abs().clamp(min=1.0)).max()) for a, b in zip(want_logits, got_logits))
    print(f"   f64: same tokens {got == want}, largest logit error {error:.2e}", file=sys.stderr, flush=True)
    return got == want and error <= MAX_F64_ERROR


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
            return f64_agrees(m, prompts) and router_gap(m, prompts) >= MIN_ROUTER_GAP

        summary[name] = write_fixture(name, config, base_seed, prompts, GENERATOR, init_hybrid_weights, accept)
        summary[name]["bytes"] += write_hybrid_gguf(OUT_DIR / name)
    total = sum(v["bytes"] for v in summary.values())
    print(f"total {total} bytes", file=sys.stderr)
    assert not wanted - summary.keys(), f"unknown fixtures {wanted - summary.keys()}"


if __name__ == "__main__":
    main()
