"""Hugging Face transformers' reference for ferrite's CUDA llama, made on the GPU machine.

Builds a random-weight llama with transformers from a fixed seed — by default the
Llama-3.2-1B shape (16 layers, d 2048, 32 / 8 heads of 64, FFN 8192, vocab 128,256, tied
embeddings, llama3 RoPE) — saves it as bf16 safetensors in OUT_DIR, and writes
OUT_DIR/reference.json from transformers run in f32 over those same bf16 weights (TF32 off):
  prompts         random token-id prompts (no tokenizer needed)
  top             per prompt, per position: the 20 most likely next tokens as [id, logprob]
  greedy          per prompt: 16 greedy tokens
  greedy_margins  the top-2 log-probability margin at each of those steps
The gated Rust test `cuda_model::cuda_matches_transformers` (FERRITE_HF_REFERENCE=OUT_DIR)
runs ferrite on the model and checks its log-probabilities against these
(scripts/gpu_tests.sh runs both).

usage: python3 scripts/hf_cuda_parity.py OUT_DIR [--tiny]   (--tiny: a small shape on the CPU,
       for checking the script and the test where there is no GPU)
"""

import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEED = 1234
GREEDY_TOKENS = 16


def config(tiny: bool) -> LlamaConfig:
    shape = (
        dict(vocab_size=503, hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)
        if tiny
        else dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64)
    )
    return LlamaConfig(
        **shape,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=True,
        # Wider than the default 0.02, so the next-token distributions have clear winners.
        initializer_range=0.04,
        bos_token_id=1,
        eos_token_id=2,
    )


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 1:
        sys.exit(__doc__)
    out, tiny = args[0], "--tiny" in sys.argv
    os.makedirs(out, exist_ok=True)
    device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(SEED)
    cfg = config(tiny)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # The reference: f32 arithmetic over exactly the saved bf16 weights, loaded back from the
    # saved directory (casting the bf16 model up instead would keep its RoPE frequencies
    # rounded to bf16, an error that grows with the position).
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()

    gen = torch.Generator().manual_seed(SEED + 1)
    lengths = [5, 33, 128, 300] if not tiny else [5, 33]
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    top, greedy, margins = [], [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            values, indices = lp.topk(20, dim=-1)
            top.append([[[int(i), float(v)] for i, v in zip(ii, vv)] for ii, vv in zip(indices.tolist(), values.tolist())])
            tokens, step_margins = [], []
            for _ in range(GREEDY_TOKENS):
                last = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
                v, i = last.topk(2)
                step_margins.append(float(v[0] - v[1]))
                tokens.append(int(i[0]))
                ids = torch.cat([ids, i[:1].view(1, 1)], dim=1)
            greedy.append(tokens)
            margins.append(step_margins)
    reference = dict(prompts=prompts, top=top, greedy=greedy, greedy_margins=margins,
                     meta=dict(seed=SEED, device=device, torch=torch.__version__,
                               transformers=__import__("transformers").__version__))
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(reference, f)
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
          f"{len(prompts)} prompts, reference on {device}")


if __name__ == "__main__":
    main()
