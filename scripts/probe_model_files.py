"""Hostile model files against the `ferrite` binary: each probe must be refused at load with a
one-line error that names the problem, never a crash and never a model that loads.

usage: python3 scripts/probe_model_files.py [FERRITE_BINARY]   (default target/release/ferrite)
Builds every probe in a temp dir (GGUF files with scripts/fuzz_seeds.py's writer, copies of
the llama fixture with a bad config.json or corrupt weights), runs `ferrite run PROBE -p hi`
on the CPU, and prints one line per probe (caught / crash / missed) and the totals per class.
"""

import hashlib
import json
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz_seeds import FIXTURES, gguf, gguf_string, gguf_value  # noqa: E402

LLAMA = {
    "general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2, "llama.context_length": 256, "llama.feed_forward_length": 128,
    "llama.block_count": 2, "llama.vocab_size": 256,
}


def gguf_probes():
    """(class, name, file bytes, phrase the error must hold; `|` separates alternatives)."""
    nested = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 4) + b"evil" + struct.pack("<I", 9)
    nested += struct.pack("<IQ", 9, 1) * 199_999 + struct.pack("<IQ", 4, 0)
    yield "structure", "nested metadata arrays (200,000 deep)", nested, "nest deeper than"
    embd = [("token_embd.weight", [64, 256], 0, bytes(64 * 256 * 4))]
    data_start = len(embd_file([64, 256], 0))
    for name, dims, offset, phrase in [
        ("tensor offset that wraps (2^64 - data_start - 64)", [64, 256], 2**64 - data_start - 64, "past the end"),
        ("tensor dims whose product overflows", [2**32, 2**32, 2**32], 0, "overflows"),
        ("tensor offset off the alignment", [64, 256], 4, "alignment"),
        ("tensor past the end of the file", [64, 256], 2**20, "past the end|data ends at"),
    ]:
        yield "structure", name, embd_file(dims, offset) + bytes(64 * 256 * 4), phrase
    for key, value, phrase in [
        ("llama.rope.freq_base", float("nan"), "freq_base) is NaN"),
        ("llama.rope.freq_base", -10000.0, "freq_base) is -10000"),
        ("llama.rope.freq_base", 0.0, "freq_base) is 0"),
        ("llama.attention.layer_norm_rms_epsilon", -1e-5, "rms_norm_eps is -0.00001"),
        ("llama.attention.layer_norm_rms_epsilon", float("nan"), "rms_norm_eps is NaN"),
        ("llama.rope.dimension_count", 0, "rotary dim"),
        ("llama.context_length", 0, "is 0 (expected 16"),
        ("llama.context_length", 1, "is 1 (expected 16"),
        ("llama.attention.head_count", 0, "num_attention_heads is 0|num_attention_heads must be positive"),
        ("llama.attention.head_count_kv", 3, "not a multiple"),
    ]:
        yield "GGUF metadata", f"{key} = {value}", gguf(dict(LLAMA, **{key: value}), embd), phrase


def embd_file(dims: list, offset: int) -> bytes:
    """LLAMA's metadata and one f32 tensor `token_embd.weight` at `offset`, padded to the data
    section (which the caller appends)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 1, len(LLAMA))
    for k, v in LLAMA.items():
        ty, b = gguf_value(v)
        out += gguf_string(k) + struct.pack("<I", ty) + b
    out += gguf_string("token_embd.weight") + struct.pack("<I", len(dims))
    out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", 0, offset)
    return out + b"\0" * ((-len(out)) % 32)


def hf_probes(tmp: Path):
    """(class, name, model dir, phrase) for copies of the llama fixture."""
    cfg_cases = [
        ("rope_parameters", {"rope_type": "default", "rope_theta": -1.0}, "freq_base) is -1"),
        ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": 0.0}, "rope factor is 0"),
        ("rms_norm_eps", -1e-5, "rms_norm_eps is -0.00001"),
        ("rms_norm_eps", 1e300, "rms_norm_eps is inf"),
        ("max_position_embeddings", 1, "max_position_embeddings) is 1"),
        ("num_attention_heads", 0, "num_attention_heads is 0|num_attention_heads must be positive"),
    ]
    for i, (key, value, phrase) in enumerate(cfg_cases):
        d = copy_fixture(tmp / f"cfg{i}")
        cfg = json.loads((d / "config.json").read_text())
        cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))
        yield "config.json", f"{key} = {json.dumps(value)}", d, phrase
    for i, (name, value) in enumerate([("model.norm.weight", float("nan")),
                                       ("model.layers.1.input_layernorm.weight", float("inf"))]):
        d = copy_fixture(tmp / f"norm{i}")
        st = d / "model.safetensors"
        raw = bytearray(st.read_bytes())
        n = struct.unpack("<Q", raw[:8])[0]
        start = 8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0]
        struct.pack_into("<f", raw, start + 20, value)
        st.write_bytes(raw)
        yield "weights", f"{name}[5] = {value}", d, "corrupt weights"
    for i, how in enumerate(["flipped bit in a matrix", "matrix data shifted by one value"]):
        d = copy_fixture(tmp / f"data{i}")
        st = d / "model.safetensors"
        raw = bytearray(st.read_bytes())
        digest = hashlib.sha256(raw).hexdigest()
        (d / "model.safetensors.sha256").write_text(f"{digest}  model.safetensors\n")
        n = struct.unpack("<Q", raw[:8])[0]
        s, e = json.loads(raw[8:8 + n])["model.layers.0.mlp.up_proj.weight"]["data_offsets"]
        s, e = 8 + n + s, 8 + n + e
        if i == 0:
            raw[s + 100] ^= 0x40
        else:
            raw[s:e - 4] = raw[s + 4:e]
        st.write_bytes(raw)
        yield "weights (--verify-weights)", how, d, "does not match"


def copy_fixture(d: Path) -> Path:
    d.mkdir(parents=True)
    for f in ["config.json", "model.safetensors"]:
        shutil.copy(FIXTURES / "models" / "llama" / f, d / f)
    return d


def run(binary: str, path: Path, verify: bool) -> tuple[str, str]:
    args = [binary, "run", str(path), "-p", "hi", "--device", "cpu", "--threads", "1", "-n", "1"]
    p = subprocess.run(args + (["--verify-weights"] if verify else []), capture_output=True, text=True,
                       timeout=120, env={"RUST_BACKTRACE": "1", "PATH": "/usr/bin:/bin"})
    err = p.stderr.strip()
    if p.returncode < 0 or p.returncode == 101 or "panicked" in err:
        return "crash", f"exit {p.returncode}"
    return "exit1" if p.returncode == 1 else f"exit {p.returncode}", err.splitlines()[-1] if err else ""


def main() -> None:
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/release/ferrite"
    totals: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        probes = []
        for i, (cls, name, data, phrase) in enumerate(gguf_probes()):
            p = tmp / f"probe{i}.gguf"
            p.write_bytes(data)
            probes.append((cls, name, p, phrase))
        probes += list(hf_probes(tmp))
        for cls, name, path, phrase in probes:
            outcome, last = run(binary, path, cls.endswith("(--verify-weights)"))
            named = any(p in last for p in phrase.split("|"))
            caught = outcome == "exit1" and named and last.startswith("error: ")
            verdict = "caught" if caught else ("crash" if outcome == "crash" else "missed")
            totals.setdefault(cls, [0, 0])
            totals[cls][0] += 1
            totals[cls][1] += verdict != "caught"
            print(f"{verdict:7} {cls:27} {name:55} {last[:110]}")
    print()
    for cls, (n, bad) in totals.items():
        print(f"{cls:27} {n:3} tried {bad:3} not caught")


if __name__ == "__main__":
    main()
