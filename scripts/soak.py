#!/usr/bin/env python3
"""Soak test of `ferrite serve` (not in CI): many streaming requests over the three API surfaces,
with client aborts, bursts past the queue limit and a KV cache small enough to force preemption,
then checks that the server is whole again. Standard library only; loopback only; bounded in
count (--requests) and time (--deadline per request, --budget for the whole run).

    python3 scripts/soak.py [--bin target/release/ferrite] [--requests 10000] [--concurrency 12]

1. Starts `ferrite serve smollm2 --threads 2 --max-queue Q --kv-cache-memory K` on a free port
   (`load_test.Server`), K small enough that a full batch of the longer requests preempts.
2. Runs --requests streaming requests at --concurrency, each picked at random from OpenAI chat
   (`/v1/chat/completions`), Anthropic (`/v1/messages`) and Responses (`/v1/responses`), with
   random prompt and reply lengths (max tokens 1-48); 20 % of the clients close (FIN) or reset
   (RST) their socket after the first event. --concurrency stays under --max-queue; every
   --burst-every requests a burst of 2 x --max-queue extra requests is fired at once, so some
   get 429 (a steady client that gets one waits 0.5 s).
3. Samples the server's RSS every --rss-every requests.
4. Checks: every request ended (a complete stream with its end event, a client abort, or a 429),
   no 5xx (as the clients saw it and in the server's counters), none past --deadline, at least
   one 429 and one preemption, `/metrics` settles at 0 running / 0 waiting / no KV block used,
   RSS after warm-up flat (the last quarter's mean within 10 % of the second quarter's), and
   SIGTERM exits 0.

Prints PASS/FAIL per check and a summary (requests, outcome counts, 429s, preemptions, RSS).
"""
import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import ROOT, WORDS, Checks, Server, metrics, read_body_chunks, read_head, settled  # noqa: E402

SURFACES = ("chat", "anthropic", "responses")


def body_for(surface: str, model: str, rng: random.Random, i: int) -> tuple[str, dict]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
    text = f"({i}) Continue this list: {words}"
    max_tokens = rng.randint(1, 48)
    temperature = rng.choice([0.0, 0.7, 1.0])
    if surface == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}],
                                        "max_tokens": max_tokens, "temperature": temperature, "stream": True}
    if surface == "anthropic":
        return "/v1/messages", {"model": model, "messages": [{"role": "user", "content": text}],
                                "max_tokens": max_tokens, "temperature": temperature, "stream": True}
    return "/v1/responses", {"model": model, "input": text, "max_output_tokens": max_tokens,
                             "temperature": temperature, "stream": True, "store": False}


def is_end(data: bytes) -> bool:
    """The last event of a stream: `[DONE]`, Anthropic's `message_stop`, a Responses terminal event."""
    if data == b"[DONE]":
        return True
    try:
        kind = json.loads(data).get("type")
    except (ValueError, AttributeError):
        return False
    return kind in ("message_stop", "response.completed", "response.incomplete", "response.failed")


async def one(port: int, path: str, body: dict, abort: int) -> str:
    """One streaming request; its outcome: complete, aborted, 429, 5xx, http-NNN, error-event,
    unended."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        payload = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        await writer.drain()
        status, headers = await read_head(reader)
        if status == 429:
            return "429"
        if status >= 500:
            return "5xx"
        if status != 200:
            return f"http-{status}"
        buf, events = b"", 0
        async for piece in read_body_chunks(reader, headers):
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if b'"error"' in data and b"server_error" in data:
                        return "error-event"
                    if is_end(data):
                        return "complete"
                    events += 1
                if abort and events > 0:
                    if abort == 2:
                        writer.transport.abort()
                    return "aborted"
        return "unended"
    finally:
        if not writer.transport.is_closing():
            writer.close()


async def run(args, server: Server, c: Checks) -> None:
    rng = random.Random(args.seed)
    outcomes: dict[str, int] = {}
    rss: list[int] = []
    started = time.monotonic()
    counter = iter(range(args.requests))
    late = 0
    bursts = []

    async def request(i: int, surface: str, abort: int) -> str:
        nonlocal late
        path, body = body_for(surface, server.model, rng, i)
        try:
            got = await asyncio.wait_for(one(server.port, path, body, abort), args.deadline)
        except asyncio.TimeoutError:
            got, late = "past-deadline", late + 1
        except OSError as e:
            got = f"transport-{type(e).__name__}"
        outcomes[got] = outcomes.get(got, 0) + 1
        return got

    async def burst() -> None:
        await asyncio.gather(*(request(-1, rng.choice(SURFACES), 0) for _ in range(2 * args.max_queue)))

    async def client() -> None:
        for i in counter:
            if time.monotonic() - started > args.budget:
                return
            roll = rng.random()
            abort = 0 if roll >= 0.2 else (1 if roll < 0.1 else 2)
            if i and i % args.burst_every == 0:
                bursts.append(asyncio.ensure_future(burst()))
            if i % args.rss_every == 0:
                rss.append(server.rss_kib())
            if await request(i, rng.choice(SURFACES), abort) == "429":
                await asyncio.sleep(0.5)  # Retry-After is 1 s; the steady clients stay under the limit

    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    await asyncio.gather(*bursts)
    total = sum(outcomes.values())
    elapsed = time.monotonic() - started
    print(f"ran {total} requests in {elapsed:.0f} s: {json.dumps(outcomes, sort_keys=True)}", flush=True)
    ended = sum(outcomes.get(k, 0) for k in ("complete", "aborted", "429"))
    c.check("every request ended (complete, aborted or 429)", ended == total, json.dumps(outcomes))
    c.check("no 5xx", outcomes.get("5xx", 0) == 0 and outcomes.get("error-event", 0) == 0)
    c.check(f"none past the {args.deadline} s deadline", late == 0, f"{late} late")
    c.check("bursts past the queue limit got 429s", outcomes.get("429", 0) > 0)
    m = await settled(server.port, 60)
    preempted = m.get("ferrite_preemptions_total", 0)
    c.check("the KV cache forced preemption", preempted > 0, f"{preempted:.0f} preemptions")
    server_5xx = sum(v for k, v in m.items() if k.startswith("ferrite_http_requests_total") and 'status="5' in k)
    c.check("no 5xx in the server's counters", server_5xx == 0, f"{server_5xx:.0f}")
    idle = (m.get("ferrite_num_requests_running"), m.get("ferrite_num_requests_waiting"), m.get("ferrite_kv_blocks_used"))
    c.check("running, waiting and KV back to empty", idle == (0, 0, 0), f"running/waiting/kv used {idle}")
    rss.append(server.rss_kib())
    if len(rss) >= 8:
        q = len(rss) // 4
        early, late_rss = sum(rss[q:2 * q]) / q, sum(rss[-q:]) / q
        c.check("RSS flat after warm-up", late_rss <= early * 1.10,
                f"{early / 1024:.0f} MiB (2nd quarter) -> {late_rss / 1024:.0f} MiB (last quarter)")
    print(f"RSS samples (MiB): {[round(r / 1024) for r in rss]}", flush=True)
    st = await metrics(server.port)
    c.check("the server still answers /metrics", bool(st))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default=str(ROOT / "target/release/ferrite"))
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, default=24 << 20, help="bytes")
    p.add_argument("--burst-every", type=int, default=250)
    p.add_argument("--rss-every", type=int, default=100)
    p.add_argument("--deadline", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--budget", type=float, default=7200.0, help="seconds the whole run may take")
    p.add_argument("--seed", type=int, default=26)
    args = p.parse_args()
    server = Server(args.bin, args.model, ["--threads", "2", "--max-queue", str(args.max_queue),
                                           "--kv-cache-memory", str(args.kv_cache_memory)])
    c = Checks()
    try:
        asyncio.run(run(args, server, c))
    finally:
        code = server.stop()
    c.check("SIGTERM exits 0", code == 0, f"exit {code}")
    print(f"{c.passed} passed, {c.failed} failed", flush=True)
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
