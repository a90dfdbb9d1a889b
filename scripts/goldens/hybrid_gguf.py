"""GGUF (F32) of a hybrid fixture (qwen3_5_text -> qwen35, qwen3_next -> qwen3next), laid out as llama.cpp's
convert_hf_to_gguf.py lays these archs out (its Qwen3NextModel and Qwen3_5TextModel classes, read for the
transforms; this is our own code):

- every `(1 + w)` RMSNorm is stored with the 1 added (all norms but the DeltaNet output norm
  `linear_attn.norm`); `post_attention_layernorm` is `post_attention_norm`;
- `A_log` is stored as `-exp(A_log)` (`ssm_a`), `dt_bias` as `ssm_dt.bias`, the conv squeezed to
  `[channels, kernel]` (`ssm_conv1d`);
- qwen3next: `in_proj_qkvz` (rows grouped per key head as [q, k, v..., z...]) is split into `attn_qkv`
  ([all q, all k, all v]) and `attn_gate` (all z); `in_proj_ba` is kept as `ssm_ba`, still grouped;
- qwen35: where value heads outnumber key heads, the value heads of every per-head tensor (the v rows
  of `attn_qkv` and the conv, `attn_gate`, `ssm_beta`, `ssm_alpha`, `ssm_a`, `ssm_dt`, the columns of
  `ssm_out`) go from grouped order (key head g's value heads together) to tiled order (value head j of
  every key head together);
- experts stacked per projection (`ffn_{gate,up,down}_exps`), the router `ffn_gate_inp`, the shared
  expert `ffn_{gate,up,down}_shexp` and its gate `ffn_gate_inp_shexp`.

Metadata: the llama-style keys plus `ssm.conv_kernel`, `ssm.state_size` (key head dim), `ssm.group_count`
(key heads), `ssm.time_step_rank` (value heads), `ssm.inner_size` (value heads x value head dim),
`full_attention_interval`, `rope.dimension_count` (the partial rotary dims) and the expert counts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from roster_gguf import add_tokenizer

ARCH = {"qwen3_5_text": "qwen35", "qwen3_next": "qwen3next"}

PLAIN = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def tile(t: np.ndarray, axis: int, nk: int, r: int, d: int) -> np.ndarray:
    """Value heads along `axis` (nk groups of r heads of d) from grouped to tiled order."""
    shape = list(t.shape)
    t = t.reshape(shape[:axis] + [nk, r, d] + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(t, axis, axis + 1)).reshape(shape)


def write_hybrid_gguf(directory: Path) -> int:
    cfg = json.loads((directory / "config.json").read_text())
    arch = ARCH[cfg["model_type"]]
    tensors = load_file(directory / "model.safetensors")
    out = directory / "model.gguf"
    w = gguf.GGUFWriter(out, arch)
    w.add_name(f"ferrite tiny {arch}")
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r = nv // nk
    head_dim = cfg["head_dim"]
    rope = cfg["rope_parameters"]
    w.add_type("model")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(dv * nv)
    full = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    w.add_full_attention_interval(full[0] + 1)
    if arch == "qwen3next":
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tokenizer(w, cfg)
    tiled = arch == "qwen35" and r > 1
    qk = 2 * nk * dk
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in tensors.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if m := EXPERT.fullmatch(name):
            layer, expert, proj = m.groups()
            experts.setdefault((layer, f"ffn_{proj}_exps"), {})[int(expert)] = t
            continue
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", t)
            continue
        if name == "lm_head.weight":
            w.add_tensor("output.weight", t)
            continue
        if name == "model.norm.weight":
            w.add_tensor("output_norm.weight", t + 1)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        blk = f"blk.{layer}"
        if rest == "linear_attn.A_log":
            a = -np.exp(t)
            w.add_tensor(f"{blk}.ssm_a", tile(a, 0, nk, r, 1) if tiled else a)
            continue
        if rest == "linear_attn.dt_bias":
            w.add_tensor(f"{blk}.ssm_dt.bias", tile(t, 0, nk, r, 1) if tiled else t)
            continue
        if rest == "linear_attn.in_proj_qkvz.weight":
            groups = t.reshape(nk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = np.split(groups, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            flat = lambda x: x.reshape(-1, t.shape[1])  # noqa: E731
            w.add_tensor(f"{blk}.attn_qkv.weight", np.concatenate([flat(q), flat(k), flat(v)]))
            w.add_tensor(f"{blk}.attn_gate.weight", np.ascontiguousarray(flat(z)))
            continue
        module, kind = rest.rsplit(".", 1)
        if kind == "weight" and module.endswith("norm") and module != "linear_attn.norm":
            t = t + 1
        if module == "linear_attn.conv1d":
            t = t.reshape(t.shape[0], -1)
        if tiled:
            if module in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):
                t = np.concatenate([t[:qk], tile(t[qk:], 0, nk, r, dv)])
            elif module == "linear_attn.in_proj_z":
                t = tile(t, 0, nk, r, dv)
            elif module in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
                t = tile(t, 0, nk, r, 1)
            elif module == "linear_attn.out_proj":
                t = tile(t, 1, nk, r, dv)
        w.add_tensor(f"{blk}.{PLAIN[module]}.{kind}", np.ascontiguousarray(t))
    for (layer, gguf_name), by_expert in experts.items():
        w.add_tensor(f"blk.{layer}.{gguf_name}.weight", np.stack([by_expert[e] for e in range(len(by_expert))]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out.chmod(0o644)
    return out.stat().st_size
