"""Seed corpora for the fuzz targets (fuzz/fuzz_targets/*.rs), written from the test fixtures.

usage: python3 scripts/fuzz_seeds.py OUT_DIR
Writes OUT_DIR/<target>/seed-N for gguf, safetensors, chat_template, output_parser, request
and sse. Needs only the standard library; the chat templates fetched by
scripts/fetch_test_assets.sh are used as well when they are there.
"""

import json
import os
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


def gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_value(v) -> tuple[int, bytes]:
    """(type id, bytes) of a metadata value: str, bool, int (u32), float (f32) or a list."""
    if isinstance(v, str):
        return 8, gguf_string(v)
    if isinstance(v, bool):
        return 7, struct.pack("<?", v)
    if isinstance(v, int):
        return 4, struct.pack("<I", v)
    if isinstance(v, float):
        return 6, struct.pack("<f", v)
    ty, _ = gguf_value(v[0])
    return 9, struct.pack("<IQ", ty, len(v)) + b"".join(gguf_value(x)[1] for x in v)


def gguf(metadata: dict, tensors: list) -> bytes:
    """A GGUF v3 file; tensors are (name, ggml dims, ggml type, data bytes)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for k, v in metadata.items():
        ty, b = gguf_value(v)
        out += gguf_string(k) + struct.pack("<I", ty) + b
    offset, data = 0, b""
    for name, dims, ty, raw in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ty, offset)
        pad = (-len(raw)) % 32
        data += raw + b"\0" * pad
        offset += len(raw) + pad
    out += b"\0" * ((-len(out)) % 32)
    return out + data


def gguf_seeds() -> list[bytes]:
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc", "abc", " ", "\u0120a", "hello", "<0x0A>", "d", "e", "f"]
    base = {
        "general.architecture": "llama",
        "llama.embedding_length": 32,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.context_length": 256,
        "llama.feed_forward_length": 64,
        "llama.block_count": 1,
        "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [float(-i) for i in range(len(tokens))],
        "tokenizer.ggml.token_type": [1] * len(tokens),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    }
    f32 = struct.pack("<8f", *[0.5 * i for i in range(8)])
    q8_0 = struct.pack("<e", 0.25) + bytes(range(32))
    tensors = [("output_norm.weight", [8], 0, f32), ("blk.0.ffn_up.weight", [32], 8, q8_0)]
    spm = dict(base, **{"tokenizer.ggml.model": "llama"})
    bpe = dict(base, **{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
                        "tokenizer.ggml.merges": ["a b", "b c", "ab c"]})
    gemma = dict(spm, **{"general.architecture": "gemma3", "gemma3.embedding_length": 32,
                         "gemma3.attention.head_count": 4, "gemma3.context_length": 256,
                         "gemma3.feed_forward_length": 64, "gemma3.block_count": 2,
                         "gemma3.attention.sliding_window": 16, "gemma3.rope.freq_base_swa": 10000.0})
    return [gguf(spm, tensors), gguf(bpe, tensors), gguf(gemma, []), gguf({}, [])]


def safetensors_seeds() -> list[bytes]:
    """Each fixture model's small (1-D) tensors, re-packed with their header."""
    seeds = []
    for path in sorted((FIXTURES / "models").glob("*/model.safetensors")):
        raw = path.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        out, data = {"__metadata__": header.get("__metadata__", {})}, b""
        for name, info in header.items():
            if name == "__metadata__" or len(info["shape"]) != 1 or len(out) > 6:
                continue
            s, e = info["data_offsets"]
            out[name] = dict(info, data_offsets=[len(data), len(data) + e - s])
            data += raw[8 + n + s:8 + n + e]
        h = json.dumps(out).encode()
        seeds.append(struct.pack("<Q", len(h)) + h + data)
    return seeds


def chat_template_seeds() -> list[bytes]:
    conv = json.loads((FIXTURES / "chat_templates" / "conversations.json").read_text())
    bodies = [json.dumps(c).encode() for c in list(conv["conversations"].values())[:4]]
    bodies.append(json.dumps({"messages": list(conv["conversations"].values())[0], "tools": conv["tools"]}).encode())
    sources = [FIXTURES / "chat_templates" / "smollm2.jinja", ROOT / "fuzz" / "templates" / "hermes.jinja"]
    assets = Path(os.environ.get("FERRITE_TEST_ASSETS", Path.home() / ".cache/ferrite/test-assets"))
    sources += sorted((assets / "llama.cpp-models" / "templates").glob("*.jinja"))[:24]
    return [s.read_bytes() + b"\0" + bodies[i % len(bodies)] for i, s in enumerate(sources)]


def output_parser_seeds() -> list[bytes]:
    texts = [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "<think>The user asks.</think>The answer is 4.",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {}}',
        "<|channel>thought\nthinking<channel|>Hello",
        "Plain text with <tags> and { braces",
    ]
    return [bytes([mode, cut]) + t.encode() for mode, t in enumerate(texts) for cut in (0, 3)]


def request_seeds() -> list[bytes]:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
              "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    bodies = [
        (0, {"messages": msgs, "max_tokens": 8, "temperature": 0.5, "stop": ["\n"]}),
        (0, {"messages": msgs, "tools": tools, "tool_choice": "required", "logprobs": True, "top_logprobs": 2}),
        (0, {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
             "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}),
        (1, {"prompt": "Once upon", "max_tokens": 4, "logit_bias": {"5": -100}, "n": 2}),
        (1, {"prompt": [[1, 2, 3], [4, 5]], "guided_regex": "[a-z]+"}),
        (2, {"input": "Hello", "instructions": "Be brief.", "max_output_tokens": 16}),
        (2, {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}], "tools": [
             {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}], "tool_choice": "auto"}),
        (3, {"model": "fuzz", "max_tokens": 16, "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]}),
        (3, {"model": "fuzz", "max_tokens": 16, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
             "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"},
             "thinking": {"type": "enabled", "budget_tokens": 1024}}),
    ]
    return [bytes([s]) + json.dumps(b).encode() for s, b in bodies]


def sse_seeds() -> list[bytes]:
    values = [{"a": "line\nbreak\r\n", "b": [1, 2.5, None, True]}, "text: with colon", {"delta": {"text": "\u00e9\u2028"}}, []]
    return [bytes([i]) + json.dumps(v).encode() for i, v in enumerate(values)]


def main() -> None:
    out = Path(sys.argv[1])
    for target, seeds in [("gguf", gguf_seeds()), ("safetensors", safetensors_seeds()),
                          ("chat_template", chat_template_seeds()), ("output_parser", output_parser_seeds()),
                          ("request", request_seeds()), ("sse", sse_seeds())]:
        d = out / target
        d.mkdir(parents=True, exist_ok=True)
        for i, s in enumerate(seeds):
            (d / f"seed-{i}").write_bytes(s)
        print(f"{target}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
