"""How far bf16 alone moves the hybrid fixtures (and qwen3-moe, for scale) from their f32 selves
under transformers on the CPU: per reference prompt, the prefill logits' rel L2, the largest
log-probability move, the f32 top-2 margins of the positions whose argmax flips, the positions
where either top token is outside the other's top 5, and where 24
greedy tokens first part (with the f32 top-2 log-probability margin there). The GPU executor
keeps activations in bf16; `cuda_goldens` cites these numbers for the hybrids' prefill bar and
for measuring qwen3-next (a router near tie whose flip its recurrent state keeps for good).

    python scripts/goldens/hybrid_bf16_spread.py [fixture ...]   # default qwen3.5 qwen3-next qwen3-moe
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models"


@torch.no_grad()
def main():
    for name in sys.argv[1:] or ["qwen3.5", "qwen3-next", "qwen3-moe"]:
        root = FIXTURES / name
        prompts = json.loads((root / "reference.json").read_text())["prompts"]
        f32 = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
        vocab = f32.config.vocab_size
        # cuda_goldens' long prompt.
        prompts.append([2 + (i * 37 + 11) % (vocab - 2) for i in range(150)])
        bf16 = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval().to(torch.bfloat16)
        for p in prompts:
            ids = torch.tensor([p])
            a = f32.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(p) :].tolist()
            b = bf16.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(p) :].tolist()
            j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            parted = "none"
            if j is not None:
                top = f32(torch.tensor([p + a[:j]])).logits[0, -1].log_softmax(-1).topk(2).values
                parted = f"token {j} (f32 top-2 margin {float(top[0] - top[1]):.4f})"
            want, got = f32(ids).logits[0], bf16(ids).logits[0].float()
            rel = float((got - want).norm() / want.norm())
            lw, lg = want.log_softmax(-1), got.log_softmax(-1)
            top = lw.topk(2).values
            flips = [f"{float(top[i, 0] - top[i, 1]):.3f}" for i in range(len(p)) if lw[i].argmax() != lg[i].argmax()]
            tw, tg = lw.topk(5).indices, lg.topk(5).indices
            outside = sum(
                int(not (bool((tg[i] == tw[i, 0]).any()) and bool((tw[i] == tg[i, 0]).any()))) for i in range(len(p))
            )
            print(
                f"{name} len {len(p)}: bf16 prefill rel L2 {rel:.3f}, largest log-probability move "
                f"{float((lw - lg).abs().max()):.2f}, argmax flips at f32 margins [{', '.join(flips)}], "
                f"top-1 outside the other's top-5 at {outside}/{len(p)}, greedy parts at {parted}"
            )


if __name__ == "__main__":
    main()
