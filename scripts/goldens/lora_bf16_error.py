#!/usr/bin/env python3
"""How far transformers + PEFT in bf16 (on a CUDA device) land from their own f32 logits, per
position, for each LoRA fixture adapter over the tiny llama and each reference prompt: the
physical limit a bf16 executor is held to (crates/ferrite-engine/tests/cuda_lora.rs).

The synthetic adapters that adapt q and k make some attention rows peaky, where bf16's
rounding of q and k moves a score enough to pick another key: at such positions bf16 logits
part from f32 ones far past the usual bf16 tolerance in PEFT itself. Writes
tests/fixtures/lora/bf16_error.json ({adapter: [[relative L2 error per position] per prompt]}).

    python scripts/goldens/lora_bf16_error.py      # from the repository root, on a CUDA machine
"""

import json

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

ROOT = "tests/fixtures/models/llama"
LORA = "tests/fixtures/lora"


def main():
    prompts = json.load(open(f"{LORA}/reference.json"))["prompts"]
    out = {}
    for name in ["qv", "all", "mlp-late"]:
        logits = {}
        for dtype, device in [(torch.float32, "cpu"), (torch.bfloat16, "cuda")]:
            base = AutoModelForCausalLM.from_pretrained(ROOT, dtype=dtype).to(device)
            model = PeftModel.from_pretrained(base, f"{LORA}/{name}").to(device).eval()
            with torch.no_grad():
                logits[dtype] = [model(torch.tensor([p], device=device)).logits[0].float().cpu() for p in prompts]
        out[name] = []
        for want, got in zip(logits[torch.float32], logits[torch.bfloat16]):
            per = ((want - got).norm(dim=-1) / want.norm(dim=-1)).tolist()
            out[name].append([round(x, 5) for x in per])
            print(f"{name} prompt of {len(per)}: worst position {max(per):.3f}, mean {sum(per) / len(per):.4f}")
    json.dump(out, open(f"{LORA}/bf16_error.json", "w"))


if __name__ == "__main__":
    main()
