#!/usr/bin/env python3
"""End-to-end check of `ferrite serve` with the official OpenAI and Anthropic Python SDKs.

Starts `ferrite serve smollm2` on a free port of 127.0.0.1, runs every check below through the
unmodified SDKs (pinned: OPENAI_VERSION, ANTHROPIC_VERSION, installed into a venv under
$FERRITE_HOME/venv-e2e on first use), stops the server with SIGTERM, and prints one PASS/FAIL
line per check and a final `N passed, M failed`. Exits non-zero on any failure.

    python3 scripts/e2e_sdk.py [--bin target/release/ferrite] [--model smollm2] [-k SUBSTRING]

Checks: models list; chat; streaming chat with include_usage; completions (plain and
streaming); prefix-cache reuse reported as cached tokens (OpenAI and Anthropic); responses
(plain, streaming, previous_response_id); messages (plain, streaming, count_tokens); a forced
tool call and its round trip (OpenAI chat, Anthropic messages; forced calls' inputs validate
against their tools' schemas); `chat.completions.stream(...).get_final_completion()` on a
forced call; `parallel_tool_calls: false`; Anthropic `output_config.format`;
`embeddings.create` on a second pool model (the tiny bidirectional `gemma3-embed` fixture: token-id
inputs, the SDK's default base64 encoding, `dimensions`), on text with the tiny BERT `bert-embed`
(its WordPiece tokenizer), and on text with the real EmbeddingGemma-300M and all-MiniLM-L6-v2
when scripts/fetch_embedding_models.sh has fetched them, with a 400 for a model that cannot embed;
a clean SIGTERM shutdown.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

OPENAI_VERSION = "3.51.0"
ANTHROPIC_VERSION = "2.10.0"
ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 16
# The Anthropic SDK has no sampling arguments any more; the server still takes `temperature`.
GREEDY = {"temperature": 0}


def ferrite_home() -> Path:
    return Path(os.environ.get("FERRITE_HOME") or Path.home() / ".cache" / "ferrite")


def ensure_venv() -> None:
    """Re-run this script under the venv holding the pinned SDKs, creating it if needed."""
    venv = ferrite_home() / "venv-e2e"
    py = venv / "bin" / "python"
    pins = [f"openai=={OPENAI_VERSION}", f"anthropic=={ANTHROPIC_VERSION}"]
    stamp = venv / "ferrite-pins.txt"
    if Path(sys.prefix).resolve() == venv.resolve():
        return
    if not (py.exists() and stamp.exists() and stamp.read_text().split() == pins):
        print(f"installing {' '.join(pins)} into {venv}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *pins], check=True)
        stamp.write_text("\n".join(pins) + "\n")
    os.execv(str(py), [str(py), str(Path(__file__).resolve()), *sys.argv[1:]])


class Server:
    """`ferrite serve` on a free loopback port (--port 0; the port is read from its log)."""

    def __init__(self, binary: str, model: str, extra: list[str]):
        self.proc = subprocess.Popen(
            [binary, "serve", model, "--host", "127.0.0.1", "--port", "0", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.log: list[str] = []
        found = threading.Event()
        self.url = None

        def pump():
            for line in self.proc.stderr:
                self.log.append(line.rstrip())
                m = re.search(r"listening on (http://\S+)", line)
                if m and not found.is_set():
                    self.url = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(300) or self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "\n".join(self.log[-20:]))

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


class Checks:
    def __init__(self, only: str | None):
        self.passed = self.failed = 0
        self.only = only

    def run(self, name: str, fn) -> None:
        if self.only and self.only not in name:
            return
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
            self.failed += 1
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            print(f"FAIL {name} ({time.monotonic() - t0:.1f} s): {detail}", flush=True)
            if os.environ.get("E2E_VERBOSE"):
                traceback.print_exc()
        else:
            self.passed += 1
            print(f"PASS {name} ({time.monotonic() - t0:.1f} s)", flush=True)


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def check_openai_usage(u, label: str = "usage") -> None:
    expect(u is not None, f"{label} is missing")
    expect(u.prompt_tokens > 0, f"{label}.prompt_tokens = {u.prompt_tokens}")
    expect(u.completion_tokens > 0, f"{label}.completion_tokens = {u.completion_tokens}")
    expect(u.total_tokens == u.prompt_tokens + u.completion_tokens,
           f"{label}: total {u.total_tokens} != {u.prompt_tokens} + {u.completion_tokens}")


# A prompt long enough to fill whole KV blocks, so a repeat can be served from the prefix cache.
LONG_CONTEXT = (
    "You are a careful assistant. Here is some background that the question below depends on. "
    + " ".join(f"Fact {i}: the river number {i} flows north past the old mill and the quiet town." for i in range(12))
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}

def two_calls(a: str, b: str) -> str:
    """Two get_weather calls in the Hermes syntax the server describes tools in."""
    return "\n".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>' for c in (a, b))


# Turns that get SmolLM2 (greedy) to write two calls at once: it repeats what it is asked to.
TWO_CALL_HISTORY = [
    {"role": "user", "content": "Repeat exactly:\n" + two_calls("Oslo", "Rome")},
    {"role": "assistant", "content": two_calls("Oslo", "Rome")},
    {"role": "user", "content": "Repeat exactly:\n" + two_calls("Paris", "Madrid")},
]


def openai_checks(c: Checks, oa, model: str) -> None:
    def models():
        ids = [m.id for m in oa.models.list().data]
        expect(model in ids, f"{model} not in {ids}")

    def chat():
        r = oa.chat.completions.create(
            model=model, messages=[{"role": "system", "content": "You are terse."},
                                   {"role": "user", "content": "Name a color."}],
            max_tokens=MAX_TOKENS, temperature=0,
        )
        ch = r.choices[0]
        expect(r.object == "chat.completion", f"object {r.object}")
        expect(ch.message.role == "assistant", f"role {ch.message.role}")
        expect(isinstance(ch.message.content, str) and ch.message.content.strip() != "", f"content {ch.message.content!r}")
        expect(ch.finish_reason in ("stop", "length"), f"finish_reason {ch.finish_reason}")
        check_openai_usage(r.usage)

    def chat_stream():
        stream = oa.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count from one to five."}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
        )
        text, reasons, usage, chunks = "", [], None, 0
        for chunk in stream:
            chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage
                expect(chunk.choices == [], "the usage chunk has choices")
            for ch in chunk.choices:
                text += ch.delta.content or ""
                if ch.finish_reason:
                    reasons.append(ch.finish_reason)
        expect(chunks > 2, f"{chunks} chunks")
        expect(text.strip() != "", "no streamed content")
        expect(reasons in (["stop"], ["length"]), f"finish reasons {reasons}")
        check_openai_usage(usage, "final chunk usage")
        # Same request, not streamed: the same greedy text and counts.
        whole = oa.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count from one to five."}],
            max_tokens=MAX_TOKENS, temperature=0,
        )
        expect(whole.choices[0].message.content == text, f"stream {text!r} != whole {whole.choices[0].message.content!r}")
        expect(whole.usage.completion_tokens == usage.completion_tokens, "completion_tokens differ stream vs whole")

    def completions():
        r = oa.completions.create(model=model, prompt="The capital of France is", max_tokens=MAX_TOKENS, temperature=0)
        expect(r.object == "text_completion", f"object {r.object}")
        expect(r.choices[0].text != "", "empty text")
        check_openai_usage(r.usage)
        s = oa.completions.create(model=model, prompt="The capital of France is", max_tokens=MAX_TOKENS,
                                  temperature=0, stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        for chunk in s:
            usage = chunk.usage or usage
            text += "".join(ch.text for ch in chunk.choices)
        expect(text == r.choices[0].text, f"streamed {text!r} != {r.choices[0].text!r}")
        check_openai_usage(usage, "streamed usage")

    def cached_tokens():
        msgs = [{"role": "system", "content": LONG_CONTEXT}, {"role": "user", "content": "Which way do the rivers flow?"}]
        first = oa.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
        second = oa.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
        check_openai_usage(second.usage)
        details = second.usage.prompt_tokens_details
        expect(details is not None, "usage.prompt_tokens_details is missing")
        expect(details.cached_tokens and details.cached_tokens > 0, f"cached_tokens {details.cached_tokens}")
        expect(details.cached_tokens <= second.usage.prompt_tokens, "cached_tokens > prompt_tokens")
        expect(first.usage.prompt_tokens == second.usage.prompt_tokens, "prompt_tokens differ between repeats")

    def responses():
        r1 = oa.responses.create(model=model, instructions="You are terse.", input="My name is Ada. Say hello.",
                                 max_output_tokens=MAX_TOKENS, temperature=0)
        expect(r1.status == "completed" or r1.status == "incomplete", f"status {r1.status}")
        expect(r1.output_text.strip() != "", "empty output_text")
        u = r1.usage
        expect(u.input_tokens > 0 and u.output_tokens > 0, f"usage {u}")
        expect(u.total_tokens == u.input_tokens + u.output_tokens, f"total {u.total_tokens}")
        r2 = oa.responses.create(model=model, previous_response_id=r1.id, input="What is my name?",
                                 max_output_tokens=MAX_TOKENS, temperature=0)
        expect(r2.output_text.strip() != "", "empty output_text on the follow-up")
        expect(r2.previous_response_id == r1.id, f"previous_response_id {r2.previous_response_id}")
        # The follow-up's prompt holds the first turn: more input tokens, most of them cached.
        expect(r2.usage.input_tokens > u.input_tokens + 4,
               f"follow-up input_tokens {r2.usage.input_tokens} vs first {u.input_tokens}: history not included?")

    def responses_stream():
        # Raw events: the SDK's stream helper insists on response.completed, but a response cut
        # off by max_output_tokens ends in response.incomplete.
        types, text, final = [], "", None
        for ev in oa.responses.create(model=model, input="Say something about rivers.", stream=True,
                                      max_output_tokens=MAX_TOKENS, temperature=0):
            types.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        expect(types[:1] == ["response.created"], f"first event {types[:1]}")
        expect(types[-1:] in (["response.completed"], ["response.incomplete"]), f"last event {types[-1:]}")
        for t in ("response.output_item.added", "response.output_text.delta", "response.output_item.done"):
            expect(t in types, f"no {t} in {sorted(set(types))}")
        expect(text != "" and text == final.output_text, f"deltas {text!r} != final {final.output_text!r}")
        expect(final.usage.output_tokens > 0, "no usage on the final response")

    def tool_round_trip():
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = oa.chat.completions.create(model=model, messages=msgs, tools=[WEATHER_TOOL], tool_choice=choice,
                                           max_tokens=64, temperature=0)
            ch = r.choices[0]
            calls = ch.message.tool_calls or []
            expect(len(calls) >= 1, f"tool_choice={choice}: no tool call; content {ch.message.content!r}")
            call = calls[0]
            expect(call.type == "function" and call.function.name == "get_weather", f"call {call}")
            args = json.loads(call.function.arguments)
            expect(isinstance(args, dict), f"arguments {call.function.arguments!r}")
            expect(ch.finish_reason == "tool_calls", f"finish_reason {ch.finish_reason}")
            check_openai_usage(r.usage)
        follow = msgs + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "clear"})},
        ]
        r2 = oa.chat.completions.create(model=model, messages=follow, tools=[WEATHER_TOOL], tool_choice="none",
                                        max_tokens=MAX_TOKENS, temperature=0)
        ch2 = r2.choices[0]
        expect(not ch2.message.tool_calls, "a tool call despite tool_choice none")
        expect(isinstance(ch2.message.content, str) and ch2.message.content.strip() != "", "no answer after the tool result")
        # The same turn with a longer tool result must cost more prompt tokens: the result is in the prompt.
        longer = follow[:-1] + [dict(follow[-1], content=json.dumps({"temperature_c": 18, "sky": "clear",
                                                                      "wind": "light breeze from the west"}))]
        r3 = oa.chat.completions.create(model=model, messages=longer, tools=[WEATHER_TOOL], tool_choice="none",
                                        max_tokens=1, temperature=0)
        expect(r3.usage.prompt_tokens > r2.usage.prompt_tokens,
               f"the tool result did not reach the prompt ({r3.usage.prompt_tokens} vs {r2.usage.prompt_tokens})")

    def tool_stream():
        s = oa.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64, temperature=0,
            stream=True,
        )
        name, args, reason = "", "", None
        for chunk in s:
            for ch in chunk.choices:
                for tc in ch.delta.tool_calls or []:
                    name += (tc.function.name or "") if tc.function else ""
                    args += (tc.function.arguments or "") if tc.function else ""
                reason = ch.finish_reason or reason
        expect(name == "get_weather", f"streamed tool name {name!r}")
        expect(isinstance(json.loads(args), dict), f"streamed arguments {args!r}")
        expect(reason == "tool_calls", f"finish_reason {reason}")

    c.run("openai models.list", models)
    c.run("openai chat", chat)
    c.run("openai chat stream include_usage", chat_stream)
    c.run("openai completions (+stream)", completions)
    c.run("openai usage cached_tokens on a repeated prompt", cached_tokens)
    c.run("openai responses + previous_response_id", responses)
    c.run("openai responses stream", responses_stream)
    c.run("openai tool call round trip (required, named, none)", tool_round_trip)
    def tool_stream_final():
        # The SDK's stream helper accumulates tool-call deltas by index; a second entry with
        # the same index in one chunk would show as broken arguments or a phantom call.
        with oa.chat.completions.stream(
            model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER_TOOL],
            tool_choice="required", max_tokens=64, temperature=0,
        ) as s:
            for _ in s:
                pass
            final = s.get_final_completion()
        calls = final.choices[0].message.tool_calls or []
        expect(len(calls) == 1, f"{len(calls)} calls: {calls}")
        args = json.loads(calls[0].function.arguments)
        expect(calls[0].function.name == "get_weather" and isinstance(args.get("city"), str), f"call {calls[0]}")
        expect(final.choices[0].finish_reason == "tool_calls", f"finish_reason {final.choices[0].finish_reason}")

    def no_parallel_calls():
        # The model writes two calls here unless told not to.
        both = oa.chat.completions.create(model=model, messages=TWO_CALL_HISTORY, tools=[WEATHER_TOOL],
                                          max_tokens=80, temperature=0)
        expect(len(both.choices[0].message.tool_calls or []) == 2, f"two calls when allowed: {both.choices[0]}")
        r = oa.chat.completions.create(model=model, messages=TWO_CALL_HISTORY, tools=[WEATHER_TOOL], max_tokens=80,
                                       temperature=0, parallel_tool_calls=False)
        calls = r.choices[0].message.tool_calls or []
        expect(len(calls) == 1, f"{len(calls)} calls with parallel_tool_calls false: {calls}")
        expect(r.choices[0].finish_reason == "tool_calls", f"finish_reason {r.choices[0].finish_reason}")

    c.run("openai tool call stream (named)", tool_stream)
    c.run("openai chat.completions.stream get_final_completion (required)", tool_stream_final)
    c.run("openai parallel_tool_calls false -> one call", no_parallel_calls)


EMBED_FIXTURE = ROOT / "tests" / "fixtures" / "models" / "gemma3-embed"
EMBEDDINGGEMMA = ferrite_home() / "models" / "embeddinggemma-300m"
BERT_FIXTURE = ROOT / "tests" / "fixtures" / "models" / "bert-embed"
MINILM = ferrite_home() / "models" / "all-minilm-l6-v2"


def embedding_checks(c: Checks, oa, model: str) -> None:
    import openai

    ref = json.loads((EMBED_FIXTURE / "reference.json").read_text())

    def cosine(a, b) -> float:
        dot = sum(x * y for x, y in zip(a, b))
        return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)

    def embeddings():
        r = oa.embeddings.create(model="embed", input=ref["inputs"][:3])
        expect(len(r.data) == 3 and [d.index for d in r.data] == [0, 1, 2], f"data {r.data}")
        for d, want in zip(r.data, ref["embeddings"]):
            expect(len(d.embedding) == 64, f"{len(d.embedding)} dimensions")
            expect(cosine(d.embedding, want) >= 0.999, f"cosine {cosine(d.embedding, want)}")
        tokens = sum(len(i) for i in ref["inputs"][:3])
        expect(r.usage.prompt_tokens == tokens == r.usage.total_tokens, f"usage {r.usage}")
        # The same inputs as floats: the same vectors up to rounding. Not bit-equal: nothing
        # promises the second request the first one's step shapes, and f32 matmuls of other
        # shapes round apart by a unit in the last place (1.2e-7, seen in CI once in three
        # runs); a wrong encoding would be off by far more.
        floats = oa.embeddings.create(model="embed", input=ref["inputs"][:3], encoding_format="float")
        gap = max(abs(a - b) for f, d in zip(floats.data, r.data) for a, b in zip(f.embedding, d.embedding))
        expect(gap <= 1e-5, f"float and base64 encodings differ by {gap}")

    def dimensions():
        r = oa.embeddings.create(model="embed", input=ref["inputs"][4], dimensions=32)
        v = r.data[0].embedding
        expect(len(v) == 32 and abs(sum(x * x for x in v) - 1) < 1e-4, f"{len(v)} values")

    def cannot_embed():
        try:
            oa.embeddings.create(model=model, input="hello")
        except openai.BadRequestError as e:
            expect("does not make embeddings" in str(e), str(e))
            return
        raise AssertionError(f"{model} made an embedding")

    def embeddinggemma_text():
        r = oa.embeddings.create(model="embeddinggemma", input=["The capital of France is Paris.",
                                                                 "Paris is the capital of France."])
        a, b = (d.embedding for d in r.data)
        expect(len(a) == 768 and cosine(a, b) > 0.8, f"{len(a)} dimensions, cosine {cosine(a, b)}")

    def bert_text():
        bert = json.loads((BERT_FIXTURE / "reference.json").read_text())
        r = oa.embeddings.create(model="bert", input=bert["texts"])
        for i, (d, want) in enumerate(zip(r.data, bert["embeddings"])):
            expect(len(d.embedding) == 32 and cosine(d.embedding, want) >= 0.999, f"text {i}: {cosine(d.embedding, want)}")
        tokens = sum(len(i) for i in bert["text_ids"])
        expect(r.usage.prompt_tokens == tokens, f"usage {r.usage} (texts cut at max_seq_length: {tokens} tokens)")

    def minilm_text():
        r = oa.embeddings.create(model="minilm", input=["The capital of France is Paris.",
                                                         "Paris is the capital of France."])
        a, b = (d.embedding for d in r.data)
        expect(len(a) == 384 and cosine(a, b) > 0.8, f"{len(a)} dimensions, cosine {cosine(a, b)}")

    c.run("openai embeddings.create", embeddings)
    c.run("openai embeddings.create on BERT text", bert_text)
    c.run("openai embeddings.create dimensions", dimensions)
    c.run("openai embeddings.create on a model that cannot embed -> 400", cannot_embed)
    if (EMBEDDINGGEMMA / ".done").is_file():
        c.run("openai embeddings.create on EmbeddingGemma text", embeddinggemma_text)
    else:
        print("SKIP openai embeddings.create on EmbeddingGemma text: run scripts/fetch_embedding_models.sh")
    if (MINILM / ".done").is_file():
        c.run("openai embeddings.create on all-MiniLM-L6-v2 text", minilm_text)
    else:
        print("SKIP openai embeddings.create on all-MiniLM-L6-v2 text: run scripts/fetch_embedding_models.sh minilm")


def anthropic_checks(c: Checks, an, model: str) -> None:
    def check_usage(u, label="usage"):
        expect(u.input_tokens > 0, f"{label}.input_tokens = {u.input_tokens}")
        expect(u.output_tokens > 0, f"{label}.output_tokens = {u.output_tokens}")

    def messages():
        m = an.messages.create(model=model, max_tokens=MAX_TOKENS, system="You are terse.", extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Name a fruit."}])
        expect(m.type == "message" and m.role == "assistant", f"{m.type} {m.role}")
        expect(m.content and m.content[0].type == "text" and m.content[0].text.strip() != "", f"content {m.content}")
        expect(m.stop_reason in ("end_turn", "max_tokens", "stop_sequence"), f"stop_reason {m.stop_reason}")
        check_usage(m.usage)
        n = an.messages.count_tokens(model=model, system="You are terse.",
                                     messages=[{"role": "user", "content": "Name a fruit."}])
        expect(n.input_tokens == m.usage.input_tokens, f"count_tokens {n.input_tokens} != usage {m.usage.input_tokens}")

    def messages_stream():
        kinds, text = [], ""
        with an.messages.stream(model=model, max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Tell me about the sea."}]) as s:
            for ev in s:
                kinds.append(ev.type)
                if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                    text += ev.delta.text
            final = s.get_final_message()
        expect(kinds[:1] == ["message_start"], f"first event {kinds[:1]}")
        expect(kinds[-1:] == ["message_stop"], f"last event {kinds[-1:]}")
        for k in ("content_block_start", "content_block_delta", "content_block_stop", "message_delta"):
            expect(k in kinds, f"no {k} in {kinds}")
        expect(text != "" and final.content[0].text == text, f"deltas {text!r} vs final {final.content}")
        check_usage(final.usage, "final usage")
        plain = an.messages.create(model=model, max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Tell me about the sea."}])
        expect(plain.content[0].text == text, f"stream {text!r} != plain {plain.content[0].text!r}")
        expect(plain.usage.output_tokens == final.usage.output_tokens, "output_tokens differ stream vs plain")

    def cache_read():
        msgs = [{"role": "user", "content": LONG_CONTEXT + "\nWhich way do the rivers flow?"}]
        an.messages.create(model=model, max_tokens=4, extra_body=GREEDY, messages=msgs)
        m = an.messages.create(model=model, max_tokens=4, extra_body=GREEDY, messages=msgs)
        expect((m.usage.cache_read_input_tokens or 0) > 0, f"cache_read_input_tokens {m.usage.cache_read_input_tokens}")

    def tool_round_trip():
        tool = {"name": "get_weather", "description": "Get the current weather in a city.",
                "input_schema": WEATHER_TOOL["function"]["parameters"]}
        # A forced call's input is constrained to its tool's schema: these enums and bounds hold.
        forecast = {"name": "get_forecast", "description": "Forecast for a city.", "input_schema": {
            "type": "object", "required": ["city", "days", "unit"],
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        for choice, tools in (({"type": "any"}, [tool, forecast]), ({"type": "tool", "name": "get_weather"}, [tool]),
                              ({"type": "tool", "name": "get_forecast"}, [tool, forecast])):
            m = an.messages.create(model=model, max_tokens=64, extra_body=GREEDY, tools=tools, tool_choice=choice,
                                   messages=msgs)
            uses = [b for b in m.content if b.type == "tool_use"]
            expect(len(uses) >= 1, f"tool_choice={choice}: no tool_use in {m.content}")
            want = choice.get("name") or uses[0].name
            expect(uses[0].name == want and isinstance(uses[0].input, dict), f"tool_use {uses[0]}")
            schema = {t["name"]: t["input_schema"] for t in tools}.get(uses[0].name)
            expect(schema is not None, f"tool_use names no offered tool: {uses[0]}")
            inp = uses[0].input
            expect(set(schema["required"]) <= set(inp) <= set(schema["properties"]), f"input keys {inp}")
            if uses[0].name == "get_forecast":
                expect(isinstance(inp["days"], int) and 1 <= inp["days"] <= 7, f"days {inp}")
                expect(inp["unit"] in ("celsius", "fahrenheit"), f"unit {inp}")
            expect(m.stop_reason == "tool_use", f"stop_reason {m.stop_reason}")
            check_usage(m.usage)
            if tools == [tool]:
                use = uses[0]

        def follow_up(result: dict):
            follow = msgs + [
                {"role": "assistant",
                 "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": json.dumps(result)}]},
            ]
            return an.messages.create(model=model, max_tokens=MAX_TOKENS, extra_body=GREEDY, tools=[tool],
                                      tool_choice={"type": "none"}, messages=follow)

        def prompt_tokens(m) -> int:
            return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)

        m2 = follow_up({"temperature_c": 18, "sky": "clear"})
        texts = [b.text for b in m2.content if b.type == "text"]
        expect(texts and texts[0].strip() != "", f"no text after the tool result: {m2.content}")
        # A longer tool result must cost more prompt tokens: the result is in the prompt.
        m3 = follow_up({"temperature_c": 18, "sky": "clear", "wind": "light breeze from the north-west"})
        expect(prompt_tokens(m3) > prompt_tokens(m2),
               f"the tool result did not reach the prompt ({prompt_tokens(m3)} vs {prompt_tokens(m2)})")

    c.run("anthropic messages + count_tokens", messages)
    c.run("anthropic messages stream", messages_stream)
    c.run("anthropic usage cache_read_input_tokens on a repeated prompt", cache_read)
    def output_format():
        schema = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
                  "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
        m = an.messages.create(model=model, max_tokens=60, messages=[{"role": "user", "content": "A forecast as JSON."}],
                               extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
        value = json.loads(m.content[0].text)
        expect(set(value) == {"city", "days"} and isinstance(value["city"], str) and 1 <= value["days"] <= 7,
               f"not valid under the schema: {value}")

    c.run("anthropic tool_use round trip (any, named)", tool_round_trip)
    c.run("anthropic output_config.format json_schema", output_format)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.environ.get("FERRITE_BIN", str(ROOT / "target" / "release" / "ferrite")))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("-k", dest="only", help="run only the checks whose name contains this")
    ap.add_argument("--api-key", default="e2e-secret", help="the key the server is started with")
    args = ap.parse_args()
    ensure_venv()
    from anthropic import Anthropic
    from openai import OpenAI

    pool = ["--model", f"embed={EMBED_FIXTURE}", "--model", f"bert={BERT_FIXTURE}"]
    if (EMBEDDINGGEMMA / ".done").is_file():
        pool += ["--model", f"embeddinggemma={EMBEDDINGGEMMA}"]
    if (MINILM / ".done").is_file():
        pool += ["--model", f"minilm={MINILM}"]
    server = Server(args.bin, args.model, ["--api-key", args.api_key, *pool])
    print(f"ferrite serve {args.model} at {server.url}", flush=True)
    c = Checks(args.only)
    try:
        oa = OpenAI(base_url=server.url + "/v1", api_key=args.api_key, timeout=120, max_retries=0)
        an = Anthropic(base_url=server.url, api_key=args.api_key, timeout=120, max_retries=0)
        c.run("sdk versions", lambda: (expect(__import__("openai").__version__ == OPENAI_VERSION, "openai"),
                                       expect(__import__("anthropic").__version__ == ANTHROPIC_VERSION, "anthropic")))

        def wrong_key():
            import openai
            bad = OpenAI(base_url=server.url + "/v1", api_key="wrong", timeout=30, max_retries=0)
            try:
                bad.models.list()
            except openai.AuthenticationError:
                return
            raise AssertionError("a wrong API key was accepted")

        c.run("openai wrong api key -> 401", wrong_key)
        openai_checks(c, oa, args.model)
        anthropic_checks(c, an, args.model)
        embedding_checks(c, oa, args.model)
    finally:
        code = server.stop()
    if not args.only:
        c.run("server exits 0 on SIGTERM", lambda: expect(code == 0, f"exit status {code}; log tail: {server.log[-3:]}"))
    print(f"{c.passed} passed, {c.failed} failed", flush=True)
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
