"""How far two correct W8A8 runs of an FP8 fixture part: transformers (with compressed-tensors,
which quantizes each linear's input per token as the checkpoint's `input_activations` say) in
bf16 against f32, on the CPU, per prompt, as rel L2 of the logits; and the f32 run against the
fixture's stored `w8a8_logits` (which it must match). `cuda_goldens`' FP8_W8A8_SANITY cites it.

    python scripts/goldens/fp8_w8a8_spread.py [fixture ...]   # default fp8-llama-channel
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models"


@torch.no_grad()
def logits(d: Path, dtype, prompts):
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval().to(dtype)
    return [model(torch.tensor([p])).logits[0].float() for p in prompts]


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def main():
    for name in sys.argv[1:] or ["fp8-llama-channel"]:
        d = FIXTURES / name
        ref = json.loads((d / "reference.json").read_text())
        prompts = ref["prompts"]
        f32, bf16 = logits(d, torch.float32, prompts), logits(d, torch.bfloat16, prompts)
        for i, p in enumerate(prompts):
            stored = torch.tensor(ref["w8a8_logits"][i])
            print(f"{name} len {len(p)}: bf16 vs f32 W8A8 {rel(bf16[i], f32[i]):.3f}, f32 vs stored {rel(f32[i], stored):.1e}")


if __name__ == "__main__":
    main()
