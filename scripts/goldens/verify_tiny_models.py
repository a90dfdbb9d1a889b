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


def base_inv_freq(theta, dim):
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def rope_for_call(cfg, head_dim, seq_len):
    """(inv_freq, attention_scaling) used by a forward call whose largest position is seq_len-1."""
    rp = cfg["rope_parameters"]
    t = rp.get("rope_type", "default")
    theta = rp.get("rope_theta", 10000.0)
    inv = base_inv_freq(theta, head_dim)
    if t == "default":
        return inv, 1.0
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


def rotate(x, pos, inv, scale):
    # x: [T, H, D]; HF "rotate_half" (NeoX) layout: pairs are (i, i + D/2)
    ang = pos[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :] * scale
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :] * scale
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


class Model:
    def __init__(self, d: Path):
        self.cfg = json.loads((d / "config.json").read_text())
        self.w = {k: v.astype(np.float64) for k, v in load_file(d / "model.safetensors").items()}
        c = self.cfg
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c.get("head_dim") or c["hidden_size"] // self.nh
        self.eps = c["rms_norm_eps"]
        self.L = c["num_hidden_layers"]
        self.head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def lin(self, name, x):
        y = x @ self.w[name + ".weight"].T
        b = self.w.get(name + ".bias")
        return y + b if b is not None else y

    def forward(self, toks, start, cache):
        """Process toks at positions start..; cache: per layer list of (K, V) arrays [T, nkv, hd]."""
        T = len(toks)
        pos = np.arange(start, start + T, dtype=np.float64)
        inv, sc = rope_for_call(self.cfg, self.hd, start + T)
        x = self.w["model.embed_tokens.weight"][toks]
        for l in range(self.L):
            p = f"model.layers.{l}."
            h = rms(x, self.w[p + "input_layernorm.weight"], self.eps)
            q = self.lin(p + "self_attn.q_proj", h).reshape(T, self.nh, self.hd)
            k = self.lin(p + "self_attn.k_proj", h).reshape(T, self.nkv, self.hd)
            v = self.lin(p + "self_attn.v_proj", h).reshape(T, self.nkv, self.hd)
            if p + "self_attn.q_norm.weight" in self.w:  # qwen3
                q = rms(q, self.w[p + "self_attn.q_norm.weight"], self.eps)
                k = rms(k, self.w[p + "self_attn.k_norm.weight"], self.eps)
            q, k = rotate(q, pos, inv, sc), rotate(k, pos, inv, sc)
            if cache[l] is not None:
                k = np.concatenate([cache[l][0], k], 0)
                v = np.concatenate([cache[l][1], v], 0)
            cache[l] = (k, v)
            S = k.shape[0]
            rep = self.nh // self.nkv
            kk, vv = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            s = np.einsum("thd,shd->hts", q, kk) / math.sqrt(self.hd)
            qpos = np.arange(S - T, S)[:, None]
            s = np.where(np.arange(S)[None, :] <= qpos, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", s, vv).reshape(T, self.nh * self.hd)
            x = x + self.lin(p + "self_attn.o_proj", o)
            h = rms(x, self.w[p + "post_attention_layernorm.weight"], self.eps)
            g, u = self.lin(p + "mlp.gate_proj", h), self.lin(p + "mlp.up_proj", h)
            x = x + self.lin(p + "mlp.down_proj", g / (1 + np.exp(-g)) * u)
        x = rms(x, self.w["model.norm.weight"], self.eps)
        return x @ self.head.T

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
        # The llama family only (make_tiny_models.py); the Gemma fixtures are transformers-checked
        # by make_gemma_models.py itself.
        if json.loads((d / "config.json").read_text())["model_type"] not in ("llama", "mistral", "qwen2", "qwen3"):
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
