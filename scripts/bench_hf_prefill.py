#!/usr/bin/env python3
"""Prefill peer for `ferrite bench prefill --synthetic llama-3.1-8b` (issue 22): Hugging Face
transformers with torch SDPA attention on the same GPU and shape, random bf16 weights.

    python3 scripts/bench_hf_prefill.py [--lengths 8192,32768,131072] [--reps 3]

For each prompt length S: a forward over S random ids with `logits_to_keep=1, use_cache=False`
(one row of logits, as a prefill step of ferrite's keeps), a warm-up first, then the best of
`--reps` timed runs (CUDA events). Prints one line per length: tokens/s and the TFLOP/s it
implies, counting the matrix products (2 x parameters x S) and causal attention
(2 x 2 x layers x heads x head_dim x S^2 / 2).
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# ferrite's `llama-3.1-8b` synthetic shape (crates/ferrite-models/src/gpu/synthetic.rs).
SHAPE = dict(
    vocab_size=128_256,
    hidden_size=4096,
    intermediate_size=14_336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131_072,
    rope_theta=500_000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    tie_word_embeddings=False,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    config = LlamaConfig(**SHAPE)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    params = sum(p.numel() for p in model.parameters()) - SHAPE["vocab_size"] * SHAPE["hidden_size"]
    head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    print(f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}, {params / 1e9:.2f} B matrix parameters")
    for s in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(0, SHAPE["vocab_size"], (1, s), device="cuda")
        best = float("inf")
        with torch.inference_mode():
            for rep in range(args.reps + 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(input_ids=ids, logits_to_keep=1, use_cache=False)
                end.record()
                torch.cuda.synchronize()
                if rep > 0:  # the first is the warm-up
                    best = min(best, start.elapsed_time(end) / 1e3)
        flops = 2 * params * s + 2 * 2 * SHAPE["num_hidden_layers"] * SHAPE["num_attention_heads"] * head_dim * s * s / 2
        print(f"prefill {s:>7} tokens: {s / best:>10.1f} tok/s  {best * 1e3:>9.1f} ms  "
              f"{flops / best / 1e12:>6.1f} TFLOP/s (matrices + causal attention)")
        del ids
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
