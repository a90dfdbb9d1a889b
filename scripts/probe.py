#!/usr/bin/env python3
"""Re-runs the server probe classes of issue 26 against `ferrite serve smollm2` (not in CI):
each class sends its hostile requests or connections and counts the tries and the failures (a
5xx, a hang, a leak, a body with a backtrace, a request accepted that should not be). Standard
library only; loopback only; bounded in count and time.

    python3 scripts/probe.py [--bin target/release/ferrite] [--only CLASS ...]

The server runs with --api-key (so every request carries `Authorization: Bearer KEY`),
--max-queue 16, the default listener bounds (header-read 10 s, keep-alive 5 s) and an open-file
limit of 1024 (what the issue's idle flood ran against). Prints one row per class — tries,
failures, the figures measured — then a Markdown table of the same for docs/HARDENING.md.
"""
import argparse
import http.client
import json
import resource
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import ROOT, Server  # noqa: E402

KEY = "probe-key"


class Probe:
    def __init__(self, server: Server):
        self.server = server
        self.rows: list[tuple[str, int, int, str]] = []

    def call(self, method: str, path: str, body=None, headers=None, timeout: float = 120.0):
        """(status, parsed JSON body or raw text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=timeout)
        h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        h.update(headers or {})
        payload = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        try:
            conn.request(method, path, body=payload, headers=h)
            resp = conn.getresponse()
            raw = resp.read()
            try:
                return resp.status, json.loads(raw)
            except ValueError:
                return resp.status, raw.decode("utf-8", "replace")
        finally:
            conn.close()

    def health_ms(self) -> float:
        t0 = time.monotonic()
        st, _ = self.call("GET", "/health", timeout=60)
        return (time.monotonic() - t0) * 1e3 if st == 200 else float("inf")

    def rss_mib(self, field: str = "VmRSS") -> float:
        for line in Path(f"/proc/{self.server.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        return 0.0

    def while_busy(self, work) -> tuple[list, float]:
        """Run `work` (a list of thunks) on threads; poll /health meanwhile; (results, worst ms)."""
        results = [None] * len(work)

        def run(i, f):
            results[i] = f()

        threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(work)]
        for t in threads:
            t.start()
        worst = 0.0
        while any(t.is_alive() for t in threads):
            worst = max(worst, self.health_ms())
            time.sleep(0.05)
        for t in threads:
            t.join()
        return results, worst

    def row(self, name: str, tries: int, failures: int, detail: str) -> None:
        self.rows.append((name, tries, failures, detail))
        print(f"{name}: {tries} tried, {failures} failed; {detail}", flush=True)


def short_error(body) -> bool:
    msg = body.get("error", {}).get("message", "") if isinstance(body, dict) else str(body)
    return len(msg) < 400 and not any(s in msg for s in ("panicked", "backtrace", "stack", ".rs:"))


def chat(content: str, max_tokens: int = 4, **extra) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def p_unknown_field_rss(p: Probe) -> None:
    junk = "[" + ",".join(["[0,0,0,0,0,0,0]"] * (31_500_000 // 16)) + "]"
    body = json.dumps(chat("Say hi", 1))[:-1].encode() + b', "junk": ' + junk.encode() + b"}"
    before, peak0 = p.rss_mib(), p.rss_mib("VmHWM")
    results, worst = p.while_busy([lambda: p.call("POST", "/v1/chat/completions", body) for _ in range(4)])
    peak = p.rss_mib("VmHWM")
    fails = sum(1 for st, _ in results if st != 200) + (peak - peak0 > 512)
    p.row("5 unknown 31.5 MB field, 4 at once", 4, fails,
          f"{len(body) / 1e6:.1f} MB bodies; RSS {before:.0f} -> {p.rss_mib():.0f} MiB, peak +{peak - peak0:.0f} MiB; "
          f"/health worst {worst:.0f} ms")


def p_big_prompts(p: Probe) -> None:
    huge = "hello world, " * 2 ** 21
    work = [lambda: p.call("POST", "/tokenize", {"prompt": huge}),
            lambda: p.call("POST", "/v1/chat/completions", chat(huge))] * 2
    results, worst = p.while_busy(work)
    fails = sum(1 for st, _ in results if st != 400) + (worst > 2000)
    p.row("3 two 26 MB prompts (tokenize, chat) x2", len(work), fails, f"all 400; /health worst {worst:.0f} ms")
    choices = [f"choice {i}" for i in range(100_000)]
    results, worst = p.while_busy([lambda: p.call("POST", "/v1/chat/completions", chat("Pick", guided_choice=choices))])
    st, body = results[0]
    p.row("3/11 guided_choice of 100,000", 1, int(st != 400 or not short_error(body) or worst > 2000),
          f"HTTP {st}; /health worst {worst:.0f} ms")


def p_structured(p: Probe) -> None:
    cases = {
        "$ref loop": {"guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}},
        "(a{1000}){1000}": {"guided_regex": "(a{1000}){1000}"},
        "50,000-alternative Lark": {"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(50_000))},
        "100,000 choices": {"guided_choice": [f"c{i}" for i in range(100_000)]},
    }
    fails, seen = 0, []
    for name, fields in cases.items():
        for stream in (False, True):
            st, body = p.call("POST", "/v1/chat/completions", chat("Answer", 8, stream=stream, **fields))
            ok = st == 400 and short_error(body)
            fails += not ok
            seen.append(f"{name}{' (stream)' if stream else ''}: {st}")
    p.row("11 costly or broken constraints, whole and streamed", len(cases) * 2, fails, "; ".join(seen))


def p_slowloris(p: Probe, n: int = 300) -> None:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", p.server.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: a")
        socks.append(s)
    worst = p.health_ms()
    time.sleep(16)  # past the 10 s header-read timeout
    still_open = 0
    for s in socks:
        s.settimeout(0.5)
        try:
            while s.recv(4096):  # drain whatever it sent, up to its close
                pass
        except TimeoutError:
            still_open += 1
        except OSError:  # reset: closed
            pass
        s.close()
    p.row("4 slowloris (partial headers)", n, still_open + (worst > 2000),
          f"{n - still_open} of {n} closed after 16 s; /health {worst:.0f} ms while they were open")


def p_idle_flood(p: Probe, n: int = 1100) -> None:
    socks = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection(("127.0.0.1", p.server.port), timeout=5))
        except OSError:
            break
    t0 = time.monotonic()
    st, _ = p.call("GET", "/health", timeout=60)
    ms = (time.monotonic() - t0) * 1e3
    for s in socks:
        s.close()
    p.row("4 idle flood (1,100 connections, file limit 1,024)", 1, int(st != 200),
          f"{len(socks)} connected; /health HTTP {st} after {ms:.0f} ms")


def p_metadata(p: Probe) -> None:
    base = {"model": "smollm2", "input": "Hi", "max_output_tokens": 1}
    cases = [{"k": "v" * (16 << 20)}, {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}]
    before = p.rss_mib()
    fails = sum(p.call("POST", "/v1/responses", {**base, "metadata": m})[0] != 400 for m in cases)
    for _ in range(40):
        fails += p.call("POST", "/v1/responses", {**base, "metadata": {"k": "v" * (16 << 20)}})[0] != 400
    p.row("6 oversized Responses metadata", 44, fails, f"RSS {before:.0f} -> {p.rss_mib():.0f} MiB after 40 x 16 MiB")


def p_browser(p: Probe) -> None:
    body = json.dumps(chat("Hi", 1)).encode()
    evil = {"Host": "evil.example:8080", "Origin": "http://evil.example"}
    tries = [
        ({"Content-Type": "text/plain"}, 415), ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415), ({**evil, "Content-Type": "text/plain"}, 421),
        ({"Host": "evil.example"}, 421), ({"Origin": "http://evil.example"}, 403), ({"Origin": "null"}, 403),
        ({"Origin": f"http://127.0.0.1:{p.server.port}", "Host": f"127.0.0.1:{p.server.port}"}, 200),
    ]
    got = [p.call("POST", "/v1/chat/completions", body, h)[0] for h, _ in tries]
    fails = sum(g != want for g, (_, want) in zip(got, tries))
    p.row("8 CSRF / DNS rebinding (text/plain, form, multipart, Host, Origin)", len(tries), fails,
          f"statuses {got} (the last is the server's own origin)")


def p_limits(p: Probe) -> None:
    big = 18446744073709551615
    cases = [
        ("POST", "/v1/chat/completions", chat("Hi", big), 400),
        ("POST", "/v1/chat/completions", {**chat("Hi", 4), "min_tokens": big}, 400),
        ("POST", "/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": big}, 400),
        ("POST", "/v1/chat/completions", {**chat("Hi", 1), "n": 64}, 400),
        ("POST", "/v1/completions", {"model": "smollm2", "prompt": ["a", "b", "c"], "n": 6, "max_tokens": 1}, 400),
        ("POST", "/v1/messages", {"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": []}]},
         400),
        ("POST", "/v1/responses", {"model": "smollm2", "input": [], "max_output_tokens": 4}, 400),
        ("POST", "/v1/chat/completions",
         {**chat("Call f", 8), "tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400),
    ]
    got = [p.call(m, path, b)[0] for m, path, b, _ in cases]
    fails = sum(g != want for g, (*_, want) in zip(got, cases))
    p.row("10/12 wrapping max_tokens/min_tokens, n past --max-queue, empty conversations, string parameters",
          len(cases), fails, f"statuses {got}")
    schemes = ["Bearer", "bearer", "BEARER"]
    got = [p.call("GET", "/v1/models", headers={"Authorization": f"{s} {KEY}"})[0] for s in schemes]
    p.row("12 bearer scheme in any case", 3, sum(g != 200 for g in got), f"statuses {got}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "argument": {"type": "string"}}}}}]
    st, body = p.call("POST", "/v1/chat/completions", {**chat("Call f", 6), "tools": tools, "tool_choice": "required"})
    choice = body.get("choices", [{}])[0] if isinstance(body, dict) else {}
    cut_ok = st == 200 and choice.get("finish_reason") == "length" and not choice.get("message", {}).get("tool_calls")
    p.row("12 cut-off tool call (max_tokens 6)", 1, int(not cut_ok),
          f"finish_reason {choice.get('finish_reason')}, tool_calls {choice.get('message', {}).get('tool_calls')}")


CLASSES = {"rss": p_unknown_field_rss, "prompts": p_big_prompts, "structured": p_structured, "slowloris": p_slowloris,
           "idle": p_idle_flood, "metadata": p_metadata, "browser": p_browser, "limits": p_limits}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(ROOT / "target/release/ferrite"))
    ap.add_argument("--only", nargs="*", choices=sorted(CLASSES), help="run only these classes")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))  # the server inherits 1,024
    server = Server(args.bin, "smollm2", ["--threads", "2", "--api-key", KEY, "--max-queue", "16"])
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the probe itself needs more
    p = Probe(server)
    try:
        for name, probe in CLASSES.items():
            if not args.only or name in args.only:
                probe(p)
    finally:
        code = server.stop()
    crashed = code not in (0, None) or server.proc.returncode not in (0,)
    print("\n| probe class | tried | failed | measured |\n| --- | --- | --- | --- |")
    for name, tries, fails, detail in p.rows:
        print(f"| {name} | {tries} | {fails} | {detail} |")
    print(f"\nserver exit after SIGTERM: {code}")
    return 1 if crashed or any(f for _, _, f, _ in p.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
