#!/usr/bin/env python3
"""Tiny random-weight Gemma models (gemma, gemma2, gemma3_text, gemma4_text) + transformers references.

How to run (from the repository root):

    pip install torch transformers==5.17.0 safetensors numpy
    python scripts/goldens/make_gemma_models.py       # writes tests/fixtures/models/gemma*/
    python scripts/goldens/make_gemma_models.py gemma4-moe    # only the named fixtures

Same recipe and reference.json format as make_tiny_models.py (whose helpers this imports): the same
three prompts (lengths 5, 17, 40), prompt logits of every position from one forward pass, 32 greedy
tokens with a KV cache (checked against generate() and against a no-cache re-run), f32, eager
attention, deterministic seed search. The sliding window is 8, so prompts 1 and 2 (and every greedy
continuation) run past it and the window changes the result.

Weights (untied head: with Gemma's sqrt(width)-scaled embeddings a tied head just echoes the input token):
  - embeddings N(0, 1/width) (unit RMS once scaled), lm_head N(0, 0.5), linears N(0, 0.15)
  - Gemma 1-3 RMSNorm computes x * (1 + w): w ~ N(0, 0.1);
    Gemma 4 RMSNorm computes x * w: w ~ 1 + N(0, 0.1), q/k norms 0.4 x that (the no-scale v_norm and
    router norm have no weight)
  - Gemma 4 decoder `layer_scalar` (a saved buffer): U(0.6, 1.4)
  - Gemma 4 MoE: experts.gate_up_proj / down_proj N(0, 0.15), router.scale and router.per_expert_scale
    1 + N(0, 0.1), router.proj N(0, 2) so routing is decisive: a seed is accepted only when, over
    every reference forward, the k-th and (k+1)-th router probabilities differ by >= 1e-5 (so float
    noise cannot flip an expert choice).
A seed is accepted only when the model is well conditioned (MAX_SENSITIVITY below): random Gemma 4
stacks can amplify float32 rounding to ~1e-4 in the logits, which would make a 1e-4 parity test
measure noise instead of semantics.

Fixtures (all vocab 307, 4 query heads, head_dim 16, eps 1e-6, sliding window 8):
  gemma             GemmaConfig: 2 layers, hidden 64, 2 KV heads, GeGLU 136
  gemma2            Gemma2Config: 2 layers (sliding, full), query_pre_attn_scalar 24,
                    attn_logit_softcapping 10, final_logit_softcapping 15
  gemma3            Gemma3TextConfig: hidden 64, GeGLU 64, 3 layers (sliding, sliding, full) = sliding_window_pattern 3,
                    q/k norm, local rope theta 10000, global rope theta 1e6 with linear scaling x2,
                    query_pre_attn_scalar 32
  gemma4-shared-ple Gemma4TextConfig: hidden 48, GeGLU 32, 5 layers (S, F, S, S, F), global_head_dim 32, proportional rope
                    (partial 0.25) on full layers, num_kv_shared_layers 2 (layer 3 reads layer 2's KV,
                    layer 4 reads layer 1's), per-layer inputs (hidden_size_per_layer_input 8)
  gemma4-kv-eq-v    Gemma4TextConfig: same layers, attention_k_eq_v with num_global_key_value_heads 1,
                    use_double_wide_mlp (the 2 KV-shared layers have a 2x MLP), final softcap 30
  gemma4-moe        Gemma4TextConfig: hidden 48, GeGLU 64, 3 layers (S, S, F), enable_moe_block with 4 experts, top-2,
                    moe_intermediate_size 16 (next to the dense MLP of every layer)
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_models import (  # noqa: E402
    BOS,
    EOS,
    OUT_DIR,
    VOCAB,
    full_logits,
    greedy_cached,
    make_prompts,
    write_fixture,
)
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GemmaConfig,
)

GENERATOR = "scripts/goldens/make_gemma_models.py"
WINDOW = 8
MIN_ROUTER_GAP = 1e-5
# A seed is kept only if float32-sized noise (relative 3e-7 on every layer's output, in a float64
# copy of the model) moves no prompt logit by more than this: the Rust test's 1e-4 tolerance then
# checks the semantics, not how much a random model amplifies rounding.
MAX_SENSITIVITY = 2.5e-5

COMMON = dict(
    vocab_size=VOCAB,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=0,
    tie_word_embeddings=False,
)
S, F = "sliding_attention", "full_attention"


def configs():
    gemma4_layers = [S, F, S, S, F]
    return {
        "gemma": (GemmaConfig(**COMMON, hidden_size=64, intermediate_size=136, num_hidden_layers=2, num_key_value_heads=2), 11000),
        "gemma2": (
            Gemma2Config(
                **COMMON,
                hidden_size=64,
                intermediate_size=136,
                num_hidden_layers=2,
                num_key_value_heads=2,
                sliding_window=WINDOW,
                query_pre_attn_scalar=24,
                attn_logit_softcapping=10.0,
                final_logit_softcapping=15.0,
            ),
            12000,
        ),
        "gemma3": (
            Gemma3TextConfig(
                **COMMON,
                hidden_size=64,
                intermediate_size=64,
                num_hidden_layers=3,
                num_key_value_heads=2,
                sliding_window=WINDOW,
                sliding_window_pattern=3,
                query_pre_attn_scalar=32,
                rope_parameters={
                    F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                    S: {"rope_type": "default", "rope_theta": 10_000.0},
                },
            ),
            13000,
        ),
        "gemma4-shared-ple": (
            Gemma4TextConfig(
                **COMMON,
                hidden_size=48,
                intermediate_size=32,
                num_hidden_layers=5,
                num_key_value_heads=2,
                global_head_dim=32,
                sliding_window=WINDOW,
                layer_types=gemma4_layers,
                num_kv_shared_layers=2,
                hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=VOCAB,
            ),
            14000,
        ),
        "gemma4-kv-eq-v": (
            Gemma4TextConfig(
                **COMMON,
                hidden_size=48,
                intermediate_size=32,
                num_hidden_layers=5,
                num_key_value_heads=2,
                global_head_dim=32,
                num_global_key_value_heads=1,
                attention_k_eq_v=True,
                use_double_wide_mlp=True,
                sliding_window=WINDOW,
                layer_types=gemma4_layers,
                num_kv_shared_layers=2,
                hidden_size_per_layer_input=0,
                final_logit_softcapping=30.0,
            ),
            15000,
        ),
        "gemma4-moe": (
            Gemma4TextConfig(
                **COMMON,
                hidden_size=48,
                intermediate_size=64,
                num_hidden_layers=3,
                num_key_value_heads=2,
                global_head_dim=32,
                sliding_window=WINDOW,
                layer_types=[S, S, F],
                hidden_size_per_layer_input=0,
                enable_moe_block=True,
                num_experts=4,
                top_k_experts=2,
                moe_intermediate_size=16,
            ),
            16000,
        ),
    }


@torch.no_grad()
def init_gemma_weights(model, seed: int):
    torch.manual_seed(seed)
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if isinstance(mod, torch.nn.Embedding):
            # Gemma multiplies embeddings by sqrt(width): keep the scaled rows at unit RMS so the
            # layers are not drowned out by the token embedding.
            mod.weight.normal_(0.0, mod.embedding_dim**-0.5)
        elif isinstance(mod, torch.nn.Linear):
            std = {"lm_head": 0.5}.get(name, 2.0 if name.endswith("router.proj") else 0.15)
            mod.weight.normal_(0.0, std)
            if mod.bias is not None:
                mod.bias.normal_(0.0, 0.1)
        elif cls == "Gemma4RMSNorm":
            # Gemma 4 attends with scale 1 over q/k-normed heads; q/k norm weights near 0.4 put
            # the scores where Gemma 3's 1/sqrt(head_dim) does, so the model does not amplify
            # float rounding (see MAX_SENSITIVITY).
            center = 0.4 if name.endswith(("q_norm", "k_norm")) else 1.0
            if mod.with_scale:
                mod.weight.copy_(center * (1.0 + 0.1 * torch.randn_like(mod.weight)))
        elif "RMSNorm" in cls:
            mod.weight.copy_(0.1 * torch.randn_like(mod.weight))
        elif cls == "Gemma4TextDecoderLayer":
            mod.layer_scalar.copy_(0.6 + 0.8 * torch.rand_like(mod.layer_scalar))
        elif cls == "Gemma4TextExperts":
            mod.gate_up_proj.normal_(0.0, 0.15)
            mod.down_proj.normal_(0.0, 0.15)
        elif cls == "Gemma4TextRouter":
            mod.scale.copy_(1.0 + 0.1 * torch.randn_like(mod.scale))
            mod.per_expert_scale.copy_(1.0 + 0.1 * torch.randn_like(mod.per_expert_scale))


@torch.no_grad()
def sensitivity(model, prompts, trials=3):
    """Largest logit change when every layer's output gets relative noise of 3e-7 (float64 copy)."""
    m64 = copy.deepcopy(model).to(torch.float64)
    if getattr(m64.config, "enable_moe_block", False):
        m64.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    worst = 0.0
    for p in prompts:
        base = m64(torch.tensor([p]), use_cache=False).logits[0]
        for trial in range(trials):
            gen = torch.Generator().manual_seed(trial)

            def noise(_mod, _inp, out):
                return out * (1 + 3e-7 * torch.randn(out.shape, generator=gen, dtype=out.dtype))

            hooks = [layer.register_forward_hook(noise) for layer in m64.model.layers]
            try:
                logits = m64(torch.tensor([p]), use_cache=False).logits[0]
            finally:
                for h in hooks:
                    h.remove()
            worst = max(worst, float((logits - base).abs().max()))
    return worst


def router_gap(model, prompts):
    """Smallest gap between the k-th and (k+1)-th router probability over all reference forwards."""
    gaps = []

    def hook(mod, _inp, out):
        probs = out[0]
        top = torch.topk(probs, mod.config.top_k_experts + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ == "Gemma4TextRouter"]
    try:
        for p in prompts:
            full_logits(model, p)
            greedy_cached(model, p, 32)
    finally:
        for h in handles:
            h.remove()
    return min(gaps) if gaps else float("inf")


@torch.no_grad()
def window_effect(name, prompts):
    """How much lifting the sliding window moves the saved model's logits on the longest prompt."""
    model = AutoModelForCausalLM.from_pretrained(OUT_DIR / name, dtype=torch.float32, attn_implementation="eager").eval()
    if S not in (getattr(model.config, "layer_types", None) or []):
        return None
    longest = max(prompts, key=len)
    windowed = full_logits(model, longest)
    model.config.sliding_window = 1 << 30
    return float((full_logits(model, longest) - windowed).abs().max())


def main():
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    torch.use_deterministic_algorithms(True)
    prompts = make_prompts()
    assert max(len(p) for p in prompts) > WINDOW
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    summary = {}
    wanted = set(sys.argv[1:])
    for name, (config, base_seed) in configs().items():
        if wanted and name not in wanted:
            continue
        moe = getattr(config, "enable_moe_block", False)

        def accept(m, moe=moe):
            return sensitivity(m, prompts) <= MAX_SENSITIVITY and (not moe or router_gap(m, prompts) >= MIN_ROUTER_GAP)

        summary[name] = write_fixture(name, config, base_seed, prompts, GENERATOR, init_gemma_weights, accept)
        effect = window_effect(name, prompts)
        assert effect is None or effect > 1e-2, f"{name}: the sliding window does not change the logits ({effect})"
        print(f"   lifting the window moves the longest prompt's logits by up to {effect}", file=sys.stderr)
    total = sum(v["bytes"] for v in summary.values())
    print(f"total {total} bytes", file=sys.stderr)
    assert all(v["bytes"] < 700_000 for v in summary.values()), "a fixture is over 700 KB"
    assert not wanted - summary.keys(), f"unknown fixtures {wanted - summary.keys()}"


if __name__ == "__main__":
    main()
