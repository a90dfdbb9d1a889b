#!/usr/bin/env python3
"""Chat-template goldens: real chat templates rendered by transformers' own Jinja renderer.

How to run (from the repository root, after scripts/fetch_test_assets.sh):

    /work/pyenv/bin/python scripts/goldens/chat_template_fixtures.py

Needs transformers (5.17.0 was used) with jinja2, and the `gguf` package (for SmolLM2's
template, read from ~/.cache/ferrite/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, key
`tokenizer.chat_template`; skipped with a warning if that file is absent and no stored copy
exists). Writes into tests/fixtures/chat_templates/: conversations.json (the inputs, once),
<template>.json per template (cases {name, conversation, tools, add_generation_prompt, extra}
with either `expected`, the exact text, or `expected_raise`, the raise_exception message),
and jinja2_semantics.json (small expressions and their Jinja2 output). Templates are
referenced by path relative to the test-assets dir ($FERRITE_TEST_ASSETS, default
$FERRITE_HOME/test-assets, FERRITE_HOME defaulting to ~/.cache/ferrite), except SmolLM2's,
stored next to the fixtures as smollm2.jinja. Rendering goes through
transformers.utils.chat_template_utils.render_jinja_template (what apply_chat_template calls)
with `bos_token`/`eos_token` passed as apply_chat_template passes the tokenizer's special
tokens, and `strftime_now` pinned to NOW so dated templates compare too.
"""

import json
import os
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import transformers
from transformers.utils import chat_template_utils
from transformers.utils.chat_template_utils import render_jinja_template

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "chat_templates"
HOME = Path(os.environ.get("FERRITE_HOME", Path.home() / ".cache" / "ferrite"))
ASSETS = Path(os.environ.get("FERRITE_TEST_ASSETS", HOME / "test-assets"))
SMOLLM2_GGUF = HOME / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"

NOW = datetime(2025, 3, 14, 9, 26, 53)


class FixedDatetime(datetime):
    @classmethod
    def now(cls, tz=None):
        return NOW


chat_template_utils.datetime = FixedDatetime  # strftime_now reads the module's `datetime`

# crates/ferrite-models/tests/chat_template.rs smoke-tests every template with STANDARD in its
# OpenAI shape (assistant `content: null`, `arguments` as a JSON string), which ferrite turns
# into exactly this before rendering.
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
            },
            "required": ["city"],
        },
    },
}
STANDARD = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",  # ferrite turns an OpenAI `null` into "" (vLLM does too); HF would not
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temperature": 18, "condition": "sunny"}'},
    {"role": "assistant", "content": "It is 18 °C and sunny in Paris."},
    {"role": "user", "content": "Thanks! And in Zürich?"},
]
SIMPLE = [
    {"role": "user", "content": "Hello! Who are you?"},
    {"role": "assistant", "content": "I am a helpful assistant."},
    {"role": "user", "content": "Tell me a joke."},
]
SYSTEM_SIMPLE = [{"role": "system", "content": "Be brief."}] + SIMPLE
REASONING = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 = 4.", "reasoning_content": "Add two and two."},
    {"role": "user", "content": "And 3+3?"},
]
# Mistral wants tool-call ids of 9 alphanumeric characters.
MISTRAL_IDS = json.loads(json.dumps(STANDARD).replace("call_1", "abcDEF123"))
PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
    {"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "text", "text": "a cat."}]},
]

CONVERSATIONS = {
    "standard": STANDARD,
    "simple": SIMPLE,
    "system-simple": SYSTEM_SIMPLE,
    "reasoning": REASONING,
    "parts": PARTS,
    "mistral-ids": MISTRAL_IDS,
}

LLAMA3 = ("<|begin_of_text|>", "<|eot_id|>")
CHATML = (None, "<|im_end|>")
DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
MISTRAL = ("<s>", "</s>")
GEMMA = ("<bos>", "<eos>")

# template (path under ASSETS, or a file in OUT) -> (bos, eos, extra cases)
TEMPLATES = {
    "llama.cpp-models/templates/Qwen-Qwen2.5-7B-Instruct.jinja": (*CHATML, []),
    "llama.cpp-models/templates/Qwen-Qwen3-0.6B.jinja": (
        *CHATML,
        [
            ("thinking-off", "simple", True, {"enable_thinking": False}),
            ("thinking-on", "simple", True, {"enable_thinking": True}),
            ("reasoning-content", "reasoning", True, {}),
        ],
    ),
    "llama.cpp-models/templates/Qwen-QwQ-32B.jinja": (*CHATML, []),
    "llama.cpp-models/templates/Qwen3-Coder.jinja": (*CHATML, []),
    "llama.cpp-models/templates/Qwen3.5-4B.jinja": (*CHATML, [("parts", "parts", True, {})]),
    "llama.cpp-models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja": (
        *LLAMA3,
        [("date-string", "system-simple", True, {"date_string": "01 Jan 2025"})],
    ),
    "llama.cpp-models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja": (*LLAMA3, []),
    "llama.cpp-models/templates/meta-llama-Llama-3.3-70B-Instruct.jinja": (*LLAMA3, []),
    "llama.cpp-models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja": (*MISTRAL, [("tools-9-char-ids", "mistral-ids", True, {})]),
    "llama.cpp-models/templates/Mistral-Small-3.2-24B-Instruct-2506.jinja": (*MISTRAL, [("tools-9-char-ids", "mistral-ids", True, {})]),
    "llama.cpp-models/templates/unsloth-mistral-Devstral-Small-2507.jinja": (*MISTRAL, []),
    "llama.cpp-models/templates/google-gemma-2-2b-it.jinja": (*GEMMA, [("no-generation-prompt", "simple", False, {})]),
    "lenml/gemma3/models/tokenizer_config.json": (*GEMMA, [("parts", "parts", True, {})]),
    "llama.cpp-models/templates/google-gemma-4-31B-it.jinja": (*GEMMA, []),
    "llama.cpp-models/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": (*DEEPSEEK, []),
    "llama.cpp-models/templates/deepseek-ai-DeepSeek-V3.1.jinja": (*DEEPSEEK, [("thinking", "simple", True, {"thinking": True})]),
    "llama.cpp-models/templates/microsoft-Phi-3.5-mini-instruct.jinja": ("<s>", "<|endoftext|>", []),
    "llama.cpp-models/templates/NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": (*LLAMA3, []),
    "llama.cpp-models/templates/ibm-granite-granite-3.3-2B-Instruct.jinja": (None, "<|end_of_text|>", []),
    "llama.cpp-models/templates/openai-gpt-oss-120b.jinja": (
        "<|startoftext|>",
        "<|return|>",
        [("reasoning-high", "simple", True, {"reasoning_effort": "high"})],
    ),
    "llama.cpp-models/templates/HuggingFaceTB-SmolLM3-3B.jinja": (None, "<|im_end|>", []),
    "llama.cpp-models/templates/CohereForAI-c4ai-command-r-plus-tool_use.jinja": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", []),
    "llama.cpp-models/templates/moonshotai-Kimi-K2.jinja": (None, "<|im_end|>", []),
    "llama.cpp-models/templates/GLM-4.6.jinja": (None, "<|endoftext|>", []),
    "llama.cpp-models/templates/MiniMax-M2.jinja": (None, "[e~[", []),
    "llama.cpp-models/templates/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": ("<s>", "<|im_end|>", []),
    "llama.cpp-models/templates/poolside-Laguna-XS.2.jinja": (None, "</s>", []),
    "smollm2.jinja": (None, "<|im_end|>", [("system", "system-simple", True, {})]),
}


def template_source(ref):
    if ref == "smollm2.jinja":
        stored = OUT / ref
        if SMOLLM2_GGUF.exists():
            import gguf

            reader = gguf.GGUFReader(str(SMOLLM2_GGUF))
            field = reader.fields["tokenizer.chat_template"]
            text = bytes(field.parts[field.data[0]]).decode("utf-8")
            stored.write_text(text, encoding="utf-8")
        elif not stored.exists():
            return None
        return stored.read_text(encoding="utf-8")
    path = ASSETS / ref
    if path.suffix == ".json":
        return json.loads(path.read_text(encoding="utf-8"))["chat_template"]
    return path.read_text(encoding="utf-8")


def render(source, bos, eos, messages, tools, add_generation_prompt, extra):
    kwargs = dict(extra)
    if bos is not None:
        kwargs["bos_token"] = bos
    if eos is not None:
        kwargs["eos_token"] = eos
    try:
        rendered, _ = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=source,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        return {"expected": rendered[0]}
    except jinja2.exceptions.TemplateError as e:
        if type(e) is jinja2.exceptions.TemplateError:  # raise_exception(...)
            return {"expected_raise": e.message}
        return {"hf_error": f"{type(e).__name__}: {e}"}
    except Exception as e:  # noqa: BLE001 - recorded, the case is left out
        return {"hf_error": f"{type(e).__name__}: {e}"}


# Jinja2 behaviour the renderer must copy: Python spellings, tests, filters, methods, loops.
EXPRESSIONS = [
    "{{ x is sequence }} {{ x is iterable }} {{ none is iterable }} {{ {} is sequence }} {{ 's' is sequence }} {{ 1 is iterable }}",
    "{{ x|length }}|{{ x|default(1) }}|{{ none|default(1) }}|{{ none|default(1, true) }}|{{ [1,none,True]|join(',') }}",
    "{{ none }}|{{ True }}|{{ {'a':[1,2.0, 'it\\'s']} }}|{{ 1e-5 }}|{{ none|string }}|{{ 3/2 }}|{{ 4/2 }}|{{ 7//2 }}|{{ 2**10 }}",
    "{% set n = none %}{{ n.foo is defined }}",
    "{{ '%s-%d'|format('a', 3) }}|{{ 'a b'.split() }}|{{ '  x '|trim }}|{{ 'a\\nb'|indent(2) }}|{{ 'x'|indent(2, true) }}|{{ 'a\\n\\nb\\n'|indent }}|{{ 'a\\n\\nb'|indent(blank=true) }}",
    "{% for x in [1,2,3] %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }}{{ loop.previtem }}{{ loop.nextitem }}{% if x == 2 %}{% break %}{% endif %};{% endfor %}",
    "{% for x in [1,2,3] %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{{ loop.cycle('a', 'b') }}{% endfor %}",
    "{% set ns = namespace(a=1, b=[]) %}{% for i in range(3) %}{% set ns.a = ns.a + i %}{% endfor %}{{ ns.a }}",
    "{{ {'b':1,'a':2}|tojson }}|{{ {'b':1,'a':2}|tojson(sort_keys=true) }}|{{ [1,{'x':'é'}]|tojson(indent=2) }}|{{ 'é'|tojson(ensure_ascii=true) }}|{{ {'a':[1,2]}|tojson(separators=(',', ':')) }}|{{ '<&>'|tojson }}|{{ [1.5, 1e20, 1e-7, none, false]|tojson }}",
    "{{ 'Hello World'.lower() }}|{{ 'abc'.upper() }}|{{ ' x '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ 'a,b,c'.split(',', 1) }}|{{ 'a,b,c'.rsplit(',', 1) }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x','c')) }}|{{ 'abc'.replace('b','B') }}|{{ 'a b'.title() }}|{{ 'prefix_x'.removeprefix('prefix_') }}|{{ {'a':1}.get('b', 'd') }}|{{ {'a':1}.keys()|list }}",
    "{% for k, v in {'a': 1, 'b': [2]}.items() %}{{ k }}={{ v }};{% endfor %}{% for k, v in {'b':1,'a':2}|dictsort %}{{ k }}{{ v }}{% endfor %}",
    "{{ [3,1,2]|sort }}|{{ [1,2,3]|first }}|{{ [1,2,3]|last }}|{{ ['a','b']|map('upper')|list }}|{{ [{'a':1},{'a':2}]|selectattr('a','equalto',2)|list }}|{{ 'abc'[::-1] }}|{{ [1,2,3][1:] }}|{{ [1,2,3][-1] }}",
    "{{ 'a' in 'abc' }}|{{ 'k' in {'k':1} }}|{{ 1 in [1] }}|{{ not x is defined }}|{{ (1 if true else 2) }}|{{ 'x' if false }}|{{ [] is none }}|{{ 1.0 }}|{{ 10000000000000000.0 }}|{{ -0.0 }}",
    "{{ 'Hy{}'.format(3) }}|{{ '{0}-{1}'.format('a','b') }}|{{ 'abc'|capitalize }}|{{ 'a-b'|replace('-', '_') }}|{{ ['a',['b']]|string }}|{{ 'x'|list }}|{{ 5|string }}|{{ true|int }}|{{ '3'|int + 1 }}",
    "{%- set x -%}\n  block {{ 1 }}\n{%- endset -%}[{{ x }}]{% filter upper %}up{% endfilter %}",
    "{% macro m(a, b='d') %}{{ a }}{{ b }}{{ caller() if caller is defined }}{% endmacro %}{{ m(1) }}{% call m(2, 'e') %}C{% endcall %}",
    "  {% if true %}\n    x\n  {% endif %}\n{{- ' y' }}\n{# c #}\nz\n",
    "{% generation %}kept{% endgeneration %}\n  {%- generation -%}\n  trimmed\n  {%- endgeneration %}",
]


def semantics():
    compile_template = chat_template_utils._compile_jinja_template
    return [{"src": src, "expected": compile_template(src).render()} for src in EXPRESSIONS]


def write(path, value):
    path.write_text(json.dumps(value, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def main():
    if not ASSETS.exists():
        sys.exit(f"{ASSETS} missing: run scripts/fetch_test_assets.sh first")
    OUT.mkdir(parents=True, exist_ok=True)
    print(f"transformers {transformers.__version__}, jinja2 {jinja2.__version__}", file=sys.stderr)
    generated_by = f"transformers {transformers.__version__}, jinja2 {jinja2.__version__}"
    write(OUT / "conversations.json", {"generated_by": generated_by, "tools": [TOOL], "conversations": CONVERSATIONS})
    write(OUT / "jinja2_semantics.json", {"generated_by": generated_by, "cases": semantics()})
    for ref, (bos, eos, extra_cases) in TEMPLATES.items():
        source = template_source(ref)
        if source is None:
            print(f"skip {ref}: no template", file=sys.stderr)
            continue
        cases = [("tools", "standard", True, True, {}), ("simple", "simple", False, True, {})]
        cases += [(name, conv, conv == "mistral-ids", agp, extra) for name, conv, agp, extra in extra_cases]
        out_cases = []
        for name, conv, with_tools, agp, extra in cases:
            tools = [TOOL] if with_tools else None
            result = render(source, bos, eos, CONVERSATIONS[conv], tools, agp, extra)
            if "hf_error" in result:
                print(f"  {ref} [{name}]: transformers fails ({result['hf_error'][:100]}); case left out", file=sys.stderr)
                continue
            out_cases.append(
                {"name": name, "conversation": conv, "tools": with_tools, "add_generation_prompt": agp, "extra": extra, **result}
            )
        stem = Path(ref).stem if ref.endswith(".jinja") else Path(ref).parts[1] + "-tokenizer_config"
        fixture = {
            "template": ref,
            "bos_token": bos,
            "eos_token": eos,
            "generated_by": f"transformers {transformers.__version__} render_jinja_template",
            "now": NOW.isoformat(),
            "cases": out_cases,
        }
        path = OUT / f"{stem}.json"
        write(path, fixture)
        print(f"{path.relative_to(ROOT)}: {len(out_cases)} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
