#!/usr/bin/env python3
"""Golden token ids for the SmolLM2 GGUF tokenizer (ferrite-models `Tokenizer::from_gguf`).

Needs transformers (with its GGUF support: the `gguf` package) and the model file that
`ferrite run smollm2` fetches (~/.cache/ferrite/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,
or $FERRITE_HOME/models/...):

    pip install transformers gguf
    HF_HUB_OFFLINE=1 python scripts/goldens/tokenizer_fixtures.py     # from the repo root

It writes tests/fixtures/tokenizer/smollm2.json (overwriting it); the Rust test
crates/ferrite-models/tests/tokenizer.rs (`smollm2_matches_transformers`) encodes every text
with the tokenizer built from the same GGUF and compares the ids exactly. transformers builds
its tokenizer from the GGUF metadata alone (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`), so nothing is downloaded. The output is deterministic for a given
transformers version.

    {"gguf": "SmolLM2-135M-Instruct.Q4_1.gguf", "transformers": "5.17.0",
     "cases": [{"text": "...", "ids": [...], "decoded": "..."}, ...]}

`ids` is `encode(text, add_special_tokens=False)`: ChatML markers written in the text
(`<|im_start|>`) must come out as their single ids. `decoded` is `decode(ids)`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import AutoTokenizer, __version__ as transformers_version

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world",
    " Hello, world!",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>assistant\nThe answer is 4.<|im_end|><|endoftext|>",
    "The year 2024 had 366 days; 1,234,567.89 is a number. x=12345",
    "    def square(x):\n        return x ** 2\n\n\nprint(square(3))\n",
    "Ünïcödé: naïve café, Привет мир, 你好世界, こんにちは, 안녕하세요",
    "emoji: 🦙🚀😶‍🌫️✅ and flags 🇫🇷",
    "tabs\tand\n\nnewlines\r\n   trailing spaces   ",
    "I'm sure they'll've done it, y'all. DON'T SHOUT",
    "<repo_name>ferrite<file_sep>src/main.rs\nfn main() { println!(\"hi\"); }",
    "",
    " ",
    "   leading and    inner   runs",
]


def models_dir() -> Path:
    home = Path(os.environ.get("FERRITE_HOME", Path.home() / ".cache" / "ferrite"))
    return home / "models" / "smollm2"


def main() -> None:
    model_dir = models_dir()
    if not (model_dir / GGUF_NAME).is_file():
        raise SystemExit(f"{model_dir / GGUF_NAME} is missing: fetch it with `ferrite run smollm2` first")
    tok = AutoTokenizer.from_pretrained(str(model_dir), gguf_file=GGUF_NAME)
    cases = []
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids)})
    out = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "tokenizer" / "smollm2.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # One case per line: small, and diffs stay readable.
    head = json.dumps({"gguf": GGUF_NAME, "transformers": transformers_version}, ensure_ascii=False)[:-1]
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    out.write_text(f'{head}, "cases": [\n{body}\n]}}\n', encoding="utf-8")
    print(f"wrote {out} ({len(cases)} cases)")


if __name__ == "__main__":
    main()
