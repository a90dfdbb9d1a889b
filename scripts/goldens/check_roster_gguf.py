#!/usr/bin/env python3
"""Check the roster fixtures' model.gguf against what llama.cpp's own converter writes for them.

usage: python scripts/goldens/check_roster_gguf.py LLAMA_CPP_DIR [NAME...]

LLAMA_CPP_DIR is a llama.cpp source tree with convert_hf_to_gguf.py, conversion/ and gguf-py/ (for
example vendor/llama.cpp inside the llama-cpp-python 0.3.36 sdist). For each fixture the script runs
that converter in this process on config.json + model.safetensors with --outtype f32. The tiny
models have no tokenizer, so the converter's set_vocab is replaced by one that writes nothing; the
tokenizer.* keys are therefore not compared, nor general.* naming keys, which depend on the
directory name. Everything else must agree: every metadata key and value, every tensor name, type,
shape and byte, except the keys in EXTRA, which ours adds on purpose. Exits non-zero if any fixture
differs.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models"
NAMES = ("phi3", "olmo2", "glm4", "granite", "starcoder2", "smollm3")
# Keys that name the file rather than describe the model.
# Keys ours adds on purpose (see roster_gguf.py).
EXTRA = {"starcoder2": {"starcoder2.attention.sliding_window"}}
SKIPPED_PREFIXES = ("tokenizer.", "general.name", "general.basename", "general.size_label", "general.finetune",
                    "general.quantization_version", "GGUF.")


def converter(llama_cpp: Path):
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    sys.path.insert(0, str(llama_cpp))
    import gguf
    from conversion import ModelBase, get_model_architecture, get_model_class
    from conversion.base import ModelType

    def convert(src: Path, out: Path):
        hparams = ModelBase.load_hparams(src, False)
        cls = get_model_class(get_model_architecture(hparams, ModelType.TEXT))
        for klass in cls.__mro__:
            if "set_vocab" in vars(klass):
                klass.set_vocab = lambda self: None
        model = cls(src, gguf.LlamaFileType.ALL_F32, out, eager=True)
        model.write()

    return gguf, convert


def fields(reader):
    out = {}
    for name, field in reader.fields.items():
        if name.startswith(SKIPPED_PREFIXES):
            continue
        out[name] = field.contents()
    return out


def tensors(reader):
    return {t.name: (t.tensor_type.name, [int(x) for x in t.shape], np.asarray(t.data)) for t in reader.tensors}


def compare(gguf, name: str, convert) -> list[str]:
    ours_path = FIXTURES / name / "model.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / name
        src.mkdir()
        for f in ("config.json", "model.safetensors"):
            shutil.copy(FIXTURES / name / f, src / f)
        theirs_path = Path(tmp) / "theirs.gguf"
        convert(src, theirs_path)
        ours, theirs = gguf.GGUFReader(ours_path), gguf.GGUFReader(theirs_path)
        problems = []
        fo, ft = fields(ours), fields(theirs)
        for key in sorted(fo.keys() | ft.keys()):
            if key not in ft and key in EXTRA.get(name, ()):
                continue
            if key not in ft:
                problems.append(f"key {key} = {fo[key]!r}: llama.cpp does not write it")
            elif key not in fo:
                problems.append(f"key {key} = {ft[key]!r}: missing")
            elif fo[key] != ft[key]:
                problems.append(f"key {key}: ours {fo[key]!r}, llama.cpp {ft[key]!r}")
        to, tt = tensors(ours), tensors(theirs)
        for tname in sorted(to.keys() | tt.keys()):
            if tname not in tt:
                problems.append(f"tensor {tname}: llama.cpp does not write it")
            elif tname not in to:
                problems.append(f"tensor {tname} {tt[tname][:2]}: missing")
            elif to[tname][:2] != tt[tname][:2]:
                problems.append(f"tensor {tname}: ours {to[tname][:2]}, llama.cpp {tt[tname][:2]}")
            elif not np.array_equal(to[tname][2], tt[tname][2]):
                problems.append(f"tensor {tname}: values differ")
        return problems, f"{len(fo)} keys, {len(to)} tensors"


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    logging.basicConfig(level=logging.WARNING)
    gguf, convert = converter(Path(sys.argv[1]))
    names = sys.argv[2:] or NAMES
    failed = False
    for name in names:
        problems, counts = compare(gguf, name, convert)
        print(f"{name} ({counts}): {'same as llama.cpp' if not problems else f'{len(problems)} differences'}")
        for p in problems:
            print(f"   {p}")
        failed |= bool(problems)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
