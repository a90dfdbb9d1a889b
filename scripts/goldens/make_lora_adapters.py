#!/usr/bin/env python3
"""Tiny random LoRA adapters made with PEFT, and transformers + PEFT references, for ferrite's
multi-LoRA tests.

How to run (from the repository root; the tiny llama fixture must exist, see make_tiny_models.py):

    pip install torch transformers==5.17.0 peft safetensors
    python scripts/goldens/make_lora_adapters.py      # writes tests/fixtures/lora/
    python scripts/goldens/make_lora_adapters.py --bench DIR
        # writes DIR/a0 .. DIR/a3: four SmolLM2-shaped adapters, r 16 on all seven projections,
        # for `ferrite bench throughput --lora-modules` (not committed)

Adapters (PEFT `LoraConfig`, `get_peft_model`, `save_pretrained`: adapter_config.json +
adapter_model.safetensors), on tests/fixtures/models/llama unless said otherwise:

  qv        r 4,  alpha 8,  q_proj + v_proj                              (the classic choice)
  all       r 8,  alpha 16, rsLoRA, all seven projections                (scale alpha / sqrt(r))
  mlp-late  r 2,  alpha 4,  o_proj + gate_proj + down_proj, layer 1 only (layers_to_transform)
  wide      r 4,  q_proj + v_proj of a llama with hidden 32: does NOT fit the fixture (shape test)
  dora      r 4,  use_dora: refused by ferrite (DoRA is not plain LoRA)
  smollm2   r 4,  alpha 8,  q_proj + v_proj + down_proj, bf16, SmolLM2-135M's shape (30 layers,
            hidden 576), A and B from N(0, 0.05): for the real Q4_1 GGUF (co-batching on
            quantized weights, and the bench)

PEFT initialises B to zero (an adapter that changes nothing); every A and B here is drawn from
N(0, 0.3) with a fixed seed instead, so each adapter moves the logits well away from the base.

reference.json holds, per fitting adapter of the tiny llama and per prompt of the base fixture's
reference (lengths 5, 17, 40): the f32 logits of the last prompt position from one forward pass,
16 greedy tokens (KV cache, eos disabled, as `generate(do_sample=False)`), and the smallest
top-1/top-2 logit margin over those greedy steps; the seed is searched until that margin is at
least MIN_MARGIN for every adapter, so the Rust comparison is not decided by float noise.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE = REPO_ROOT / "tests" / "fixtures" / "models" / "llama"
OUT = REPO_ROOT / "tests" / "fixtures" / "lora"
N_NEW = 16
MIN_MARGIN = 0.02
STD = 0.3

ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp-late": dict(r=2, lora_alpha=4, target_modules=["o_proj", "gate_proj", "down_proj"], layers_to_transform=[1]),
}


def randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def adapted(base_dir: Path, cfg: dict, seed: int, std: float = STD, **lora_extra) -> peft.PeftModel:
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager").eval()
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **cfg, **lora_extra))
    randomize(model, seed, std)
    return model.eval()


def greedy(model, prompt: list[int]) -> tuple[list[int], float]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=N_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    margins = []
    for s in out.scores:
        top = torch.topk(s[0], 2).values
        margins.append(float(top[0] - top[1]))
    return out.sequences[0, len(prompt) :].tolist(), min(margins)


def last_logits(model, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    return [float(f"{x:.6g}") for x in logits.tolist()]


def save(model: peft.PeftModel, name: str) -> None:
    d = OUT / name
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d)
    # Keep only the two files ferrite reads (save_pretrained also writes a README), and no
    # absolute path of this machine in the config.
    for f in d.iterdir():
        if f.name not in ("adapter_config.json", "adapter_model.safetensors"):
            f.unlink()
    cfg_path = d / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = Path(cfg["base_model_name_or_path"]).name
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=64,
    tie_word_embeddings=True,
)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def bench(out: Path) -> None:
    base = out / "_base"
    AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2)).save_pretrained(base)
    for i in range(4):
        model = adapted(base, dict(r=16, lora_alpha=16, target_modules=ALL), 50 + i, std=0.02)
        model.save_pretrained(out / f"a{i}")
    shutil.rmtree(base)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", type=Path, help="write four SmolLM2-shaped benchmark adapters here instead")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.bench:
        bench(args.bench)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    prompts = json.loads((BASE / "reference.json").read_text())["prompts"]
    reference = {
        "prompts": prompts,
        "adapters": {},
        "meta": {
            "generator": "scripts/goldens/make_lora_adapters.py",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
            "std": STD,
        },
    }
    for i, (name, cfg) in enumerate(ADAPTERS.items()):
        for seed in range(100 + 10 * i, 110 + 10 * i):
            model = adapted(BASE, cfg, seed)
            runs = [greedy(model, p) for p in prompts]
            margin = min(m for _, m in runs)
            if margin >= MIN_MARGIN:
                break
        else:
            raise SystemExit(f"{name}: no seed gives greedy margins >= {MIN_MARGIN}")
        save(model, name)
        reference["adapters"][name] = {
            "seed": seed,
            "last_logits": [last_logits(model, p) for p in prompts],
            "greedy": [toks for toks, _ in runs],
            "min_greedy_margin": margin,
        }
        print(f"{name}: seed {seed}, min margin {margin:.4f}")

    # An adapter for a llama of another width: it must not attach to the fixture.
    wide_dir = OUT / "_wide_base"
    wide = LlamaConfig(**{**json.loads((BASE / "config.json").read_text()), "hidden_size": 32, "head_dim": 8})
    AutoModelForCausalLM.from_config(wide).save_pretrained(wide_dir)
    save(adapted(wide_dir, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), 1), "wide")
    shutil.rmtree(wide_dir)
    save(adapted(BASE, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), 2, use_dora=True), "dora")

    # SmolLM2-135M's shape (the vocabulary is cut: embeddings are not adapted), bf16 weights.
    small_dir = OUT / "_smollm2_base"
    AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2)).save_pretrained(small_dir)
    model = adapted(small_dir, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]), 3, std=0.05)
    model = model.to(torch.bfloat16)
    save(model, "smollm2")
    shutil.rmtree(small_dir)

    (OUT / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")


if __name__ == "__main__":
    main()
