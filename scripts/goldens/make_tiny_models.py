#!/usr/bin/env python3
"""Generate tiny random-weight HF models + reference logits/greedy tokens for ferrite's Rust tests.

How to run (from the repository root):

    pip install torch transformers==5.17.0 safetensors
    python scripts/goldens/make_tiny_models.py            # writes tests/fixtures/models/<name>/

Everything is deterministic: fixed seeds (torch.manual_seed per model, a fixed numpy Generator for the
prompts), float32 everywhere, CPU only, eager attention, model.eval(). Re-running with the same torch /
transformers versions reproduces the files byte for byte (modulo float rounding differences across
CPU kernels, which are far below the 6-significant-digit rounding of the JSON).

For each config below the script:
  1. builds the model with `AutoModelForCausalLM.from_config(config)` (float32, eval mode),
  2. re-initialises every weight from a fixed seed with a larger std than HF's default (so logits
     are not flat and greedy decoding is non-trivial):
       - nn.Embedding:               N(0, 0.5)
       - nn.Linear weights:          N(0, 0.15)    (lm_head when untied: N(0, 0.5))
       - nn.Linear biases (qwen2):   N(0, 0.1)
       - RMSNorm weights (incl. qwen3 q_norm/k_norm): 1 + N(0, 0.1)
     (With N(0,1) embeddings and N(0,0.1) linears the residual stream is dominated by the token
     embedding, and tied-embedding models just echo the last prompt token forever. These values give
     logits with std ~4 and diverse greedy continuations.)
     The seed is searched deterministically (base_seed, base_seed+1, ...) until every greedy step of
     every prompt has a top1-top2 logit margin >= MIN_MARGIN and each continuation has >= 4 distinct
     tokens, so the Rust greedy comparison is not decided by float noise.
  3. saves it with `save_pretrained(dir)` (transformers 5.x always writes model.safetensors; the old
     `safe_serialization=True` kwarg no longer exists and would be silently ignored),
  4. writes `reference.json`:
       prompts:            3 prompts of random token ids (lengths 5, 17, 40), same for all models
       logits:             [prompt][position][vocab] f32 logits from ONE forward pass over the whole
                           prompt (no cache), rounded to 6 significant digits
       greedy:             [prompt][32] greedy tokens (argmax, KV cache, prefill then one token per
                           step, exactly what `generate(do_sample=False, max_new_tokens=32)` does with
                           eos disabled; cross-checked against model.generate)
       greedy_logits_last: logits (6 sig. digits) whose argmax is greedy[0][31], i.e. the output of
                           the decode step that fed greedy[0][30] at position len(prompt0)+30
       greedy_no_cache:    only for llama-rope-dynamic and longrope (see below): greedy tokens when every step
                           re-runs a fresh full forward over prompt+generated tokens
       min_greedy_margin:  smallest (top1 - top2) logit gap seen over all greedy steps (for choosing
                           test tolerances)
       meta:               generator info (versions, seeds, rope notes)

Dynamic NTK rope in transformers 5.17 (llama-rope-dynamic): the threshold is
`config.max_position_embeddings` (NOT original_max_position_embeddings, which HF ignores for "dynamic").
The rotary module is *stateful*: on each forward, seq_len = max(position_ids)+1; if seq_len exceeds the
cached length, inv_freq is recomputed with
    base' = theta * (factor*seq_len/max_pos - (factor-1)) ** (dim/(dim-2))
and only the NEW q/k get the new frequencies - keys already in the KV cache keep the rotation they got
when they were computed. So cached greedy decoding past max_position_embeddings uses a different base
for every position (`greedy`), which differs from the "consistent" re-run-everything variant
(`greedy_no_cache`). This script resets the rotary state before every forward/generation so each
reference is independent of call order.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from transformers.cache_utils import DynamicCache

REPO_ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = REPO_ROOT / "tests" / "fixtures" / "models"

VOCAB = 307
PROMPT_LENGTHS = (5, 17, 40)
PROMPT_SEED = 1234
N_NEW = 32
MIN_MARGIN = 0.02
MAX_SEED_TRIES = 200
BOS, EOS = 1, VOCAB - 1

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=136,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=BOS,
    eos_token_id=EOS,
    tie_word_embeddings=False,
)


def llama(**over):
    kw = dict(COMMON)
    kw.update(over)
    return LlamaConfig(**kw)


def configs():
    # name -> (config, base seed for the deterministic seed search)
    return {
        "llama": (llama(), 1000),
        "llama-tied": (llama(tie_word_embeddings=True), 2000),
        "llama-rope-llama3": (
            llama(
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=10000.0,
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=32,
                )
            ),
            3000,
        ),
        "llama-rope-linear": (
            llama(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
            4000,
        ),
        # HF's dynamic NTK uses max_position_embeddings as the "original" length.
        "llama-rope-dynamic": (
            llama(
                max_position_embeddings=32,
                rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
            ),
            5000,
        ),
        # max_position_embeddings = factor * original so HF's yarn validator does not warn.
        "llama-rope-yarn": (
            llama(
                max_position_embeddings=128,
                rope_parameters=dict(
                    rope_type="yarn",
                    rope_theta=10000.0,
                    factor=4.0,
                    original_max_position_embeddings=32,
                    beta_fast=32.0,
                    beta_slow=1.0,
                ),
            ),
            6000,
        ),
        "mistral": (MistralConfig(**{**COMMON, "sliding_window": None}), 7000),
        "qwen2": (
            Qwen2Config(**{**COMMON, "tie_word_embeddings": True, "use_sliding_window": False}),
            8000,
        ),
        "qwen3": (
            Qwen3Config(
                **{
                    **COMMON,
                    "head_dim": 24,  # != hidden_size / num_attention_heads (= 16), like real Qwen3
                    "tie_word_embeddings": True,
                    "use_sliding_window": False,
                    "attention_bias": False,
                }
            ),
            9000,
        ),
        # The same with a head_dim the CUDA attention kernels are built for (24 is not).
        "qwen3-hd32": (
            Qwen3Config(
                **{
                    **COMMON,
                    "head_dim": 32,
                    "tie_word_embeddings": True,
                    "use_sliding_window": False,
                    "attention_bias": False,
                }
            ),
            9500,
        ),
    }


@torch.no_grad()
def init_weights(model, seed: int):
    torch.manual_seed(seed)
    tied = model.config.tie_word_embeddings
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if isinstance(mod, torch.nn.Embedding):
            mod.weight.normal_(0.0, 0.5)
        elif isinstance(mod, torch.nn.Linear):
            if name == "lm_head":
                if not tied:
                    mod.weight.normal_(0.0, 0.5)
            else:
                mod.weight.normal_(0.0, 0.15)
            if mod.bias is not None:
                mod.bias.normal_(0.0, 0.1)
        elif "RMSNorm" in cls:
            mod.weight.copy_(1.0 + 0.1 * torch.randn_like(mod.weight))
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def reset_rope(model):
    """Undo dynamic-rope state so every reference computation starts from the init-time frequencies."""
    for mod in model.modules():
        if hasattr(mod, "original_inv_freq") and hasattr(mod, "max_seq_len_cached"):
            mod.register_buffer("inv_freq", mod.original_inv_freq.clone(), persistent=False)
            mod.max_seq_len_cached = mod.original_max_seq_len


def r6(x):
    return float(f"{x:.6g}")


def r6list(t: torch.Tensor):
    return [r6(v) for v in t.tolist()]


@torch.no_grad()
def full_logits(model, ids):
    reset_rope(model)
    out = model(torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def greedy_cached(model, ids, n):
    """Prefill + one token per step with a DynamicCache (what generate() does)."""
    reset_rope(model)
    cache = DynamicCache(config=model.config)
    out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    logits = out.logits[0, -1]
    toks, margins = [], []
    for step in range(n):
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        t = int(torch.argmax(logits))
        toks.append(t)
        last_logits = logits
        if step == n - 1:
            break
        pos = len(ids) + step
        out = model(
            torch.tensor([[t]]),
            past_key_values=out.past_key_values,
            use_cache=True,
            position_ids=torch.tensor([[pos]]),
            cache_position=torch.tensor([pos]),
        )
        logits = out.logits[0, -1]
    return toks, last_logits, min(margins)


@torch.no_grad()
def greedy_generate(model, ids, n):
    reset_rope(model)
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        eos_token_id=None,
        pad_token_id=0,
        use_cache=True,
    )
    return out[0, len(ids):].tolist()


@torch.no_grad()
def greedy_no_cache(model, ids, n):
    """Greedy where every step is a fresh full forward over prompt + generated tokens (no KV cache)."""
    seq, margins = list(ids), []
    for _ in range(n):
        logits = full_logits(model, seq)[-1]
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        seq.append(int(torch.argmax(logits)))
    return seq[len(ids):], logits, min(margins)


def rope_depends_on_length(config) -> bool:
    """Rope types whose frequencies depend on each forward call's length (dynamic NTK, Phi-3 longrope):
    cached greedy decoding then differs from re-running everything, so both are recorded."""
    return config.rope_parameters.get("rope_type") in ("dynamic", "longrope")


def generate_agrees_for(config, prompt) -> int:
    """How many greedy tokens generate() must share with the plain KV-cache loop. All of them, except for
    longrope: transformers 5.17's Phi3ForCausalLM.prepare_inputs_for_generation drops the cache once the
    sequence first passes original_max_position_embeddings, but generate() still feeds only the newest
    token, so from then on every token is decoded alone at position 0 (a transformers bug)."""
    if config.rope_parameters.get("rope_type") != "longrope":
        return N_NEW
    return max(0, config.rope_parameters["original_max_position_embeddings"] + 1 - len(prompt))


def rope_keys(cfg_json: dict):
    keys = {k: cfg_json[k] for k in ("rope_parameters", "rope_scaling", "rope_theta") if k in cfg_json}
    keys["max_position_embeddings"] = cfg_json.get("max_position_embeddings")
    return keys


def pick_seed(name, config, base_seed, prompts, init=None, accept=None):
    """First seed (base_seed, base_seed+1, ...) whose greedy decoding is robust and non-trivial.

    `init(model, seed)` re-initialises the weights (default `init_weights`); `accept(model)`, when
    given, is an extra check a candidate must pass (e.g. decisive MoE routing)."""
    init = init or init_weights
    for seed in range(base_seed, base_seed + MAX_SEED_TRIES):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        init(model, seed)
        ok = True
        for p in prompts:
            toks, _, margin = greedy_cached(model, p, N_NEW)
            if margin < MIN_MARGIN or len(set(toks)) < 4:
                ok = False
                break
            if rope_depends_on_length(config):
                nc, _, nc_margin = greedy_no_cache(model, p, N_NEW)
                if nc_margin < MIN_MARGIN:
                    ok = False
                    break
        if ok and (accept is None or accept(model)):
            return seed, model
    raise RuntimeError(f"{name}: no seed in [{base_seed}, {base_seed + MAX_SEED_TRIES}) passed")


def make_prompts():
    """Three prompts of random ids, BOS first (like a tokenizer would), no BOS/EOS inside."""
    rng = np.random.default_rng(PROMPT_SEED)
    return [[BOS] + rng.integers(2, VOCAB - 1, size=n - 1).tolist() for n in PROMPT_LENGTHS]


def write_fixture(name, config, base_seed, prompts, generator, init=None, accept=None):
    """Pick a seed, save the model to OUT_DIR/name and write its reference.json; returns a summary."""
    print(f"== {name}", file=sys.stderr)
    seed, model = pick_seed(name, config, base_seed, prompts, init, accept)

    d = OUT_DIR / name
    if d.exists():
        shutil.rmtree(d)
    model.save_pretrained(d)
    for f in d.iterdir():
        f.chmod(0o644)

    # reload from disk so the reference comes from exactly what was saved
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    is_dynamic = rope_depends_on_length(model.config)

    logits, greedy, nocache, margins = [], [], [], []
    last = last_nc = None
    for i, p in enumerate(prompts):
        lg = full_logits(model, p)
        logits.append([r6list(row) for row in lg])
        toks, last_lg, m = greedy_cached(model, p, N_NEW)
        margins.append(m)
        gen = greedy_generate(model, p, N_NEW)
        n = generate_agrees_for(model.config, p)
        assert gen[:n] == toks[:n], f"{name}: generate() {gen} != manual loop {toks}"
        assert len(toks) == N_NEW
        greedy.append(toks)
        nc, nc_last, _ = greedy_no_cache(model, p, N_NEW)
        nocache.append(nc)
        if i == 0:
            last, last_nc = r6list(last_lg), r6list(nc_last)
            last_diff = float((last_lg - nc_last).abs().max())

    cfg_json = json.loads((d / "config.json").read_text())
    ref = {
        "prompts": prompts,
        "logits": logits,
        "greedy": greedy,
        "greedy_logits_last": last,
        "min_greedy_margin": r6(min(margins)),
        "meta": {
            "generator": generator,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "seed": seed,
            "prompt_seed": PROMPT_SEED,
            "attn_implementation": "eager",
            "dtype": "float32",
            "rope": rope_keys(cfg_json),
        },
    }
    if is_dynamic:
        ref["greedy_no_cache"] = nocache
        ref["greedy_logits_last_no_cache"] = last_nc
    else:
        assert nocache == greedy, f"{name}: cached greedy != no-cache greedy"
    (d / "reference.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n")
    size = sum(f.stat().st_size for f in d.iterdir())
    summary = dict(
        bytes=size,
        seed=seed,
        min_margin=round(min(margins), 4),
        cache_vs_nocache_last_logits_maxdiff=last_diff,
        cache_eq_nocache_tokens=nocache == greedy,
        distinct=[len(set(g)) for g in greedy],
        rope=rope_keys(cfg_json),
    )
    print(f"   {json.dumps(summary)}", file=sys.stderr)
    return summary


def finish_rewritten(d: Path, name: str, summary: dict) -> dict:
    """After a script rewrote fixture dir `d` (a quantized checkpoint in place of the float one):
    the files' mode, their bytes in `summary`, one line on stderr."""
    for f in d.iterdir():
        f.chmod(0o644)
    summary["bytes"] = sum(f.stat().st_size for f in d.iterdir())
    print(f"   {name}: {summary['bytes']} bytes, min margin {summary['min_margin']}", file=sys.stderr)
    return summary


def run_quantized(fixtures: dict, write) -> None:
    """The main of a quantized-fixture script: `write(name, *spec, prompts)` for each fixture of
    `fixtures` (name -> spec tuple) named on the command line (all when none is), each written
    afresh, with the seed search's margin raised to 0.05 so that greedy tokens hold through the
    fast kernels."""
    global MIN_MARGIN
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    torch.use_deterministic_algorithms(True)
    MIN_MARGIN = 0.05
    prompts = make_prompts()
    wanted = set(sys.argv[1:])
    total = 0
    for name, spec in fixtures.items():
        if wanted and name not in wanted:
            continue
        if (OUT_DIR / name).exists():
            shutil.rmtree(OUT_DIR / name)
        total += write(name, *spec, prompts)["bytes"]
    print(f"total {total} bytes", file=sys.stderr)


def main():
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    torch.use_deterministic_algorithms(True)
    prompts = make_prompts()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    summary = {
        name: write_fixture(name, config, base_seed, prompts, "scripts/goldens/make_tiny_models.py")
        for name, (config, base_seed) in configs().items()
    }
    total = sum(v["bytes"] for v in summary.values())
    print(f"total {total} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
