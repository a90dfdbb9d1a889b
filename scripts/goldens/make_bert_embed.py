#!/usr/bin/env python3
"""A tiny random-weight BERT embedder (all-MiniLM-L6-v2's layout and tokenizer, trimmed) and its
sentence-transformers reference, for ferrite's BERT tests.

How to run (from the repository root, after `scripts/fetch_embedding_models.sh minilm`, whose
tokenizer this trims):

    /work/venv/bin/python scripts/goldens/make_bert_embed.py

Writes tests/fixtures/models/bert-embed/: a `BertModel` (2 layers, 32 wide, 2 heads, exact GELU,
64 learned positions, 2 token types, the pooler MiniLM's files carry too) saved by transformers;
MiniLM's WordPiece tokenizer.json (BertNormalizer lower-casing and stripping accents,
BertPreTokenizer, `[CLS] $A [SEP]`) with its vocabulary cut to the specials, single characters
and their `##` pieces, a few CJK characters and the pieces of the texts below, renumbered; and
the sentence-transformers modules MiniLM ships (mean Pooling, Normalize) with
max_seq_length 24. reference.json holds:

  texts, text_ids      the texts and the ids sentence-transformers feeds the model (truncated at
                       max_seq_length: the last text is longer);
  inputs, embeddings   those ids plus token-id inputs of 1, 40 and 64 tokens (past
                       max_seq_length, within the 64 positions), and each input's embedding:
                       sentence-transformers' for the texts, and for every input the mean of
                       transformers' last_hidden_state, L2-normalised (the two agree; checked).

Weights get a larger spread than HF's init (embeddings N(0, 0.5), linears N(0, 0.15), biases
N(0, 0.1), LayerNorm weights 1 + N(0, 0.1); the MLP's up projection N(0, 0.4), so that its
activations reach where the tanh GELU is furthest from the exact one). The script checks that
the embeddings change by far more than the Rust tests allow (1e-4 per value: ferrite's f16 KV
cache rounds keys and values) when the same weights attend causally or read token type 1, and
prints how much the tanh GELU changes them (about 6e-5: the exact GELU is checked by the
runtime's unit test, not here).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np
import sentence_transformers
import torch
import transformers
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer
from transformers import BertConfig, BertModel

REPO_ROOT = Path(__file__).resolve().parents[2]
HOME = Path(os.environ.get("FERRITE_HOME", Path.home() / ".cache" / "ferrite"))
MINILM = HOME / "models" / "all-minilm-l6-v2"
OUT = REPO_ROOT / "tests" / "fixtures" / "models" / "bert-embed"
MAX_SEQ = 24
POSITIONS = 64

TEXTS = [
    "The capital of France is Paris.",
    "Naïve café owners serve crème brûlée!",
    "北京是中国的首都。",
    "Unbelievableness, xyzzy and QUICK brown foxes...",
    "e-mail me: jane@example.com (call 555-0199)",
    "a",
    "The river carried silt from the mountains to the delta, where farmers planted rice in spring; "
    "their villages grew along the levees.",
]
ID_LENGTHS = (1, 40, 64)


def trimmed_vocab(full: dict[str, int]) -> list[str]:
    """The kept pieces, in MiniLM's order."""
    real = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
    keep = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    for piece in full:
        core = piece[2:] if piece.startswith("##") else piece
        if len(core) == 1 and (core.isascii() or core in "北京中国的首都"):
            keep.add(piece)
    for text in TEXTS:
        keep.update(real.encode(text, add_special_tokens=False).tokens)
    # Left out so that words split differently from MiniLM (and one becomes [UNK]).
    keep -= {"unbelievable", "##ness", "quick", "brown"}
    return sorted(keep, key=lambda p: full[p])


def write_tokenizer(out: Path) -> Tokenizer:
    spec = json.loads((MINILM / "tokenizer.json").read_text())
    pieces = trimmed_vocab(spec["model"]["vocab"])
    ids = {p: i for i, p in enumerate(pieces)}
    spec["model"]["vocab"] = ids
    for t in spec["added_tokens"]:
        t["id"] = ids[t["content"]]
    for name, t in spec["post_processor"]["special_tokens"].items():
        t["ids"] = [ids[name]]
    spec["truncation"] = None
    spec["padding"] = None
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False, indent=1) + "\n")
    (out / "vocab.txt").write_text("".join(p + "\n" for p in pieces))
    for name in ("tokenizer_config.json", "special_tokens_map.json", "modules.json"):
        shutil.copy(MINILM / name, out / name)
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ, "do_lower_case": False}) + "\n")
    (out / "1_Pooling").mkdir()
    pooling = json.loads((MINILM / "1_Pooling" / "config.json").read_text())
    pooling["word_embedding_dimension"] = 32
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def config(**changes) -> BertConfig:
    base = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=POSITIONS,
        type_vocab_size=2,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
        pad_token_id=0,
        attn_implementation="eager",
    )
    base.update(changes)
    return BertConfig(**base)


def spread(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embeddings" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "intermediate" in name:
                # Wide pre-activations, where the tanh GELU is furthest from the exact one.
                p.copy_(0.4 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def pooled(model: BertModel, ids: list[int], token_type: int = 0) -> torch.Tensor:
    with torch.no_grad():
        x = torch.tensor([ids])
        states = model(input_ids=x, token_type_ids=torch.full_like(x, token_type)).last_hidden_state[0]
    return torch.nn.functional.normalize(states.mean(dim=0), dim=-1)


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    tok = write_tokenizer(OUT)
    vocab = tok.get_vocab_size()
    torch.manual_seed(0)
    model = BertModel(config(vocab_size=vocab)).float().eval()
    spread(model, 37)
    model.save_pretrained(OUT)

    st = SentenceTransformer(str(OUT), device="cpu", model_kwargs={"torch_dtype": torch.float32})
    assert st.max_seq_length == MAX_SEQ, st.max_seq_length
    text_ids = [st.tokenizer(t, truncation=True, max_length=MAX_SEQ)["input_ids"] for t in TEXTS]
    assert len(st.tokenizer(TEXTS[-1])["input_ids"]) > MAX_SEQ and len(text_ids[-1]) == MAX_SEQ
    assert any(st.tokenizer.unk_token_id in ids for ids in text_ids), "no text has an unknown piece"
    rng = np.random.default_rng(4321)
    id_inputs = [[int(t) for t in rng.integers(5, vocab, size=n)] for n in ID_LENGTHS]
    inputs = text_ids + id_inputs
    embeddings = [pooled(model, ids) for ids in inputs]
    for i, t in enumerate(TEXTS):
        via_st = st.encode([t], convert_to_tensor=True)[0]
        cos = float(torch.dot(via_st, embeddings[i]))
        assert cos > 0.999999, f"text {i}: sentence-transformers and the manual pooling differ ({cos})"

    # Mistakes the Rust tests must be able to see: a causal mask, the tanh GELU, token type 1.
    # (The largest change over the inputs of each; the Rust test allows 1e-4 per value.)
    def largest_change(other: BertModel, token_type: int = 0) -> float:
        return max(float((pooled(other, ids, token_type) - e).abs().max()) for ids, e in zip(inputs, embeddings))

    for what, other_cfg, least in (("causal", config(vocab_size=vocab, is_decoder=True), 1e-2),
                                   ("tanh GELU", config(vocab_size=vocab, hidden_act="gelu_pytorch_tanh"), 0.0)):
        other = BertModel(other_cfg).float().eval()
        other.load_state_dict(model.state_dict())
        gap = largest_change(other)
        print(f"bert-embed: the {what} run changes an embedding value by up to {gap:.2e}")
        assert gap > least, f"the {what} model gives nearly the same embeddings"
    gap = largest_change(model, token_type=1)
    print(f"bert-embed: token type 1 changes an embedding value by up to {gap:.2e}")
    assert gap > 1e-2

    ref = {
        "max_seq_length": MAX_SEQ,
        "texts": TEXTS,
        "text_ids": text_ids,
        "inputs": inputs,
        "embeddings": [[float(f"{x:.8g}") for x in e.tolist()] for e in embeddings],
        "meta": {
            "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__,
            "torch": torch.__version__,
        },
    }
    (OUT / "reference.json").write_text(json.dumps(ref, ensure_ascii=False) + "\n")
    print("wrote", OUT, "vocab", vocab, "input lengths", [len(i) for i in inputs])


if __name__ == "__main__":
    main()
