#!/usr/bin/env python3
"""The agent frameworks of issue 25's client table, run for real against `ferrite serve`.

Installs pinned versions on first use (pip into venvs under $FERRITE_HOME: venv-frameworks for
litellm, LangChain, pydantic-ai and the Agents SDK; venv-frameworks-llamaindex, whose
llama-index pins an older openai; venv-frameworks-aider, which pins its own litellm; npm for
promptfoo under $FERRITE_HOME/promptfoo), starts two servers (SmolLM2 for plain, stream,
structured output and errors; qwen2.5-coder-0.5b for the tool round trips, with the tool
forced where the client allows it) and checks per client: plain, stream, tool round trip,
structured output, errors (a 4xx surfaced as the client's own error type). Each Python client
runs in its venv (this script, re-run there with --client). Prints one line per check and a
Markdown table (pass / FAIL / n.a. per feature, with versions). Not in CI: it installs from
the registries and runs real models. Exits non-zero on any failure.

    python3 scripts/e2e_frameworks.py [--bin target/release/ferrite] [-k CLIENT]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from load_test import Server  # noqa: E402

# litellm (and aider through it) would fetch its model price map from the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# Each venv's pins, transitive conflicts settled: openai and anthropic are pinned as resolved.
VENVS = {
    "venv-frameworks": ["litellm==1.110.2", "langchain-openai==1.7.4", "langchain-anthropic==1.7.10",
                        "pydantic-ai-slim[openai,anthropic]==2.68.0", "openai-agents==0.24.0", "openai==3.57.0",
                        "anthropic==2.15.0"],
    "venv-frameworks-llamaindex": ["llama-index-llms-openai-like==0.8.1", "llama-index-core==0.14.25",
                                   "openai==2.54.0"],
    "venv-frameworks-aider": ["aider-chat==0.86.2"],
}
PROMPTFOO_VERSION = "0.121.20"
FEATURES = ["plain", "stream", "tool round trip", "structured output", "errors"]
MAX_TOKENS = 12
KEY = "sk-ferrite"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
               "required": ["city", "country"], "additionalProperties": False}
ASK_WEATHER = "What is the weather in Paris? Use the get_weather tool."
ASK_CITY = "Name a city in France and its country."


def home() -> Path:
    return Path(os.environ.get("FERRITE_HOME") or Path.home() / ".cache" / "ferrite")


def ensure_installed() -> None:
    """Create the venvs and the promptfoo install that are missing or pinned differently."""
    for name, pins in VENVS.items():
        env = home() / name
        stamp = env / "ferrite-pins.txt"
        if not (stamp.exists() and stamp.read_text().split() == pins):
            print(f"installing {' '.join(pins)} into {env}", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(env)], check=True)
            subprocess.run([str(env / "bin/python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            *pins], check=True)
            stamp.write_text("\n".join(pins) + "\n")
    npm = home() / "promptfoo"
    installed = npm / "node_modules/promptfoo/package.json"
    if not (installed.exists() and json.loads(installed.read_text())["version"] == PROMPTFOO_VERSION):
        npm.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", f"promptfoo@{PROMPTFOO_VERSION}"],
                       cwd=npm, check=True)


def expect(cond, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def is_4xx(e: Exception) -> bool:
    status = getattr(e, "status_code", None) or getattr(getattr(e, "response", None), "status_code", None)
    return isinstance(status, int) and 400 <= status < 500


class Table:
    """Results per client and feature; a feature never run is n.a. with its reason."""

    def __init__(self):
        self.rows = {}

    @property
    def failed(self) -> int:
        return sum(cell == "FAIL" for row in self.rows.values() for cell in row.values())

    def client(self, name: str, version: str):
        row = self.rows.setdefault(name, {"version": version, "notes": []})

        def check(feature: str, fn, passed: str = "pass"):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
                row[feature] = "FAIL"
                detail = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[-1][:300]
                print(f"FAIL {name} {feature}: {detail}", flush=True)
                row["notes"].append(f"{feature}: {detail}")
            else:
                row[feature] = passed
                print(f"PASS {name} {feature}", flush=True)

        def na(feature: str, why: str):
            row[feature] = "n.a."
            row["notes"].append(f"{feature}: {why}")

        return check, na

    def markdown(self) -> str:
        out = ["| client (pinned) | " + " | ".join(FEATURES) + " | notes |",
               "| --- | " + " | ".join("---" for _ in FEATURES) + " | --- |"]
        for name, row in self.rows.items():
            cells = [row.get(f, "not run") for f in FEATURES]
            out.append(f"| {name} {row['version']} | " + " | ".join(cells) + " | " + "; ".join(row["notes"]) + " |")
        return "\n".join(out)


def version(dist: str) -> str:
    from importlib.metadata import version as v
    return v(dist)


def check_litellm(t: Table, smol: str, qwen: str) -> None:
    import litellm
    check, _ = t.client("litellm", version("litellm"))
    kw = {"api_key": KEY, "max_tokens": MAX_TOKENS, "temperature": 0}
    user = [{"role": "user", "content": "Say hello."}]

    def plain():
        r = litellm.completion(model="openai/smollm2", api_base=smol, messages=user, **kw)
        expect(r.choices[0].message.content, f"no text: {r}")

    def stream():
        text = "".join(c.choices[0].delta.content or "" for c in
                       litellm.completion(model="openai/smollm2", api_base=smol, messages=user, stream=True, **kw))
        expect(text, "no streamed text")

    def tools():
        msgs = [{"role": "user", "content": ASK_WEATHER}]
        r = litellm.completion(model="openai/qwen2.5-coder-0.5b", api_base=qwen, messages=msgs, tools=[WEATHER],
                               tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw | {"max_tokens": 40})
        call = r.choices[0].message.tool_calls[0]
        expect(call.function.name == "get_weather" and "city" in json.loads(call.function.arguments), f"{call}")
        msgs += [r.choices[0].message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        r = litellm.completion(model="openai/qwen2.5-coder-0.5b", api_base=qwen, messages=msgs, tools=[WEATHER], **kw)
        expect(r.choices[0].message.content or r.choices[0].message.tool_calls, f"no answer: {r}")

    def structured():
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
        r = litellm.completion(model="openai/smollm2", api_base=smol, response_format=fmt,
                               messages=[{"role": "user", "content": ASK_CITY}], **kw | {"max_tokens": 40})
        expect(set(json.loads(r.choices[0].message.content)) == {"city", "country"}, r.choices[0].message.content)

    def errors():
        try:
            litellm.completion(model="openai/no-such-model", api_base=smol, messages=user, **kw)
        except litellm.exceptions.NotFoundError as e:
            expect("does not exist" in str(e), str(e))
        else:
            raise AssertionError("no error for an unknown model")

    for feature, fn in zip(FEATURES, (plain, stream, tools, structured, errors)):
        check(feature, fn)


def check_langchain(t: Table, name: str, chat, not_found, smol: str, qwen: str, structured: dict) -> None:
    """One LangChain chat model class (`chat`) against the two servers at `smol` and `qwen`;
    `not_found` is its provider SDK's 404 error, `structured` the `with_structured_output`
    options."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from pydantic import BaseModel
    check, _ = t.client(name, version(name))
    llm = chat(model="smollm2", base_url=smol, api_key=KEY, max_tokens=MAX_TOKENS, temperature=0)

    class City(BaseModel):
        city: str
        country: str

    def tools():
        q = chat(model="qwen2.5-coder-0.5b", base_url=qwen, api_key=KEY, max_tokens=40, temperature=0)
        msgs = [HumanMessage(ASK_WEATHER)]
        ai = q.bind_tools([WEATHER], tool_choice="get_weather").invoke(msgs)
        expect(ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather", f"{ai}")
        msgs += [ai, ToolMessage("sunny, 21 C", tool_call_id=ai.tool_calls[0]["id"])]
        expect(q.bind_tools([WEATHER]).invoke(msgs) is not None, "no answer")

    def errors():
        try:
            chat(model="no-such-model", base_url=smol, api_key=KEY, max_tokens=4).invoke("hi")
        except not_found as e:
            expect(e.status_code == 404, str(e))
        else:
            raise AssertionError("no error for an unknown model")

    check("plain", lambda: expect(llm.invoke("Say hello.").content, "no text"))
    check("stream", lambda: expect("".join(str(c.content) for c in llm.stream("Say hello.")), "no streamed text"))
    check("tool round trip", tools)
    check("structured output", lambda: expect(
        isinstance(chat(model="smollm2", base_url=smol, api_key=KEY, max_tokens=40, temperature=0)
                   .with_structured_output(City, **structured).invoke(ASK_CITY), City),
        "not a City"))
    check("errors", errors)


def check_langchain_openai(t: Table, smol: str, qwen: str) -> None:
    import openai
    from langchain_openai import ChatOpenAI
    check_langchain(t, "langchain-openai", ChatOpenAI, openai.NotFoundError, smol, qwen, {"method": "json_schema"})


def check_langchain_anthropic(t: Table, smol: str, qwen: str) -> None:
    import anthropic
    from langchain_anthropic import ChatAnthropic
    # Anthropic's base URL has no /v1; with_structured_output forces a tool call whose input
    # is the schema.
    check_langchain(t, "langchain-anthropic", ChatAnthropic, anthropic.NotFoundError,
                    smol.removesuffix("/v1"), qwen.removesuffix("/v1"), {})


def check_llama_index(t: Table, smol: str, qwen: str) -> None:
    import openai
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike
    from pydantic import BaseModel
    check, _ = t.client("llama-index OpenAILike", version("llama-index-llms-openai-like"))

    def like(model, base, **kw):
        return OpenAILike(model=model, api_base=base, api_key=KEY, is_chat_model=True,
                          is_function_calling_model=True, temperature=0, **kw)

    llm = like("smollm2", smol, max_tokens=MAX_TOKENS)
    hello = [ChatMessage(role="user", content="Say hello.")]

    class City(BaseModel):
        city: str
        country: str

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    def tools():
        q = like("qwen2.5-coder-0.5b", qwen, max_tokens=40)
        tool = FunctionTool.from_defaults(fn=get_weather)
        r = q.chat_with_tools([tool], user_msg=ASK_WEATHER, tool_required=True)
        calls = q.get_tool_calls_from_response(r, error_on_no_tool_call=True)
        expect(calls[0].tool_name == "get_weather", f"{calls}")
        result = tool(**calls[0].tool_kwargs)
        msgs = [ChatMessage(role="user", content=ASK_WEATHER), r.message,
                ChatMessage(role="tool", content=str(result), additional_kwargs={"tool_call_id": calls[0].tool_id})]
        expect(q.chat(msgs).message is not None, "no answer")

    def errors():
        try:
            like("no-such-model", smol, max_tokens=4, max_retries=0).chat(hello)
        except openai.NotFoundError as e:
            expect(e.status_code == 404, str(e))
        else:
            raise AssertionError("no error for an unknown model")

    check("plain", lambda: expect(llm.chat(hello).message.content, "no text"))
    check("stream", lambda: expect("".join(c.delta or "" for c in llm.stream_chat(hello)), "no streamed text"))
    check("tool round trip", tools)
    check("structured output", lambda: expect(
        isinstance(like("smollm2", smol, max_tokens=40).as_structured_llm(City).chat(
            [ChatMessage(role="user", content=ASK_CITY)]).raw, City), "not a City"))
    check("errors", errors)


def check_pydantic_ai(t: Table, smol: str, qwen: str) -> None:
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import ModelHTTPError
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    check, _ = t.client("pydantic-ai", version("pydantic-ai-slim"))

    def model(name, base):
        return OpenAIChatModel(name, provider=OpenAIProvider(base_url=base, api_key=KEY))

    settings = ModelSettings(max_tokens=MAX_TOKENS, temperature=0)
    agent = Agent(model("smollm2", smol), model_settings=settings)

    class City(BaseModel):
        city: str
        country: str

    def stream():
        async def go():
            async with agent.run_stream("Say hello.") as r:
                return "".join([d async for d in r.stream_text(delta=True)])
        import asyncio
        expect(asyncio.run(go()), "no streamed text")

    def tools():
        seen = []
        # A structured output forces a tool call every turn (pydantic-ai sets tool_choice
        # "required"); the model calls get_weather, gets its result, then the output tool.
        tooled = Agent(model("qwen2.5-coder-0.5b", qwen), model_settings=ModelSettings(max_tokens=40, temperature=0),
                       output_type=City)

        @tooled.tool_plain
        def get_weather(city: str) -> str:
            """The current weather in a city."""
            seen.append(city)
            return f"sunny in {city}"

        r = tooled.run_sync(ASK_WEATHER)
        expect(seen and isinstance(r.output, City), f"tool calls {seen}, output {r.output!r}")

    def errors():
        try:
            Agent(model("no-such-model", smol), model_settings=settings).run_sync("hi")
        except ModelHTTPError as e:
            expect(e.status_code == 404, str(e))
        else:
            raise AssertionError("no error for an unknown model")

    check("plain", lambda: expect(agent.run_sync("Say hello.").output, "no text"))
    check("stream", stream)
    check("tool round trip", tools)
    check("structured output", lambda: expect(isinstance(Agent(
        model("smollm2", smol), output_type=City, model_settings=ModelSettings(max_tokens=40, temperature=0)
    ).run_sync(ASK_CITY).output, City), "not a City"))
    check("errors", errors)


def check_openai_agents(t: Table, smol: str, qwen: str) -> None:
    import asyncio

    import openai
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
    from pydantic import BaseModel
    set_tracing_disabled(True)
    check, _ = t.client("openai-agents", version("openai-agents"))

    def model(name, base):
        return OpenAIChatCompletionsModel(model=name, openai_client=openai.AsyncOpenAI(base_url=base, api_key=KEY))

    settings = ModelSettings(max_tokens=MAX_TOKENS, temperature=0)
    agent = Agent(name="a", instructions="Be brief.", model=model("smollm2", smol), model_settings=settings)

    class City(BaseModel):
        city: str
        country: str

    def stream():
        async def go():
            # A client of this event loop's own (run_sync's loop is gone).
            fresh = Agent(name="a", instructions="Be brief.", model=model("smollm2", smol), model_settings=settings)
            r = Runner.run_streamed(fresh, "Say hello.")
            text = ""
            async for e in r.stream_events():
                if e.type == "raw_response_event" and getattr(e.data, "type", "") == "response.output_text.delta":
                    text += e.data.delta
            return text
        expect(asyncio.run(go()), "no streamed text")

    def tools():
        seen = []

        @function_tool
        def get_weather(city: str) -> str:
            """The current weather in a city."""
            seen.append(city)
            return f"sunny in {city}"

        # tool_choice "required" is reset after the first call (reset_tool_choice), so the
        # second turn answers in text.
        tooled = Agent(name="w", model=model("qwen2.5-coder-0.5b", qwen), tools=[get_weather],
                       model_settings=ModelSettings(max_tokens=40, temperature=0, tool_choice="required"))
        r = Runner.run_sync(tooled, ASK_WEATHER, max_turns=3)
        expect(seen and r.final_output is not None, f"tool calls {seen}, output {r.final_output!r}")

    def errors():
        bad = Agent(name="e", model=model("no-such-model", smol), model_settings=settings)
        try:
            Runner.run_sync(bad, "hi")
        except openai.NotFoundError as e:
            expect(e.status_code == 404, str(e))
        else:
            raise AssertionError("no error for an unknown model")

    check("plain", lambda: expect(Runner.run_sync(agent, "Say hello.").final_output, "no text"))
    check("stream", stream)
    check("tool round trip", tools)
    check("structured output", lambda: expect(isinstance(Runner.run_sync(Agent(
        name="s", model=model("smollm2", smol), output_type=City,
        model_settings=ModelSettings(max_tokens=40, temperature=0)), ASK_CITY).final_output, City), "not a City"))
    check("errors", errors)


def check_aider(t: Table, smol: str, _qwen: str) -> None:
    aider = home() / "venv-frameworks-aider/bin/aider"
    ver = subprocess.run([str(aider), "--version"], capture_output=True, text=True).stdout.split()[-1]
    check, na = t.client("aider", ver)

    def run(model: str, stream: bool) -> subprocess.CompletedProcess:
        repo = Path(tempfile.mkdtemp(prefix="ferrite-aider-"))
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
        (repo / "hello.py").write_text("print('hi')\n")
        env = os.environ | {"OPENAI_API_BASE": smol, "OPENAI_API_KEY": KEY, "AIDER_ANALYTICS": "false"}
        args = [str(aider), "--model", f"openai/{model}", "--message", "Say hello in one word.", "--yes-always",
                "--no-auto-commits", "--no-check-update", "--no-show-model-warnings", "--map-tokens", "0",
                "--no-gitignore", "--no-pretty", "--stream" if stream else "--no-stream", "--no-analytics"]
        return subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=400)

    def ok(stream: bool):
        p = run("smollm2", stream)
        expect(p.returncode == 0 and "Tokens:" in p.stdout, f"rc {p.returncode}: {p.stdout[-400:]} {p.stderr[-400:]}")

    def errors():
        p = run("no-such-model", False)
        expect("NotFoundError" in p.stdout + p.stderr, f"rc {p.returncode}: {p.stdout[-400:]}")

    check("plain", lambda: ok(False))
    check("stream", lambda: ok(True))
    na("tool round trip", "aider edits through text formats, no tool calls")
    na("structured output", "aider sends none")
    check("errors", errors)


def check_promptfoo(t: Table, smol: str, qwen: str) -> None:
    bin_ = home() / "promptfoo/node_modules/.bin/promptfoo"
    check, na = t.client("promptfoo", PROMPTFOO_VERSION)

    def evaluate(provider: dict, prompt: str, asserts: list) -> None:
        work = Path(tempfile.mkdtemp(prefix="ferrite-promptfoo-"))
        cfg = {"prompts": [prompt], "providers": [provider], "tests": [{"assert": asserts}]}
        (work / "promptfooconfig.json").write_text(json.dumps(cfg))
        env = os.environ | {"PROMPTFOO_DISABLE_TELEMETRY": "1", "PROMPTFOO_DISABLE_UPDATE": "1",
                            "PROMPTFOO_CONFIG_DIR": str(work), "OPENAI_API_KEY": KEY}
        p = subprocess.run([str(bin_), "eval", "-c", "promptfooconfig.json", "--no-cache", "-o", "out.json"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=300)
        out = work / "out.json"
        expect(out.exists(), f"no results: {p.stdout[-400:]} {p.stderr[-400:]}")
        results = json.loads(out.read_text())["results"]
        stats = results["stats"]
        expect(stats["successes"] == 1, json.dumps(results["results"])[:600])

    def provider(model, base, **config):
        return {"id": f"openai:chat:{model}", "config": {"apiBaseUrl": base, "max_tokens": MAX_TOKENS,
                                                         "temperature": 0} | config}

    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
    check("plain", lambda: evaluate(provider("smollm2", smol), "Say hello.",
                                    [{"type": "javascript", "value": "output.length > 0"}]))
    na("stream", "promptfoo's OpenAI provider does not stream")
    # promptfoo evaluates one turn: its tool check is the forced call, validated against the tool.
    check("tool round trip", lambda: evaluate(
        provider("qwen2.5-coder-0.5b", qwen, tools=[WEATHER], max_tokens=40,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        ASK_WEATHER, [{"type": "is-valid-openai-tools-call"}]), passed="pass (the call; one turn)")
    check("structured output", lambda: evaluate(provider("smollm2", smol, response_format=fmt, max_tokens=40),
                                                ASK_CITY, [{"type": "is-json", "value": CITY_SCHEMA}]))
    check("errors", lambda: expect_error(evaluate, provider("no-such-model", smol)))


def expect_error(evaluate, provider: dict) -> None:
    """promptfoo records a provider's 4xx as the test's error; the eval then has no success."""
    try:
        evaluate(provider, "hi", [{"type": "javascript", "value": "true"}])
    except AssertionError as e:
        expect("404" in str(e) and "does not exist" in str(e), str(e))
    else:
        raise AssertionError("no error for an unknown model")


CLIENTS = {  # name: (the venv it runs in, or None for this process; its checks)
    "litellm": ("venv-frameworks", check_litellm),
    "langchain-openai": ("venv-frameworks", check_langchain_openai),
    "langchain-anthropic": ("venv-frameworks", check_langchain_anthropic),
    "llama-index": ("venv-frameworks-llamaindex", check_llama_index),
    "pydantic-ai": ("venv-frameworks", check_pydantic_ai),
    "openai-agents": ("venv-frameworks", check_openai_agents),
    "aider": (None, check_aider),
    "promptfoo": (None, check_promptfoo),
}


def run_in_venv(t: Table, name: str, venv: str, smol: str, qwen: str) -> None:
    """Run one client's checks under its venv; its row comes back as the last stdout line."""
    py = home() / venv / "bin/python"
    p = subprocess.run([str(py), str(Path(__file__).resolve()), "--client", name, "--smol", smol, "--qwen", qwen],
                       stdout=subprocess.PIPE, text=True)
    lines = p.stdout.splitlines()
    print("\n".join(lines[:-1]), flush=True)
    if lines and lines[-1].startswith("ROW "):
        t.rows.update(json.loads(lines[-1][4:]))
    else:
        t.rows[name] = {"version": "?", "notes": [f"the checks did not finish (exit {p.returncode})"]} | {
            f: "FAIL" for f in FEATURES}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=str(ROOT / "target/release/ferrite"))
    ap.add_argument("-k", dest="only", help="run only the clients whose name contains this")
    ap.add_argument("--client", help=argparse.SUPPRESS)  # one client, inside its venv
    ap.add_argument("--smol", help=argparse.SUPPRESS)
    ap.add_argument("--qwen", help=argparse.SUPPRESS)
    args = ap.parse_args()
    t = Table()
    if args.client:
        CLIENTS[args.client][1](t, args.smol, args.qwen)
        print("ROW " + json.dumps(t.rows), flush=True)
        return 0
    ensure_installed()
    smol = Server(args.bin, "smollm2", [])
    qwen = Server(args.bin, "qwen2.5-coder-0.5b", [])
    try:
        s, q = f"http://127.0.0.1:{smol.port}/v1", f"http://127.0.0.1:{qwen.port}/v1"
        for name, (venv, check) in CLIENTS.items():
            if args.only and args.only not in name:
                continue
            if venv:
                run_in_venv(t, name, venv, s, q)
            else:
                check(t, s, q)
    finally:
        smol.stop()
        qwen.stop()
    print()
    print(t.markdown())
    print(f"\n{t.failed} failed")
    return 1 if t.failed else 0


if __name__ == "__main__":
    sys.exit(main())
