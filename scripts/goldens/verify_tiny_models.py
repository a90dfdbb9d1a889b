#!/usr/bin/env python3
"""Independent numpy (float64) re-implementation of the tiny fixture models, used to check that
tests/fixtures/models/*/reference.json says what tests/fixtures/models/README.md says it does.

    pip install numpy safetensors
    python scripts/goldens/verify_tiny_models.py

It reads only config.json + model.safetensors (no transformers), recomputes the full-prompt logits and
the greedy continuations (with a KV cache, following the rope rules documented in the README,
including transformers' stateful dynamic-NTK behaviour) and compares them to reference.json.
Exit status 1 on any mismatch.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "glm4", "granite", "starcoder2", "smollm3")


def base_inv_freq(theta, dim):
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def rope_for_call(cfg, head_dim, seq_len):
    """(inv_freq, attention_scaling) used by a forward call whose largest position is seq_len-1.
    head_dim here is the rotated width (head_dim * partial_rotary_factor)."""
    rp = cfg["rope_parameters"]
    t = rp.get("rope_type", "default")
    theta = rp.get("rope_theta", 10000.0)
    inv = base_inv_freq(theta, head_dim)
    if t == "default":
        return inv, 1.0
    if t == "longrope":
        # factors picked by this call's length; the attention factor comes from max_pos / orig always
        omax = rp["original_max_position_embeddings"]
        ext = np.array(rp["long_factor"] if seq_len > omax else rp["short_factor"], dtype=np.float64)
        f = rp.get("factor") or cfg["max_position_embeddings"] / omax
        af = rp.get("attention_factor") or (math.sqrt(1 + math.log(f) / math.log(omax)) if f > 1 else 1.0)
        return inv / ext, af
    if t == "linear":
        return inv / rp["factor"], 1.0
    if t == "dynamic":
        mp = cfg["max_position_embeddings"]
        s = max(seq_len, mp)
        f = rp["factor"]
        base = theta * ((f * s / mp) - (f - 1)) ** (head_dim / (head_dim - 2))
        return base_inv_freq(base, head_dim), 1.0
    if t == "llama3":
        f, lo, hi, old = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"], rp["original_max_position_embeddings"]
        wl = 2 * math.pi / inv
        out = np.where(wl > old / lo, inv / f, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / f + smooth * out
        medium = ~(wl < old / hi) & ~(wl > old / lo)
        return np.where(medium, smoothed, out), 1.0
    if t == "yarn":
        f, omax = rp["factor"], rp["original_max_position_embeddings"]
        bf, bs = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1
        af = rp.get("attention_factor") or (0.1 * math.log(f) + 1.0 if f > 1 else 1.0)

        def corr(n):
            return head_dim * math.log(omax / (n * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = max(math.floor(corr(bf)), 0), min(math.ceil(corr(bs)), head_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(head_dim // 2) - lo) / (hi - lo), 0, 1)
        extra = 1 - ramp
        return (inv / f) * (1 - extra) + inv * extra, af
    raise ValueError(t)


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def layer_norm(x, w, b, eps):
    x = x - x.mean(-1, keepdims=True)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w + b


def rotate(x, pos, inv, scale, interleaved=False):
    """x: [T, H, D]; rotates the first 2 * len(inv) dims of each head, the rest pass through.
    HF "rotate_half" (NeoX) layout: pairs are (i, i + r/2); interleaved (glm4): pairs (2i, 2i + 1)."""
    r = 2 * len(inv)
    xr, xp = x[..., :r], x[..., r:]
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :] * scale, np.sin(ang)[:, None, :] * scale
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = np.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(xr.shape)
    else:
        a, b = xr[..., : r // 2], xr[..., r // 2 :]
        out = np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
    return np.concatenate([out, xp], -1)


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


class Model:
    def __init__(self, d: Path):
        self.cfg = json.loads((d / "config.json").read_text())
        self.w = {k: v.astype(np.float64) for k, v in load_file(d / "model.safetensors").items()}
        c = self.cfg
        self.kind = c["model_type"]
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c.get("head_dim") or c["hidden_size"] // self.nh
        self.eps = c.get("rms_norm_eps", c.get("norm_epsilon"))
        self.L = c["num_hidden_layers"]
        self.head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        self.rot = int(self.hd * c["rope_parameters"].get("partial_rotary_factor", 1.0))
        self.window = c.get("sliding_window")
        self.scale = c.get("attention_multiplier", self.hd**-0.5)  # granite replaces 1/sqrt(head_dim)
        self.res = c.get("residual_multiplier", 1.0)
        self._split_fused()

    def _split_fused(self):
        """phi3: qkv_proj rows are [q; k; v], gate_up_proj rows [gate; up] (glm4 too)."""
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        for name in [n for n in self.w if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]:
            w, p = self.w.pop(name), name.rsplit(".", 2)[0] + "."
            if name.endswith("qkv_proj.weight"):
                self.w[p + "q_proj.weight"], self.w[p + "k_proj.weight"], self.w[p + "v_proj.weight"] = np.split(w, [nq, nq + nk])
            else:
                self.w[p + "gate_proj.weight"], self.w[p + "up_proj.weight"] = np.split(w, 2)

    def lin(self, name, x):
        y = x @ self.w[name + ".weight"].T
        b = self.w.get(name + ".bias")
        return y + b if b is not None else y

    def norm(self, name, x):
        if self.kind == "starcoder2":
            return layer_norm(x, self.w[name + ".weight"], self.w[name + ".bias"], self.eps)
        return rms(x, self.w[name + ".weight"], self.eps)

    def mlp(self, p, h):
        if self.kind == "starcoder2":
            return self.lin(p + "mlp.c_proj", gelu_tanh(self.lin(p + "mlp.c_fc", h)))
        g, u = self.lin(p + "mlp.gate_proj", h), self.lin(p + "mlp.up_proj", h)
        return self.lin(p + "mlp.down_proj", g / (1 + np.exp(-g)) * u)

    def attention(self, l, h, pos, rope, cache):
        p = f"model.layers.{l}.self_attn."
        T = len(h)
        q, k, v = self.lin(p + "q_proj", h), self.lin(p + "k_proj", h), self.lin(p + "v_proj", h)
        if self.kind == "olmo2":  # RMSNorm over the whole projection, before the head split
            q, k = self.norm(p + "q_norm", q), self.norm(p + "k_norm", k)
        q, k, v = q.reshape(T, self.nh, self.hd), k.reshape(T, self.nkv, self.hd), v.reshape(T, self.nkv, self.hd)
        if self.kind == "qwen3":  # per head
            q, k = self.norm(p + "q_norm", q), self.norm(p + "k_norm", k)
        if self.cfg.get("no_rope_layers", [1] * self.L)[l]:  # smollm3: 0 = NoPE layer
            inv, sc = rope
            q, k = rotate(q, pos, inv, sc, self.kind == "glm4"), rotate(k, pos, inv, sc, self.kind == "glm4")
        if cache[l] is not None:
            k = np.concatenate([cache[l][0], k], 0)
            v = np.concatenate([cache[l][1], v], 0)
        cache[l] = (k, v)
        S = k.shape[0]
        rep = self.nh // self.nkv
        kk, vv = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, kk) * self.scale
        qpos, kpos = np.arange(S - T, S)[:, None], np.arange(S)[None, :]
        visible = (kpos <= qpos) & ((kpos > qpos - self.window) if self.window else True)
        s = np.where(visible, s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, vv).reshape(T, self.nh * self.hd)
        return self.lin(p + "o_proj", o)

    def forward(self, toks, start, cache):
        """Process toks at positions start..; cache: per layer list of (K, V) arrays [T, nkv, hd]."""
        T = len(toks)
        pos = np.arange(start, start + T, dtype=np.float64)
        rope = rope_for_call(self.cfg, self.rot, start + T)
        x = self.w["model.embed_tokens.weight"][toks] * self.cfg.get("embedding_multiplier", 1.0)
        for l in range(self.L):
            p = f"model.layers.{l}."
            if self.kind == "olmo2":  # post-norms only
                x = x + self.norm(p + "post_attention_layernorm", self.attention(l, x, pos, rope, cache))
                x = x + self.norm(p + "post_feedforward_layernorm", self.mlp(p, x))
            elif self.kind == "glm4":  # sandwich norms
                a = self.attention(l, self.norm(p + "input_layernorm", x), pos, rope, cache)
                x = x + self.norm(p + "post_self_attn_layernorm", a)
                x = x + self.norm(p + "post_mlp_layernorm", self.mlp(p, self.norm(p + "post_attention_layernorm", x)))
            else:
                x = x + self.res * self.attention(l, self.norm(p + "input_layernorm", x), pos, rope, cache)
                x = x + self.res * self.mlp(p, self.norm(p + "post_attention_layernorm", x))
        x = self.norm("model.norm", x)
        return x @ self.head.T / self.cfg.get("logits_scaling", 1.0)

    def greedy(self, prompt, n, use_cache=True):
        if not use_cache:
            seq = list(prompt)
            for _ in range(n):
                logits = self.forward(seq, 0, [None] * self.L)[-1]
                seq.append(int(np.argmax(logits)))
            return seq[len(prompt):], logits
        cache = [None] * self.L
        logits = self.forward(list(prompt), 0, cache)[-1]
        out = []
        for i in range(n):
            out.append(int(np.argmax(logits)))
            if i == n - 1:
                break
            logits = self.forward([out[-1]], len(prompt) + i, cache)[-1]
        return out, logits


def main():
    bad = 0
    for d in sorted(p for p in ROOT.iterdir() if (p / "reference.json").exists()):
        # The llama family (make_tiny_models.py) and the roster (make_roster_models.py); the Gemma
        # fixtures are transformers-checked by make_gemma_models.py itself.
        if json.loads((d / "config.json").read_text())["model_type"] not in FAMILIES:
            continue
        ref = json.loads((d / "reference.json").read_text())
        m = Model(d)
        worst = 0.0
        for i, p in enumerate(ref["prompts"]):
            lg = m.forward(p, 0, [None] * m.L)
            r = np.array(ref["logits"][i])
            worst = max(worst, float(np.abs(lg - r).max()))
            toks, last = m.greedy(p, len(ref["greedy"][i]))
            if toks != ref["greedy"][i]:
                print(f"{d.name}: prompt {i} greedy mismatch\n  ours {toks}\n  ref  {ref['greedy'][i]}")
                bad += 1
            if i == 0:
                dl = float(np.abs(last - np.array(ref["greedy_logits_last"])).max())
            if "greedy_no_cache" in ref:
                nc, nc_last = m.greedy(p, len(ref["greedy"][i]), use_cache=False)
                if nc != ref["greedy_no_cache"][i]:
                    print(f"{d.name}: prompt {i} greedy_no_cache mismatch")
                    bad += 1
                if i == 0:
                    dl = max(dl, float(np.abs(nc_last - np.array(ref["greedy_logits_last_no_cache"])).max()))
        ok = worst < 1e-3 and dl < 1e-3
        bad += not ok
        print(f"{d.name:20s} max|logits diff| {worst:.2e}  last-step {dl:.2e}  {'OK' if ok else 'FAIL'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
