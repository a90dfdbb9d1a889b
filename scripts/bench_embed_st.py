#!/usr/bin/env python3
"""sentence-transformers' embeddings per second, measured as `ferrite bench embed` measures
ferrite's: inputs of exactly N tokens (random ids of the model's vocabulary, special tokens
excluded, fed as token ids so tokenization is not timed), at each batch size, on the CPU with
a fixed number of threads, one warm-up batch then `--reps` measured ones, median reported.

    ~/.cache/ferrite/venv-torch/bin/python scripts/bench_embed_st.py \
        ~/.cache/ferrite/models/embeddinggemma-300m --threads 2 --input-tokens 512 --batch 1,32

and, for the same numbers from ferrite:

    ferrite bench embed ~/.cache/ferrite/models/embeddinggemma-300m --threads 2 --device cpu \
        --input-tokens 512 --batch 1,32

Prints one JSON object.
"""

import argparse
import json
import statistics
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--input-tokens", type=int, default=512)
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(1)
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(a.model, device="cpu", model_kwargs={"torch_dtype": torch.float32})
    model.eval()
    special = set(model.tokenizer.all_special_ids)
    vocab = [i for i in range(model.tokenizer.vocab_size) if i not in special]
    rng = np.random.default_rng(0)
    results = []
    for b in (int(x) for x in a.batch.split(",")):
        ids = torch.tensor(rng.choice(vocab, size=(b, a.input_tokens)), dtype=torch.long)
        features = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        def run() -> float:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model(dict(features))["sentence_embedding"]
            assert out.shape[0] == b
            return time.perf_counter() - t0

        run()
        rates = sorted(b / run() for _ in range(a.reps))
        results.append({"batch": b, "embeddings_per_s": statistics.median(rates)})
    print(json.dumps({"model": a.model, "threads": a.threads, "input_tokens": a.input_tokens,
                      "torch": torch.__version__, "results": results}))


if __name__ == "__main__":
    main()
