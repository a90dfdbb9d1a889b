"""GGUF (F32) of a roster or MoE fixture's weights, with the tensor names, metadata keys and q/k row order that
llama.cpp's convert_hf_to_gguf.py (llama-cpp-python 0.3.36's vendor/llama.cpp) writes for that arch.

`write_gguf(name, directory)` reads directory/config.json + model.safetensors and writes
directory/model.gguf. scripts/goldens/check_roster_gguf.py checks the result against the converter
itself; the tokenizer section is a placeholder (the tests feed token ids), see TOKENIZER below.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

# fixture -> GGUF arch name (gguf.MODEL_ARCH_NAMES)
ARCH = {
    "phi3": "phi3",
    "olmo2": "olmo2",
    "glm4": "glm4",
    "granite": "granite",
    "starcoder2": "starcoder2",
    "smollm3": "smollm3",
    "qwen3-moe": "qwen3moe",
    # llama.cpp's converter writes Mixtral as llama with expert tensors.
    "mixtral": "llama",
}

# HF tensor name suffix (after model.layers.N.) -> GGUF name suffix (after blk.N.), per family.
COMMON_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
LAYER = {
    "phi3": {**COMMON_LAYER, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "olmo2": {
        **COMMON_LAYER,
        "post_attention_layernorm": "post_attention_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    },
    "glm4": {
        **COMMON_LAYER,
        "post_self_attn_layernorm": "post_attention_norm",
        "post_mlp_layernorm": "post_ffw_norm",
        "mlp.gate_up_proj": "ffn_up",
    },
    "granite": COMMON_LAYER,
    "starcoder2": {**COMMON_LAYER, "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"},
    "smollm3": COMMON_LAYER,
    "qwen3-moe": {
        **COMMON_LAYER,
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate": "ffn_gate_inp",
    },
    "mixtral": {**COMMON_LAYER, "block_sparse_moe.gate": "ffn_gate_inp"},
}
# One expert's projection (model.layers.N.<block>.experts.E.<proj>.weight) -> the GGUF tensor that stacks
# that projection of every expert of the layer ([experts, rows, cols]).
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
EXPERT_GGUF = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}
# llama.cpp runs these archs with its interleaved ("NORM") rope, so the converter permutes the HF q/k
# rows from rotate-half order (pairs i, i + d/2) to adjacent pairs (2i, 2i + 1) within each head.
# glm4 is NORM too but HF's Glm4 already rotates adjacent pairs: no permutation.
PERMUTE_QK = {"granite", "smollm3", "mixtral"}

# Placeholder vocabulary: `<tN>` pieces, SentencePiece-style ("llama") so no merges are needed.
TOKENIZER = "llama"


def hf_to_gguf_name(name: str, family: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "lm_head.weight":
        return "output.weight"
    if name.startswith("model.norm."):
        return "output_norm." + name.rsplit(".", 1)[1]
    prefix, layer, rest = name.split(".", 3)[1:]
    assert prefix == "layers", name
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER[family][module]}.{kind}"


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Within each head, reorder rows [x0..x(d/2-1), y0..y(d/2-1)] to [x0, y0, x1, y1, ...]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_metadata(w: gguf.GGUFWriter, family: str, cfg: dict, qtype: gguf.GGMLQuantizationType | None) -> None:
    rope = cfg["rope_parameters"]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    w.add_type("model")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(rope["rope_theta"])
    if family == "starcoder2":
        w.add_layer_norm_eps(cfg["norm_epsilon"])
    else:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if family == "phi3":
        orig = cfg["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg["hidden_size"]) // n_head)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        scale = cfg["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
    if family in ("granite", "smollm3"):
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if family == "glm4":
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    if family == "granite":
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if family == "starcoder2" and cfg.get("sliding_window"):
        # Not written by llama.cpp's converter (llama.cpp runs starcoder2 without a window); added so
        # the GGUF describes the same model as config.json. Absent in real starcoder2 GGUFs.
        w.add_sliding_window(cfg["sliding_window"])
    if family in ("qwen3-moe", "mixtral"):
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if family == "qwen3-moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if family != "granite" and "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype is None else gguf.LlamaFileType.MOSTLY_Q8_0)


def add_tokenizer(w: gguf.GGUFWriter, cfg: dict) -> None:
    vocab = cfg["vocab_size"]
    bos, eos = cfg["bos_token_id"], cfg["eos_token_id"]
    w.add_tokenizer_model(TOKENIZER)
    w.add_token_list([f"<t{i}>".encode() for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    types = [gguf.TokenType.NORMAL] * vocab
    types[0] = gguf.TokenType.UNKNOWN
    types[bos] = types[eos] = gguf.TokenType.CONTROL
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)


def add(w: gguf.GGUFWriter, name: str, t: np.ndarray, qtype: gguf.GGMLQuantizationType | None) -> None:
    """Add `t` as F32, or (a matrix whose rows fit the type's blocks) quantized to `qtype`."""
    if qtype is None or t.ndim < 2 or t.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        w.add_tensor(name, np.ascontiguousarray(t))
    else:
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t), qtype), raw_dtype=qtype)


def write_gguf(family: str, directory: Path, qtype: gguf.GGMLQuantizationType | None = None, file_name: str = "model.gguf") -> int:
    """Write directory/file_name (matrices F32, or quantized to `qtype`); returns its size in bytes."""
    cfg = json.loads((directory / "config.json").read_text())
    tensors = load_file(directory / "model.safetensors")
    out = directory / file_name
    w = gguf.GGUFWriter(out, ARCH[family])
    w.add_name(f"ferrite tiny {family}")
    add_metadata(w, family, cfg, qtype)
    add_tokenizer(w, cfg)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in tensors.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if m := EXPERT.fullmatch(name):
            layer, expert, proj = m.groups()
            experts.setdefault((layer, EXPERT_GGUF[proj]), {})[int(expert)] = t
            continue
        if family in PERMUTE_QK and ".self_attn.q_proj." in name:
            t = permute_rows(t, n_head)
        elif family in PERMUTE_QK and ".self_attn.k_proj." in name:
            t = permute_rows(t, n_kv)
        add(w, hf_to_gguf_name(name, family), t, qtype)
    for (layer, gguf_name), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in range(len(by_expert))])
        add(w, f"blk.{layer}.{gguf_name}.weight", stacked, qtype)
    if family == "phi3":
        rope = cfg["rope_parameters"]
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out.chmod(0o644)
    return out.stat().st_size
