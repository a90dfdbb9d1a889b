#!/usr/bin/env python3
"""Fill strict vs plain decoding on forced tool calls, through `ferrite serve`.

Starts `ferrite serve MODEL --threads T` (the server start of scripts/e2e_sdk.py), then sends
the same tool-calling conversation with `fill: off` and `fill: strict`, alternating, ROUNDS
times each after one warm-up pair, greedy, one request at a time. Per mode it prints the median
completion time (client side, whole response), the engine's forward passes per request (from
/metrics' `ferrite_forward_passes_total`), the completion tokens and the tokens fill asserted,
and checks that both modes return the same token ids. Standard library only.

    python3 scripts/bench_fill_tools.py [--bin target/release/ferrite] [--model qwen2.5-coder-0.5b]
        [--threads 2] [--rounds 7] [--choice required|get_forecast]

Run it under `chrt -f 10` on a shared machine so other work does not preempt the server.
"""
import argparse
import json
import statistics
import time
import urllib.request

from e2e_sdk import Server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "Weather forecast for a city over some days.",
    "parameters": {"type": "object", "required": ["city", "days", "unit"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
MESSAGES = [
    {"role": "system", "content": "You are a weather assistant. Use the tools to answer."},
    {"role": "user", "content": "I am travelling to Lyon next week. What will the weather be there for the next 3 days?"},
]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def forward_passes(base: str) -> int:
    with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("ferrite_forward_passes_total "):
                return int(line.split()[1])
    raise RuntimeError("no ferrite_forward_passes_total in /metrics")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="target/release/ferrite")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--choice", default="required", help="'required' or the name of the tool to force")
    args = ap.parse_args()
    choice = args.choice if args.choice == "required" else {"type": "function", "function": {"name": args.choice}}
    server = Server(args.bin, args.model, ["--threads", str(args.threads)])
    try:
        url = server.url + "/v1/chat/completions"
        results = {"off": [], "strict": []}
        tokens = {}
        for rnd in range(args.rounds + 1):
            for fill in ("off", "strict"):
                body = {"messages": MESSAGES, "tools": [WEATHER, FORECAST], "tool_choice": choice, "max_tokens": 96,
                        "temperature": 0, "return_token_ids": True, "fill": fill}
                before = forward_passes(server.url)
                t0 = time.perf_counter()
                resp = post(url, body)
                elapsed = time.perf_counter() - t0
                passes = forward_passes(server.url) - before
                ids = resp["choices"][0]["token_ids"]
                if tokens.setdefault(fill, ids) != ids:
                    raise RuntimeError(f"{fill}: the output changed between rounds")
                if rnd > 0:
                    injected = resp["usage"].get("fill", {}).get("injected_tokens", 0)
                    results[fill].append((elapsed, passes, len(ids), injected))
        call = resp["choices"][0]["message"]["tool_calls"][0]["function"]
        print(f"call: {call['name']}({call['arguments']})")
        print(f"same token ids in both modes: {tokens['off'] == tokens['strict']}")
        for fill, runs in results.items():
            ms = statistics.median(r[0] for r in runs) * 1000
            print(f"fill {fill:6}: median {ms:7.1f} ms over {len(runs)} requests "
                  f"(min {min(r[0] for r in runs) * 1000:.1f}), forward passes {runs[0][1]}, "
                  f"completion tokens {runs[0][2]}, asserted {runs[0][3]}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
