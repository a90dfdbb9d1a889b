#!/usr/bin/env python3
"""Reference embeddings of the real EmbeddingGemma-300M, from sentence-transformers.

How to run (from the repository root, after scripts/fetch_embedding_models.sh):

    ~/.cache/ferrite/venv-torch/bin/python scripts/goldens/embeddinggemma_reference.py

Loads $FERRITE_HOME/models/embeddinggemma-300m (default ~/.cache/ferrite) with
`SentenceTransformer` on the CPU in float32 and writes tests/fixtures/embeddinggemma_reference.json:
texts (short sentences, one with the model's query prompt, and one of about 512 tokens, past the
sliding window so the bidirectional windows matter), the token ids sentence-transformers feeds
the model (to check ferrite's tokenizer), and each text's 768-value embedding, every text
encoded on its own (no padding).
"""

import json
import os
from pathlib import Path

import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer

REPO_ROOT = Path(__file__).resolve().parents[2]
HOME = Path(os.environ.get("FERRITE_HOME", Path.home() / ".cache" / "ferrite"))
MODEL = HOME / "models" / "embeddinggemma-300m"
OUT = REPO_ROOT / "tests" / "fixtures" / "embeddinggemma_reference.json"

LONG = " ".join(
    f"Paragraph {i}: the river carried silt from the mountains to the delta, where farmers planted rice "
    f"in the spring and harvested it before the autumn floods."
    for i in range(20)
)
TEXTS = [
    "The capital of France is Paris.",
    "task: search result | query: which city is the capital of France?",
    "Rust guarantees memory safety without a garbage collector.",
    "Le chat dort sur le canapé.",
    LONG,
]


def main() -> None:
    torch.manual_seed(0)
    model = SentenceTransformer(str(MODEL), device="cpu", model_kwargs={"torch_dtype": torch.float32})
    tok = model.tokenizer
    ids = [tok(t)["input_ids"] for t in TEXTS]
    embeddings = [model.encode([t], convert_to_tensor=True)[0] for t in TEXTS]
    ref = {
        "texts": TEXTS,
        "token_ids": ids,
        "embeddings": [[float(f"{x:.7g}") for x in e.tolist()] for e in embeddings],
        "meta": {"sentence_transformers": sentence_transformers.__version__, "torch": torch.__version__},
    }
    OUT.write_text(json.dumps(ref) + "\n")
    print("wrote", OUT, "token counts", [len(i) for i in ids])


if __name__ == "__main__":
    main()
