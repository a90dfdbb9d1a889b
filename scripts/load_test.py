#!/usr/bin/env python3
"""Load test of `ferrite serve`: many streaming chat requests, a fifth of whose clients hang up
mid-stream, then checks that the server is whole again. Standard library only (asyncio streams
speaking HTTP/1.1 by hand).

    python3 scripts/load_test.py [--bin target/release/ferrite] [--requests 2000] [--concurrency 64]

1. Starts `ferrite serve smollm2 --threads 2 --max-num-seqs 64 --kv-cache-memory 384 MiB` on a
   free port of 127.0.0.1 (a KV cache sized for the load, not the 2 GiB default, so that
   writing all of it during the warm-up is cheap).
2. Warm-up: distinct 120-240-word prompts (max_tokens 1) at --fill-concurrency (8) until their
   prompt tokens add up to 1.05x the KV cache. Fewer at once than the run's 64: a long prompt
   waits for the prefill of every prompt beside it, and 64 of them (~14k tokens) took longer
   than --deadline on 2 AVX2 cores before their integer GEMM (~135 prompt tok/s). The cache is
   zeroed memory that becomes resident as its blocks are first written, and the allocator
   hands out the least recently freed block, so every block gets written once and RSS
   settles. Then one round of the short workload; RSS
   (VmRSS) is read after it.
3. The run: --requests streaming chat completions at --concurrency, varied short prompts,
   max_tokens 8-16; every fifth client closes its socket after the first SSE chunk (alternately
   FIN and RST) of a longer request (max_tokens 64), so the server must notice and abort it.
4. Checks: no 5xx (as the clients saw it and in the server's own request counters), no request
   past --deadline, every kept stream ends in `data: [DONE]`, the disconnected requests were
   aborted early, then `/metrics` settles at 0 running / 0 waiting / all KV blocks free, RSS is
   within 10 % of the warm-up value, the server still answers, and SIGTERM exits 0.

Prints one PASS/FAIL line per check, a summary and `N passed, M failed`; exits non-zero on failure.
"""
import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("river mountain city music garden winter summer ocean forest bridge engine letter story "
         "window market planet circle number yellow silver quiet rapid gentle ancient modern "
         "simple history science journey morning evening island valley desert castle").split()
QUESTIONS = ["Write one sentence about {}.", "What rhymes with {}?", "Describe {} briefly.",
             "Give a title for a story about {}.", "List two facts about {}.", "Say hello to {}."]


@dataclass
class Result:
    status: int = 0
    disconnect: bool = False
    done: bool = False  # saw data: [DONE]
    finish_reason: str | None = None
    chunks: int = 0
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0


@dataclass
class Totals:
    results: list = field(default_factory=list)

    def count(self, pred) -> int:
        return sum(1 for r in self.results if pred(r))


class Server:
    """`ferrite serve` on a free loopback port (--port 0; the port is read from its log)."""

    def __init__(self, binary: str, model: str, args: list[str]):
        self.model = model
        self.proc = subprocess.Popen([binary, "serve", model, *args, "--host", "127.0.0.1", "--port", "0"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.port = None
        self.kv_tokens = None
        ready = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.log.append(line.rstrip())
                if m := re.search(r"KV cache [^,]+, \d+ bytes/token, (\d+) tokens", line):
                    self.kv_tokens = int(m.group(1))
                if m := re.search(r"listening on http://[^:]+:(\d+)", line):
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(300) or self.port is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "\n".join(self.log[-20:]))

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

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


async def read_head(reader) -> tuple[int, dict]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def read_body_chunks(reader, headers):
    """Yield the body's pieces as they arrive (chunked or Content-Length)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


async def request(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        payload = json.dumps(body).encode() if body is not None else b""
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        await writer.drain()
        status, headers = await read_head(reader)
        out = b"".join([c async for c in read_body_chunks(reader, headers)])
        return status, out
    finally:
        writer.close()


async def stream_chat(port: int, body: dict, disconnect: int, res: Result) -> None:
    """One streaming chat request. disconnect: 0 keep, 1 close (FIN) after the first chunk,
    2 abort (RST) after the first chunk."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        payload = json.dumps(body).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        await writer.drain()
        res.status, headers = await read_head(reader)
        buf = b""
        async for piece in read_body_chunks(reader, headers):
            if res.status != 200:
                buf += piece
                continue
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        res.done = True
                        continue
                    v = json.loads(data)
                    if "error" in v:
                        res.error = f"error event {v['error']}"
                        continue
                    for ch in v.get("choices", []):
                        res.chunks += 1
                        res.finish_reason = ch.get("finish_reason") or res.finish_reason
                if disconnect and res.chunks > 0:
                    if disconnect == 2:
                        writer.transport.abort()
                    return
        if res.status != 200:
            res.error = f"HTTP {res.status}: {buf[:200]!r}"
    finally:
        if not writer.transport.is_closing():
            writer.close()


def short_body(model: str, rng: random.Random, i: int, disconnect: bool) -> dict:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"({i}) " + rng.choice(QUESTIONS).format(words)}],
        "max_tokens": 64 if disconnect else rng.randint(8, 16),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "stream": True,
        **({"stream_options": {"include_usage": True}} if rng.random() < 0.5 else {}),
    }


async def run_load(port: int, model: str, n: int, concurrency: int, deadline: float, seed: int,
                   disconnect_every: int = 5) -> Totals:
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        d = 0 if i % disconnect_every else 1 + (i // disconnect_every) % 2
        plans.append((short_body(model, rng, i, d != 0), d))
    totals = Totals()
    next_i = iter(range(n))

    async def client():
        for i in next_i:
            body, d = plans[i]
            res = Result(disconnect=d != 0)
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(stream_chat(port, body, d, res), deadline)
            except asyncio.TimeoutError:
                res.timed_out = True
                res.error = f"no end within {deadline} s"
            except Exception as e:  # noqa: BLE001 - a transport error is a failed request
                res.error = f"{type(e).__name__}: {e}"
            res.seconds = time.monotonic() - t0
            totals.results.append(res)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return totals


async def fill_kv(server: Server, concurrency: int, deadline: float, words_per: int = 240) -> tuple[int, int]:
    """Write every KV block once: distinct prompts (max_tokens 1) whose prompt tokens add up to
    1.05x the cache. Returns (prompt tokens the server counted, failed requests)."""
    rng = random.Random(7)
    goal = 1.05 * (server.kv_tokens or 0)
    planned = sent = failed = 0  # planned: a word is at least one token
    next_i = itertools.count()

    async def client():
        nonlocal planned, sent, failed
        for i in next_i:
            if planned >= goal or failed > 10:
                return
            words = [rng.choice(WORDS) for _ in range(rng.randint(words_per // 2, words_per))]
            planned += len(words)
            text = f"Document {i}: " + " ".join(words)
            try:
                st, body = await asyncio.wait_for(
                    request(server.port, "POST", "/v1/completions",
                            {"model": server.model, "prompt": text, "max_tokens": 1, "temperature": 0}), deadline)
            except Exception:  # noqa: BLE001 - counted as a failed warm-up request
                failed += 1
                continue
            if st == 200:
                sent += json.loads(body)["usage"]["prompt_tokens"]
            else:
                failed += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return sent, failed


def parse_metrics(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


async def metrics(port: int) -> dict:
    st, body = await request(port, "GET", "/metrics")
    if st != 200:
        raise RuntimeError(f"/metrics answered {st}")
    return parse_metrics(body.decode())


async def settled(port: int, wait: float = 20.0) -> dict:
    """/metrics once nothing is running or waiting and all KV blocks are free (or after `wait`)."""
    end = time.monotonic() + wait
    while True:
        m = await metrics(port)
        idle = (m.get("ferrite_num_requests_running") == 0 and m.get("ferrite_num_requests_waiting") == 0
                and m.get("ferrite_kv_blocks_used") == 0)
        if idle or time.monotonic() > end:
            return m
        await asyncio.sleep(0.25)


class Checks:
    def __init__(self):
        self.passed = self.failed = 0

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)


async def main_async(args) -> int:
    c = Checks()
    t_start = time.monotonic()
    server = Server(args.bin, args.model, ["--threads", str(args.threads), "--max-num-seqs", str(args.concurrency),
                               "--kv-cache-memory", str(args.kv_cache_mib << 20)])
    print(f"ferrite serve {args.model} on port {server.port}, KV cache {server.kv_tokens} tokens, "
          f"RSS {server.rss_kib() / 1024:.0f} MiB at start", flush=True)
    code = None
    try:
        c.check("the load line names the KV capacity", args.no_fill or server.kv_tokens is not None,
                f"{server.kv_tokens} tokens (None: the fill cannot size itself)")
        t0 = time.monotonic()
        sent, failed = (0, 0) if args.no_fill else await fill_kv(server, args.fill_concurrency, args.deadline)
        print(f"KV fill: {sent} prompt tokens in {time.monotonic() - t0:.1f} s, RSS {server.rss_kib() / 1024:.0f} MiB",
              flush=True)
        warm = await run_load(server.port, args.model, args.concurrency * 2, args.concurrency, args.deadline, seed=1)
        await settled(server.port)
        rss0 = server.rss_kib()
        warm_bad = failed + warm.count(lambda r: r.error is not None and not r.disconnect)
        print(f"warm-up {time.monotonic() - t0:.1f} s: RSS {rss0 / 1024:.0f} MiB", flush=True)
        c.check("warm-up requests succeed", warm_bad == 0, f"{warm_bad} failed")
        m_before = await metrics(server.port)

        t0 = time.monotonic()
        tot = await run_load(server.port, args.model, args.requests, args.concurrency, args.deadline, seed=args.seed)
        wall = time.monotonic() - t0
        m = await settled(server.port)
        rss1 = server.rss_kib()
        r = tot.results
        kept = [x for x in r if not x.disconnect]
        dropped = [x for x in r if x.disconnect]
        lat = sorted(x.seconds for x in kept)
        p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0  # noqa: E731
        print(f"run: {len(r)} requests ({len(dropped)} disconnecting) at concurrency {args.concurrency} in "
              f"{wall:.1f} s ({len(r) / wall:.1f} req/s); kept-stream latency p50 {p(0.5):.2f} s "
              f"p99 {p(0.99):.2f} s max {lat[-1] if lat else 0:.2f} s", flush=True)

        c.check("all requests answered", len(r) == args.requests, f"{len(r)} of {args.requests}")
        n5xx = tot.count(lambda x: x.status >= 500)
        server_5xx = sum(v for k, v in m.items() if k.startswith("ferrite_http_requests_total{")
                         and re.search(r'status="5\d\d"', k))
        c.check("no 5xx", n5xx == 0 and server_5xx == 0, f"clients saw {n5xx}, server counted {server_5xx}")
        hung = tot.count(lambda x: x.timed_out)
        c.check(f"no request past the {args.deadline:.0f} s deadline", hung == 0, f"{hung} hung")
        bad = [x for x in kept if x.error or x.status != 200 or not x.done or x.finish_reason is None]
        c.check("every kept stream completes (200, finish_reason, [DONE])", not bad,
                f"{len(bad)} bad, e.g. {bad[0] if bad else ''}")
        drop_err = [x for x in dropped if x.status != 200 or (x.error and not x.chunks)]
        c.check("disconnecting clients got a 200 stream first", not drop_err,
                f"{len(drop_err)} bad, e.g. {drop_err[0] if drop_err else ''}")
        # Kept requests generate at most 16 tokens; a disconnected one would run to 64 if not aborted.
        gen = m.get("ferrite_generation_tokens_total", 0) - m_before.get("ferrite_generation_tokens_total", 0)
        ceiling = 16 * len(kept) + 64 * len(dropped)
        saved = ceiling - gen
        c.check("disconnects abort their requests", saved > 32 * len(dropped),
                f"generated {gen:.0f} tokens; without aborts up to {ceiling}")
        running, waiting = m.get("ferrite_num_requests_running"), m.get("ferrite_num_requests_waiting")
        used, free = m.get("ferrite_kv_blocks_used"), m.get("ferrite_kv_blocks_free")
        c.check("/metrics: 0 running, 0 waiting", running == 0 and waiting == 0, f"running {running}, waiting {waiting}")
        c.check("/metrics: all KV blocks free", used == 0 and free and free > 0, f"used {used}, free {free}")
        growth = (rss1 - rss0) / rss0
        c.check("RSS within 10 % of post-warm-up", abs(growth) <= 0.10,
                f"{rss0 / 1024:.0f} MiB -> {rss1 / 1024:.0f} MiB ({growth * 100:+.1f} %)")
        st, body = await request(server.port, "POST", "/v1/chat/completions",
                                 {"model": args.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        c.check("the server still answers", st == 200 and b"chat.completion" in body, f"HTTP {st}")
    finally:
        code = server.stop()
    c.check("server exits 0 on SIGTERM", code == 0, f"exit status {code}")
    print(f"total {time.monotonic() - t_start:.1f} s", flush=True)
    print(f"{c.passed} passed, {c.failed} failed", flush=True)
    return 1 if c.failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.environ.get("FERRITE_BIN", str(ROOT / "target" / "release" / "ferrite")))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--deadline", type=float, default=60.0, help="seconds any one request may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-mib", type=int, default=384, help="the server's KV cache size")
    ap.add_argument("--fill-concurrency", type=int, default=8, help="requests at once while filling the KV cache")
    ap.add_argument("--no-fill", action="store_true", help="skip writing the whole KV cache during warm-up")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
