#!/usr/bin/env python3
"""Record the requests Claude Code and Codex send, for the fixtures under tests/fixtures/agents/.

Serves a scripted model on 127.0.0.1 (Anthropic `/v1/messages` and `/v1/messages/count_tokens`,
OpenAI `/v1/responses`) and appends every request it gets — method, path, the headers that
matter, JSON body — as one JSON line to the file named by --log. The scripted model answers a
turn whose last user message asks for `ferrite-ok` with a shell tool call (`echo ferrite-ok`),
a turn that carries that call's result with a short text, and anything else with "Hello.", so
one `claude -p` / `codex exec` run goes through a default turn, a tool-call turn and a
tool-result turn. scripts/e2e_agents.sh can point the clients here with --record.

    python3 scripts/record_agent_requests.py --port 8799 --log /tmp/agent-requests.jsonl
    python3 scripts/record_agent_requests.py --trim /tmp/agent-requests.jsonl --into DIR \
        --names default,tool_call,tool_result --replace /tmp/work=/home/user/project

`--trim` writes each recorded request as DIR/NAME.json with what is machine-specific made
neutral: ids (UUIDs, hex device ids) zeroed, the given paths replaced, the kernel version and
date fixed, the API key replaced.
"""
import argparse
import json
import re
import threading
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Headers worth keeping; the rest (host, content-length, user agents' build details) vary.
KEPT_HEADERS = {"content-type", "accept", "anthropic-version", "anthropic-beta", "x-api-key", "authorization",
                "openai-beta", "x-stainless-helper-method", "originator", "session_id"}
LOCK = threading.Lock()
SHELL_TOOLS = ("Bash", "shell", "shell_command", "exec_command")


def shell_args(tool: str, command: str) -> dict:
    """The arguments of a call of a client's shell `tool` running `command`."""
    return {
        "Bash": {"command": command, "description": "Run the requested command"},
        "shell": {"command": ["bash", "-lc", command]},
        "shell_command": {"command": command},
        "exec_command": {"cmd": command},
    }[tool]


def last_user_text(messages) -> str:
    """The text of the last user turn (Anthropic blocks, Responses items, or strings)."""
    for m in reversed(messages):
        if m.get("role") != "user":
            continue
        c = m.get("content")
        if isinstance(c, str):
            return c
        return "\n".join(p.get("text", "") for p in c or [] if isinstance(p, dict))
    return ""


def has_tool_result(body: dict) -> bool:
    if "messages" in body:
        last = body["messages"][-1]
        content = last.get("content")
        return isinstance(content, list) and any(b.get("type") == "tool_result" for b in content)
    items = body.get("input")
    return isinstance(items, list) and any(i.get("type") == "function_call_output" for i in items)


def tool_names(body: dict) -> list:
    names = []
    for t in body.get("tools") or []:
        names.append(t.get("name"))
        names.extend(s.get("name") for s in t.get("tools") or [])
    return names


def decide(body: dict):
    """('call', (tool name, arguments)) or ('text', the text)."""
    if has_tool_result(body):
        return "text", "The command printed ferrite-ok."
    messages = body.get("messages") or (body["input"] if isinstance(body.get("input"), list) else [])
    text = last_user_text(messages)
    if "ferrite-" in text:
        found = re.search(r"command: (.+)$", text.strip())
        command = found.group(1) if found else "echo ferrite-ok"
        for name in SHELL_TOOLS:
            if name in tool_names(body):
                return "call", (name, shell_args(name, command))
    return "text", "Hello."


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_json(404, {"error": {"message": "not here", "type": "invalid_request_error"}})

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {"unparsed": raw.decode("utf-8", "replace")}
        headers = {k.lower(): v for k, v in self.headers.items() if k.lower() in KEPT_HEADERS}
        with LOCK, open(self.server.log, "a") as f:
            f.write(json.dumps({"method": "POST", "path": self.path, "headers": headers, "body": body}) + "\n")
        path = self.path.split("?")[0]
        if path.endswith("/v1/messages/count_tokens"):
            return self.send_json(200, {"input_tokens": 10})
        if path.endswith("/v1/messages"):
            return self.anthropic(body)
        if path.endswith("/responses"):
            return self.openai_responses(body)
        self.send_json(404, {"error": {"message": f"no route {path}", "type": "invalid_request_error"}})

    def send_json(self, status, value):
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_events(self, events):
        data = "".join(f"event: {name}\ndata: {json.dumps(value)}\n\n" for name, value in events).encode()
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def anthropic(self, body):
        kind, what = decide(body)
        usage = {"input_tokens": 10, "output_tokens": 5, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 0}
        if kind == "call":
            block = {"type": "tool_use", "id": "toolu_rec1", "name": what[0], "input": what[1]}
            reason = "tool_use"
        else:
            block = {"type": "text", "text": what}
            reason = "end_turn"
        message = {"id": "msg_rec", "type": "message", "role": "assistant", "model": body.get("model"),
                   "content": [block], "stop_reason": reason, "stop_sequence": None, "usage": usage}
        if not body.get("stream"):
            return self.send_json(200, message)
        start = dict(message, content=[], stop_reason=None)
        opened = dict(block, input={}) if kind == "call" else dict(block, text="")
        delta = ({"type": "input_json_delta", "partial_json": json.dumps(block["input"])} if kind == "call"
                 else {"type": "text_delta", "text": what})
        self.send_events([
            ("message_start", {"type": "message_start", "message": start}),
            ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": opened}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None},
                               "usage": usage}),
            ("message_stop", {"type": "message_stop"}),
        ])

    def openai_responses(self, body):
        kind, what = decide(body)
        if kind == "call":
            item = {"type": "function_call", "id": "fc_rec1", "call_id": "call_rec1", "name": what[0],
                    "arguments": json.dumps(what[1]), "status": "completed"}
        else:
            item = {"type": "message", "id": "msg_rec1", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": what, "annotations": []}]}
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}
        response = {"id": "resp_rec", "object": "response", "status": "completed", "model": body.get("model"),
                    "output": [item], "usage": usage}
        if not body.get("stream"):
            return self.send_json(200, response)
        events = [("response.created", {"type": "response.created", "sequence_number": 0,
                                        "response": dict(response, status="in_progress", output=[], usage=None)})]
        if kind == "call":
            events += [
                ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                                "item": dict(item, arguments="", status="in_progress")}),
                ("response.function_call_arguments.delta", {"type": "response.function_call_arguments.delta",
                                                            "item_id": item["id"], "output_index": 0,
                                                            "delta": item["arguments"]}),
                ("response.function_call_arguments.done", {"type": "response.function_call_arguments.done",
                                                           "item_id": item["id"], "output_index": 0,
                                                           "arguments": item["arguments"]}),
            ]
        else:
            part = {"type": "output_text", "text": "", "annotations": []}
            events += [
                ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                                "item": dict(item, content=[], status="in_progress")}),
                ("response.content_part.added", {"type": "response.content_part.added", "item_id": item["id"],
                                                 "output_index": 0, "content_index": 0, "part": part}),
                ("response.output_text.delta", {"type": "response.output_text.delta", "item_id": item["id"],
                                                "output_index": 0, "content_index": 0, "delta": what}),
                ("response.output_text.done", {"type": "response.output_text.done", "item_id": item["id"],
                                               "output_index": 0, "content_index": 0, "text": what}),
                ("response.content_part.done", {"type": "response.content_part.done", "item_id": item["id"],
                                                "output_index": 0, "content_index": 0,
                                                "part": dict(part, text=what)}),
            ]
        events += [
            ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": item}),
            ("response.completed", {"type": "response.completed", "response": response}),
        ]
        for n, (_, e) in enumerate(events):
            e["sequence_number"] = n
        self.send_events(events)


def neutral(text: str, replace: list) -> str:
    """`text` (a request as JSON) with its machine-specific parts made neutral."""
    for pair in replace:
        old, new = pair.split("=", 1)
        text = text.replace(old, new)
    text = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "00000000-0000-0000-0000-000000000000",
                  text)
    text = re.sub(r"\b[0-9a-f]{64}\b", "0" * 64, text)
    text = re.sub(r"Linux \d+\.\d+\.\d+[-\w.]*", "Linux 6.1.0", text)
    text = re.sub(r"\b20\d\d-\d\d-\d\d\b", "2026-01-01", text)
    text = re.sub(r"\b1[78]\d{11}\b", "1767225600000", text)
    text = re.sub(r"\bcc_version=[\w.]+", "cc_version=0", text)
    return text.replace("sk-ferrite-local", "sk-test")


def trim(log: str, into: str, names: list, replace: list) -> None:
    lines = [line for line in open(log) if line.strip()]
    if len(lines) != len(names):
        raise SystemExit(f"{log} has {len(lines)} requests, --names gives {len(names)}")
    Path(into).mkdir(parents=True, exist_ok=True)
    for name, line in zip(names, lines):
        request = json.loads(neutral(line, replace))
        (Path(into) / f"{name}.json").write_text(json.dumps(request, indent=1, ensure_ascii=False) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8799)
    ap.add_argument("--log")
    ap.add_argument("--trim", help="a recorded log to write out as fixtures")
    ap.add_argument("--into")
    ap.add_argument("--names", default="default,tool_call,tool_result")
    ap.add_argument("--replace", action="append", default=[], help="OLD=NEW, applied to every request")
    args = ap.parse_args()
    if args.trim:
        return trim(args.trim, args.into, args.names.split(","), args.replace)
    if not args.log:
        ap.error("--log is required to record")
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.log = args.log
    print(f"listening on http://127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
