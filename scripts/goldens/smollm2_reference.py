#!/usr/bin/env python3
"""Reference outputs of SmolLM2-135M-Instruct (Q4_1 GGUF) from Hugging Face transformers.

How to run (from the repository root):

    pip install torch transformers==5.17.0 gguf safetensors numpy
    python scripts/goldens/smollm2_reference.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

Default GGUF path: $FERRITE_HOME/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
(FERRITE_HOME defaults to ~/.cache/ferrite). Writes tests/fixtures/smollm2_reference.json.

transformers loads the GGUF with `from_pretrained(dir, gguf_file=name, dtype=torch.float32)`, which
dequantizes every tensor (Q4_1 / Q8_0 -> f32, via gguf-py) and un-permutes llama.cpp's attn_q/attn_k
row permutation, so the model below is "the GGUF's weights, exactly dequantized, run in f32".
A quantized engine (e.g. one that quantizes activations to Q8 for the dot products like llama.cpp)
will differ slightly; `greedy_margins` (top1 - top2 logit gap at each greedy step) tells a test where
a greedy comparison is robust.

Recorded per prompt:
  text, ids (the prompt ids as HF tokenizes them: add_special_tokens=True; this GGUF has
  tokenizer.ggml.add_bos_token = false, so NO BOS is prepended; "<|im_start|>"/"<|im_end|>" in the text
  are parsed as the special tokens 1/2), greedy (32 argmax tokens with KV cache, eos disabled so
  exactly 32 come out; tokens after a generated <|im_end|> are still plain argmax), greedy_text,
  first_eos_index (index in greedy of the first eos id 2 = "<|im_end|>", or null; note the HF GGUF
  tokenizer wrongly reports eos_token = "<|im_start|>" (1), the GGUF and model config say 2),
  greedy_margins, top5 at the
  last prompt position (ids + f32 logits).

Tokenizer caveat: transformers' GGUF tokenizer converter builds a plain GPT-2 ByteLevel pre-tokenizer
and ignores tokenizer.ggml.pre = "smollm", whereas the original SmolLM2 tokenizer (and llama.cpp's
"smollm" pre-tokenizer) first splits every digit individually. The prompts below are checked to
tokenize identically under both (assertion), so the ids are valid for either.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
OUT = REPO_ROOT / "tests" / "fixtures" / "smollm2_reference.json"
N_NEW = 32
EOS_ID = 2  # set from model.config in main()

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    (
        "The Great Barrier Reef is the largest coral reef system in the world, stretching along the "
        "north-east coast of Australia. It is made up of thousands of individual reefs and hundreds of "
        "islands, and it can be seen from outer space. The reef is home to a huge variety of life, "
        "including many kinds of fish, turtles, sharks and dolphins. However, rising ocean "
        "temperatures have caused several mass bleaching events, and scientists warn that the reef "
        "could lose most of its coral within a few decades unless action is taken. In summary, the reef"
    ),
]


def gguf_path() -> Path:
    if len(sys.argv) > 1:
        return Path(sys.argv[1]).expanduser()
    home = Path(os.environ.get("FERRITE_HOME", Path.home() / ".cache" / "ferrite"))
    return home / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@torch.no_grad()
def greedy(model, ids, n):
    out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    logits = out.logits[0, -1]
    toks, margins = [], []
    for step in range(n):
        top2 = torch.topk(logits, 2).values
        margins.append(round(float(top2[0] - top2[1]), 4))
        toks.append(int(torch.argmax(logits)))
        if step == n - 1:
            break
        out = model(torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[0, -1]
    return toks, margins


def main():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    path = gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()

    # the original SmolLM2 pre-tokenizer: individual digits, then GPT-2 byte-level
    smollm_tok = tok.backend_tokenizer.__class__.from_str(tok.backend_tokenizer.to_str())
    smollm_tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )

    bos_added = tok("hello")["input_ids"][0] == tok.bos_token_id
    global EOS_ID
    # NB: the HF GGUF tokenizer reports eos_token = "<|im_start|>" (1); the GGUF metadata
    # (tokenizer.ggml.eos_token_id) and model.config.eos_token_id say 2 = "<|im_end|>". Use the latter.
    EOS_ID = model.config.eos_token_id
    assert tok.convert_ids_to_tokens(EOS_ID) == "<|im_end|>"
    print(f"tokenizer: bos={tok.bos_token!r}({tok.bos_token_id}) eos={tok.eos_token!r}({tok.eos_token_id}) "
          f"add_bos_token={getattr(tok, 'add_bos_token', None)} -> BOS added by HF: {bos_added}")

    results = []
    for text in PROMPTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        alt = smollm_tok.encode(text, add_special_tokens=True).ids
        assert ids == alt, f"HF-GGUF and smollm pre-tokenization differ for {text!r}:\n{ids}\n{alt}"

        with torch.no_grad():
            last = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
        top = torch.topk(last, 5)
        toks, margins = greedy(model, ids, N_NEW)
        gen = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=N_NEW,
            min_new_tokens=N_NEW,
            eos_token_id=None,
            pad_token_id=tok.pad_token_id,
        )[0, len(ids):].tolist()
        if gen != toks:
            print(f"WARNING: generate() differs from the manual greedy loop for {text[:30]!r}:\n {gen}\n {toks}")
        eos = EOS_ID
        rec = {
            "text": text,
            "ids": ids,
            "greedy": toks,
            "greedy_text": tok.decode(toks),
            "first_eos_index": toks.index(eos) if eos in toks else None,
            "greedy_margins": margins,
            "top5_ids": top.indices.tolist(),
            "top5_logits": [float(f"{v:.6g}") for v in top.values.tolist()],
        }
        results.append(rec)
        print(f"--- {text[:60]!r} ({len(ids)} ids)\n    ids {ids[:16]}{'...' if len(ids) > 16 else ''}")
        print(f"    -> {rec['greedy_text']!r}\n    greedy {toks}\n    min margin {min(margins)} "
              f"(step {margins.index(min(margins))}), top5 {list(zip(rec['top5_ids'], rec['top5_logits']))}")

    paris = tok.decode(results[0]["greedy"][:1])
    assert paris == " Paris", f"capital of France continuation starts with {paris!r}"

    doc = {
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "generator": "scripts/goldens/smollm2_reference.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "weights": "GGUF dequantized to f32 by transformers; eager attention; f32 compute",
        "bos_added": bos_added,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": EOS_ID,
        "hf_tokenizer_eos_token_id": tok.eos_token_id,
        "n_new": N_NEW,
        "eos_disabled": True,
        "prompts": results,
    }
    OUT.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
