#!/usr/bin/env python3
"""Tiny random-weight models of the dense roster (phi3, olmo2, glm4, granite, starcoder2, smollm3):
transformers' reference outputs plus a GGUF of the same weights as llama.cpp's converter names them.

How to run (from the repository root):

    pip install torch transformers==5.17.0 safetensors numpy gguf
    python scripts/goldens/make_roster_models.py            # writes tests/fixtures/models/<family>/
    python scripts/goldens/make_roster_models.py glm4 phi3  # only the named fixtures

Same recipe and reference.json format as make_tiny_models.py (whose helpers this imports): the same
three prompts (lengths 5, 17, 40), prompt logits of every position from one forward pass, 32 greedy
tokens with a KV cache (checked against generate() and a no-cache re-run), f32, eager attention,
deterministic seed search with the same margin rule. Each directory also gets `model.gguf`
(scripts/goldens/roster_gguf.py: F32 tensors, llama.cpp's tensor names, metadata keys and q/k row
order for that arch); scripts/goldens/check_roster_gguf.py compares it with what llama.cpp's own
converter writes.

Weights are make_tiny_models.init_weights (embeddings N(0, 0.5), linears N(0, 0.15), untied lm_head
N(0, 0.5), every bias N(0, 0.1), RMSNorm weights 1 + N(0, 0.1)), then LayerNorm weights 1 + N(0, 0.1)
and LayerNorm biases N(0, 0.1) (starcoder2).

Fixtures (vocab 307, hidden 64, 4 heads, 2 KV heads, head_dim 16, intermediate 136, bos 1, eos 306):
  phi3        2 layers, fused qkv_proj / gate_up_proj, longrope (partial_rotary_factor 0.75: 12 of 16
              dims rotated, 6 short and 6 long factors), original_max_position_embeddings 32,
              max_position_embeddings 128: prompt 2 (40 tokens) and every continuation past 32 use
              the long factors; untied
  olmo2       2 layers, no pre-norms: post_attention_layernorm / post_feedforward_layernorm on the
              sublayer outputs, q_norm / k_norm over the whole projection; untied
  glm4        2 layers, partial rotary 0.5 with interleaved pairs, sandwich norms, fused
              gate_up_proj, q/k/v bias; untied
  granite     2 layers, embedding_multiplier 0.6, residual_multiplier 1.4, attention_multiplier 0.125
              (in place of 1/sqrt(16)), logits_scaling 1.25; tied
  starcoder2  2 layers, LayerNorm with bias, GELU (tanh) MLP c_fc / c_proj, biases everywhere,
              sliding_window 8; tied
  smollm3     4 layers, layer 3 is NoPE (no_rope_layers [1, 1, 1, 0]); tied
"""

from __future__ import annotations

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
    init_weights,
    make_prompts,
    write_fixture,
)
from roster_gguf import write_gguf  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Glm4Config,
    GraniteConfig,
    Olmo2Config,
    Phi3Config,
    SmolLM3Config,
    Starcoder2Config,
)

GENERATOR = "scripts/goldens/make_roster_models.py"
WINDOW = 8

SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=136,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=None,
    tie_word_embeddings=False,
)
RMS = dict(rms_norm_eps=1e-5)
ROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0))

# Phi-3 longrope: factors for the 6 rotated frequency pairs (partial_rotary_factor 0.75 of head_dim 16).
PHI3_SHORT = [1.0, 1.05, 1.2, 1.5, 1.9, 2.4]
PHI3_LONG = [1.0, 1.5, 3.0, 6.0, 12.0, 20.0]


def configs():
    # name -> (config, base seed for the deterministic seed search)
    return {
        "phi3": (
            Phi3Config(
                **{**SHAPE, "max_position_embeddings": 128},
                **RMS,
                original_max_position_embeddings=32,
                rope_parameters=dict(
                    rope_type="longrope",
                    rope_theta=10000.0,
                    partial_rotary_factor=0.75,
                    short_factor=PHI3_SHORT,
                    long_factor=PHI3_LONG,
                ),
            ),
            21000,
        ),
        "olmo2": (Olmo2Config(**SHAPE, **RMS, **ROPE, attention_bias=False), 22000),
        "glm4": (
            Glm4Config(
                **SHAPE,
                **RMS,
                head_dim=16,
                attention_bias=True,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
            ),
            23000,
        ),
        "granite": (
            GraniteConfig(
                **{**SHAPE, "tie_word_embeddings": True},
                **RMS,
                **ROPE,
                # != 1 each; tied, so a small embedding multiplier and a large residual one keep the
                # head from echoing the input token
                embedding_multiplier=0.6,
                residual_multiplier=1.4,
                attention_multiplier=0.125,
                logits_scaling=1.25,
            ),
            24000,
        ),
        "starcoder2": (
            Starcoder2Config(
                **{**SHAPE, "tie_word_embeddings": True},
                **ROPE,
                norm_epsilon=1e-5,
                use_bias=True,
                hidden_act="gelu_pytorch_tanh",
                sliding_window=WINDOW,
            ),
            25000,
        ),
        "smollm3": (
            SmolLM3Config(**{**SHAPE, "num_hidden_layers": 4, "tie_word_embeddings": True}, **RMS, **ROPE),
            26000,
        ),
    }


@torch.no_grad()
def init_roster_weights(model, seed: int):
    """make_tiny_models' init, then LayerNorm weights 1 + N(0, 0.1) and biases N(0, 0.1)."""
    init_weights(model, seed)
    for mod in model.modules():
        if isinstance(mod, torch.nn.LayerNorm):
            mod.weight.copy_(1.0 + 0.1 * torch.randn_like(mod.weight))
            mod.bias.copy_(0.1 * torch.randn_like(mod.bias))


# How each family's distinctive option is switched off, to show that the fixture depends on it:
# (config attribute, neutral value). The saved model is reloaded, the attribute overridden, and the
# longest prompt's logits must move by more than 1e-2.
NEUTRAL = {
    "phi3": ("rope_parameters", "long_factor_as_short"),
    "glm4": ("rope_parameters", "full_rotary"),
    "granite": ("attention_multiplier", 0.25),
    "starcoder2": ("sliding_window", None),
    "smollm3": ("no_rope_layers", [1, 1, 1, 1]),
}


@torch.no_grad()
def option_effect(name, prompts):
    if name not in NEUTRAL:
        return None
    key, value = NEUTRAL[name]

    def load():
        return AutoModelForCausalLM.from_pretrained(OUT_DIR / name, dtype=torch.float32, attn_implementation="eager").eval()

    longest = max(prompts, key=len)
    base = full_logits(load(), longest)
    model = load()
    if value == "long_factor_as_short":
        model.config.rope_parameters["long_factor"] = list(model.config.rope_parameters["short_factor"])
    elif value == "full_rotary":
        model.config.rope_parameters["partial_rotary_factor"] = 1.0
        model = type(model)(model.config).eval()
        model.load_state_dict(load().state_dict())
    elif key == "attention_multiplier":
        for layer in model.model.layers:
            layer.self_attn.scaling = value
    elif key == "no_rope_layers":
        for layer, use in zip(model.model.layers, value):
            layer.self_attn.use_rope = use
    else:
        setattr(model.config, key, value)
    return float((full_logits(model, longest) - base).abs().max())


def main():
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    torch.use_deterministic_algorithms(True)
    prompts = make_prompts()
    assert max(len(p) for p in prompts) > WINDOW
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    wanted = set(sys.argv[1:])
    summary = {}
    for name, (config, base_seed) in configs().items():
        if wanted and name not in wanted:
            continue
        summary[name] = write_fixture(name, config, base_seed, prompts, GENERATOR, init_roster_weights)
        effect = option_effect(name, prompts)
        if effect is not None:
            assert effect > 1e-2, f"{name}: switching its option off does not change the logits ({effect})"
            print(f"   switching {NEUTRAL[name][0]} off moves the longest prompt's logits by up to {effect}", file=sys.stderr)
        gguf_bytes = write_gguf(name, OUT_DIR / name)
        summary[name]["bytes"] += gguf_bytes
    total = sum(v["bytes"] for v in summary.values())
    print(f"total {total} bytes", file=sys.stderr)
    assert not wanted - summary.keys(), f"unknown fixtures {wanted - summary.keys()}"


if __name__ == "__main__":
    main()
