#!/usr/bin/env python3
"""Tiny random-weight embedding models + reference embeddings for ferrite's embedding tests.

How to run (from the repository root, with the torch venv):

    ~/.cache/ferrite/venv-torch/bin/python scripts/goldens/make_embedding_models.py

Writes two HF model directories under tests/fixtures/models/, each with a reference.json
({"inputs": [[token ids]], "embeddings": [[f32]], "meta": {...}}):

  qwen3-embed   a Qwen3 decoder saved as a bare backbone (`Qwen3Model`, no LM head, tensor
                names without `model.`) and no sentence-transformers files: the Qwen3-Embedding
                recipe, last-token pooling of the final-normed states, L2-normalised.
  gemma3-embed  an EmbeddingGemma-shaped model: a `Gemma3TextModel` with
                use_bidirectional_attention, sliding + global layers, and the
                sentence-transformers modules EmbeddingGemma ships (mean Pooling, Dense up,
                Dense down, Normalize), with `matryoshka_dimensions` in config.json.

References come from transformers (the backbone's last_hidden_state) with the pooling, dense
layers and normalisation written out in torch as sentence-transformers defines them, one input
at a time (no padding). Weights get a larger spread than HF's init (embeddings N(0, 0.5),
linears N(0, 0.15), norm weights N(0, 0.1) around their identity) so that the states are far
from the embedding table; the script checks that the bidirectional model's embeddings differ
from the same weights run causally, and that the sliding layers' window changes them, so the
Rust tests can tell a wrong mask.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import Gemma3TextConfig, Gemma3TextModel, Qwen3Config, Qwen3Model

REPO_ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = REPO_ROOT / "tests" / "fixtures" / "models"
VOCAB = 307
# Short inputs (the decode attention kernel), long ones (the tiled / flash kernel), and inputs
# longer than the sliding window.
INPUT_LENGTHS = (1, 3, 9, 23, 40, 70)


def inputs() -> list[list[int]]:
    rng = np.random.default_rng(4321)
    return [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in INPUT_LENGTHS]


def spread(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # Gemma norms apply (1 + w), Qwen's w: both centre on their identity.
                base = 0.0 if isinstance(model, Gemma3TextModel) else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def states(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def normalize(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(v, p=2, dim=-1)


def write(name: str, model: torch.nn.Module, embeddings: list[torch.Tensor], meta: dict) -> Path:
    out = OUT_DIR / name
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    ref = {
        "inputs": inputs(),
        "embeddings": [[float(f"{x:.7g}") for x in e.tolist()] for e in embeddings],
        "meta": {"transformers": transformers.__version__, "torch": torch.__version__, **meta},
    }
    (out / "reference.json").write_text(json.dumps(ref) + "\n")
    return out


def qwen3_embed() -> None:
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = Qwen3Model(cfg).float().eval()
    spread(model, 11)
    embeddings = [normalize(states(model, ids)[-1]) for ids in inputs()]
    out = write("qwen3-embed", model, embeddings, {"pooling": "last token", "normalized": True})
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["architectures"] == ["Qwen3Model"], cfg_json["architectures"]


class Head:
    """EmbeddingGemma's sentence-transformers modules after the backbone."""

    def __init__(self, hidden: int, wide: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.up = 0.2 * torch.randn((wide, hidden), generator=g)
        self.down = 0.2 * torch.randn((hidden, wide), generator=g)

    def __call__(self, s: torch.Tensor) -> torch.Tensor:
        return normalize(s.mean(dim=0) @ self.up.T @ self.down.T)

    def save(self, out: Path, hidden: int, wide: int) -> None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
            {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
            {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"},
        ]
        (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
        pooling = {
            "word_embedding_dimension": hidden,
            "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True,
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": False,
            "include_prompt": True,
        }
        (out / "1_Pooling").mkdir()
        (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
        for sub, w in (("2_Dense", self.up), ("3_Dense", self.down)):
            (out / sub).mkdir()
            dense = {
                "in_features": w.shape[1],
                "out_features": w.shape[0],
                "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity",
            }
            (out / sub / "config.json").write_text(json.dumps(dense, indent=2) + "\n")
            save_file({"linear.weight": w.contiguous()}, str(out / sub / "model.safetensors"))


def gemma3_embed() -> None:
    def config(bidirectional: bool, window: int) -> Gemma3TextConfig:
        return Gemma3TextConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=256,
            query_pre_attn_scalar=16,
            sliding_window=window,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            use_bidirectional_attention=bidirectional,
            tie_word_embeddings=True,
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
            attn_implementation="eager",
        )

    torch.manual_seed(0)
    model = Gemma3TextModel(config(True, 16)).float().eval()
    spread(model, 23)
    head = Head(64, 128, 29)
    embeddings = [head(states(model, ids)) for ids in inputs()]

    # The same weights run causally, and with a window no input reaches: both must differ.
    for other_cfg, what in ((config(False, 16), "causal"), (config(True, 1024), "unwindowed")):
        other = Gemma3TextModel(other_cfg).float().eval()
        other.load_state_dict(model.state_dict())
        long_ids = inputs()[-1]
        cos = float(torch.dot(head(states(other, long_ids)), embeddings[-1]))
        assert cos < 0.99, f"the {what} model gives nearly the same embedding (cos {cos})"
        print(f"gemma3-embed: {what} run of the longest input has cosine {cos:.4f}")

    out = write("gemma3-embed", model, embeddings, {"pooling": "mean", "dense": [128, 64], "normalized": True})
    head.save(out, 64, 128)
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["sliding_window"] == 16 and cfg_json["use_bidirectional_attention"], cfg_json
    cfg_json["matryoshka_dimensions"] = [64, 32, 16]
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")


if __name__ == "__main__":
    qwen3_embed()
    gemma3_embed()
    print("wrote", OUT_DIR / "qwen3-embed", OUT_DIR / "gemma3-embed")
