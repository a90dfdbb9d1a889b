#!/usr/bin/env python3
"""The web chat at `/` in a real headless browser (Debian's chromium + chromedriver, driven by
selenium).

Starts `ferrite serve smollm2 --model qwen=qwen2.5-coder-0.5b` (a pool of two) on a free port of
127.0.0.1 and drives the page: settings (temperature 0, a token limit) persist across a reload
and reach the request; a message gets a streamed reply; the conversation survives a reload;
Regenerate answers again (greedy: the same text) in place; editing a user message drops what
followed and answers the new text; the model picker switches to the second model (the reply
comes from it); a server error shows its status and message; a scripted reply with `<script>`
and `<img onerror>` stays text, its Python block is highlighted with a working Copy button,
its reasoning is collapsed and its tool call is shown; the sidebar switches, renames and
deletes conversations; Stop aborts a long generation in the engine too; the page logs no
script or CSP errors. Screenshots go to $FERRITE_ARTIFACTS (default target/web-chat/). Prints
one PASS/FAIL line per check; exits non-zero on any failure.

    python3 scripts/web_chat_test.py [--bin target/release/ferrite] [--model smollm2]
                                     [--second qwen2.5-coder-0.5b]

Installs what it needs: chromium and chromium-driver with apt-get when they are missing (as
root), and the pinned selenium and pillow into a venv under $FERRITE_HOME/venv-web.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

SELENIUM_VERSION = "4.51.0"
PILLOW_VERSION = "13.0.0"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ROOT = Path(__file__).resolve().parent.parent
SECOND = "qwen"

# A reply as the server would stream it, with markup that must stay text, a code block, a
# reasoning part and a tool call.
SCRIPTED_CONTENT = (
    "Here is <script>window.__xss = 1</script> and <img src=x onerror=\"window.__xss = 2\">.\n\n"
    "```python\ndef add(a, b):\n    # the sum\n    return a + b\n```\n\n"
    "[click](javascript:window.__xss=3) and **bold** text."
)
SCRIPTED_CHUNKS = [
    {"model": "scripted", "choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "Think <b>x</b>."}}]},
    *[{"model": "scripted", "choices": [{"index": 0, "delta": {"content": SCRIPTED_CONTENT[i:i + 17]}}]}
      for i in range(0, len(SCRIPTED_CONTENT), 17)],
    {"model": "scripted", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":"}}]}}]},
    {"model": "scripted", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": " \"Paris\"}"}}]}, "finish_reason": "tool_calls"}]},
]
# Replaces the page's next /v1/chat/completions call with `chunks` as an SSE body.
STUB_FETCH = """
const chunks = arguments[0];
const real = window.fetch;
window.fetch = (url, opts) => {
  if (!String(url).endsWith('/v1/chat/completions')) return real(url, opts);
  window.fetch = real;
  const text = chunks.map((c) => 'data: ' + JSON.stringify(c) + '\\n\\n').join('') + 'data: [DONE]\\n\\n';
  return Promise.resolve(new Response(text, {status: 200, headers: {'Content-Type': 'text/event-stream'}}));
};
"""
# Markdown and what the page's renderer makes of it (as HTML, for comparison only).
MARKDOWN_CASES = [
    ("# Title\nSome **bold**, *it*, `a <b>` and ~~old~~ in a_b_c.\nnext <i>line</i>",
     "<h1>Title</h1><p>Some <strong>bold</strong>, <em>it</em>, <code>a &lt;b&gt;</code> and <del>old</del> in "
     "a_b_c.<br>next &lt;i&gt;line&lt;/i&gt;</p>"),
    ("1. one\n2. two\n   - sub *a*\n3. three\n\n- x\n\n- y",
     "<ol class=\"tight\"><li><p>one</p></li><li><p>two</p><ul class=\"tight\"><li><p>sub <em>a</em></p></li></ul>"
     "</li><li><p>three</p></li></ol><ul><li><p>x</p></li><li><p>y</p></li></ul>"),
    ("| a | b |\n|:--|--:|\n| 1 | `x|y` |",
     "<div class=\"table-wrap\"><table><thead><tr><th style=\"text-align: left;\">a</th><th style=\"text-align: "
     "right;\">b</th></tr></thead><tbody><tr><td style=\"text-align: left;\">1</td><td style=\"text-align: right;\">"
     "<code>x|y</code></td></tr></tbody></table></div>"),
    ("> quote **x**\n> more\n\n---", "<blockquote><p>quote <strong>x</strong><br>more</p></blockquote><hr>"),
    ("[ok](https://example.com) [bad](javascript:alert(1)) ![i](https://e.org/p.png) https://x.org/a.",
     "<p><a href=\"https://example.com\" target=\"_blank\" rel=\"noopener noreferrer\">ok</a> <span>bad</span> "
     "<a class=\"image-link\" href=\"https://e.org/p.png\" target=\"_blank\" rel=\"noopener noreferrer\">image: i</a> "
     "<a href=\"https://x.org/a\" target=\"_blank\" rel=\"noopener noreferrer\">https://x.org/a</a>.</p>"),
    ("\\*not em\\* <img src=x onerror=alert(1)>\n```rust\nlet s = \"<b>\"; // c\n",
     "<p>*not em* &lt;img src=x onerror=alert(1)&gt;</p><div class=\"code-block\"><div class=\"code-head\"><span "
     "class=\"lang\">rust</span><button class=\"copy\" type=\"button\">Copy</button></div><pre><code><span "
     "class=\"hl-kw\">let</span> s = <span class=\"hl-str\">\"&lt;b&gt;\"</span>; <span class=\"hl-com\">// c</span>"
     "</code></pre></div>"),
]
RENDER_MARKDOWN = """
const [cases, done] = arguments;
import('/web/markdown.js').then((m) => done(cases.map(([src]) => {
  const box = document.createElement('div');
  box.append(m.renderMarkdown(src));
  return box.innerHTML;
})), (e) => done('error: ' + e));
"""
# Records the body of every chat request the page sends (until the next reload).
RECORD_REQUESTS = """
window.__requests = [];
const real = window.fetch;
window.fetch = (url, opts) => {
  if (String(url).endsWith('/v1/chat/completions')) window.__requests.push(JSON.parse(opts.body));
  return real(url, opts);
};
"""


def ferrite_home() -> Path:
    return Path(os.environ.get("FERRITE_HOME") or Path.home() / ".cache" / "ferrite")


def ensure_browser() -> None:
    if Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists():
        return
    if os.geteuid() != 0:
        sys.exit(f"{CHROMIUM} and {CHROMEDRIVER} are needed: apt-get install chromium chromium-driver")
    print("installing chromium and chromium-driver", file=sys.stderr, flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"], check=True, env=env,
                   stdout=subprocess.DEVNULL)


def ensure_venv() -> None:
    """Re-run this script under the venv holding the pinned packages, creating it if needed."""
    venv = ferrite_home() / "venv-web"
    py = venv / "bin" / "python"
    pins = [f"selenium=={SELENIUM_VERSION}", f"pillow=={PILLOW_VERSION}"]
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

    def __init__(self, binary: str, args: list[str]):
        self.proc = subprocess.Popen([binary, "serve", *args, "--host", "127.0.0.1", "--port", "0"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.url = None
        found = threading.Event()

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

    def get(self, path: str) -> str:
        return urllib.request.urlopen(self.url + path, timeout=10).read().decode()

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def model_status(self, name: str) -> str:
        return next(m["status"] for m in json.loads(self.get("/v1/models"))["data"] if m["id"] == name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def until(what: str, check, timeout: float = 60.0, every: float = 0.05):
    """Poll `check` until it returns something truthy; that value, or an AssertionError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def run(server: Server, model: str, profile: Path, artifacts: Path) -> list[tuple[str, str | None]]:
    from PIL import Image
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1200,850"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd("Browser.grantPermissions", {
        "origin": server.url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    results: list[tuple[str, str | None]] = []
    browser_log: list[dict] = []

    def check(name: str, body) -> None:
        try:
            body()
            results.append((name, None))
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the next check runs
            results.append((name, f"{type(e).__name__}: {e}"))

    def find(css: str, root=None):
        return (root or driver).find_element(By.CSS_SELECTOR, css)

    def find_all(css: str, root=None):
        return (root or driver).find_elements(By.CSS_SELECTOR, css)

    def replies():
        return find_all(".msg.assistant")

    def send(text: str) -> None:
        box = driver.find_element(By.ID, "input")
        box.send_keys(text)
        box.send_keys(Keys.ENTER)

    def content(reply) -> str:
        return find(".content", reply).text

    def finished(reply, timeout: float = 90.0) -> None:
        until("the reply to finish", lambda: reply.get_attribute("data-state") in ("done", "error"), timeout)
        assert reply.get_attribute("data-state") == "done", find(".error-box", reply).text

    def reload() -> None:
        browser_log.extend(driver.get_log("browser"))
        driver.refresh()
        until("the model list", lambda: " · " in driver.find_element(By.ID, "model").text, 30)

    def settings(temperature: str, max_tokens: str, system: str | None = None) -> None:
        driver.find_element(By.ID, "open-settings").click()
        for field, value in [("set-temperature", temperature), ("set-max-tokens", max_tokens), ("set-system", system)]:
            if value is not None:
                box = driver.find_element(By.ID, field)
                box.clear()
                box.send_keys(value)
        driver.find_element(By.ID, "settings-save").click()
        until("the dialog to close", lambda: not driver.find_element(By.ID, "settings").is_displayed(), 5)

    def stored() -> list[dict]:
        return driver.execute_script("return JSON.parse(localStorage.getItem('ferrite.chats') || '[]')")

    def chats():
        return find_all("#chats li.chat")

    def screenshot(name: str) -> None:
        path = artifacts / f"{name}.png"
        driver.save_screenshot(str(path))
        image = Image.open(path).convert("RGB")
        colors = image.getcolors(maxcolors=1 << 20) or []
        assert image.width > 500 and image.height > 400, image.size
        assert len(colors) > 20, f"{path}: {len(colors)} colors, the screenshot looks blank"

    def tokens(reply) -> int:
        m = re.search(r"(\d+) tokens", find(".note", reply).text)
        assert m, f"the note shows the token count: {find('.note', reply).text!r}"
        return int(m.group(1))

    try:
        driver.get(server.url + "/")

        def page_loads():
            assert driver.title == "ferrite chat", driver.title
            until("the model name", lambda: model in driver.find_element(By.ID, "model").text, 30)
            picker = Select(driver.find_element(By.ID, "model-picker"))
            assert driver.find_element(By.ID, "model-picker").is_displayed(), "two models: the picker shows"
            assert [o.get_attribute("value") for o in picker.options] == [model, SECOND]
            assert picker.first_selected_option.get_attribute("value") == model

        check("the page loads, names the model and offers both", page_loads)

        def markdown():
            got = driver.execute_async_script(RENDER_MARKDOWN, MARKDOWN_CASES)
            for (src, want), html in zip(MARKDOWN_CASES, got):
                assert html == want, f"{src!r}:\n got {html}\nwant {want}"

        check("Markdown renders blocks, inline marks, safe links and highlighted code", markdown)

        def settings_persist():
            settings("0", "24", "You are a concise assistant.")
            reload()
            driver.find_element(By.ID, "open-settings").click()
            values = [driver.find_element(By.ID, f).get_attribute("value")
                      for f in ("set-temperature", "set-max-tokens", "set-system")]
            driver.find_element(By.ID, "settings-cancel").click()
            assert values == ["0", "24", "You are a concise assistant."], values

        check("settings persist across a reload", settings_persist)

        first_reply = {}

        def streamed_reply():
            driver.execute_script(RECORD_REQUESTS)
            send("Say hello in one short sentence.")
            reply = until("an assistant reply", lambda: replies() and replies()[0])
            finished(reply)
            assert content(reply).strip(), "the reply has text"
            assert re.match(r"(stop|length) · ", find(".note", reply).text), find(".note", reply).text
            assert tokens(reply) <= 24, "max tokens reached the server"
            assert find(".msg.user .content").text == "Say hello in one short sentence."
            body = driver.execute_script("return window.__requests[0]")
            assert body["temperature"] == 0 and body["max_tokens"] == 24 and body["model"] == model, body
            assert body["messages"][0] == {"role": "system", "content": "You are a concise assistant."}, body
            first_reply["text"] = content(reply)

        check("a message gets a streamed reply, with the settings in the request", streamed_reply)

        def survives_reload():
            reload()
            assert [e.text for e in find_all(".msg.user .content")] == ["Say hello in one short sentence."]
            assert [content(r) for r in replies()] == [first_reply["text"]]
            assert replies()[0].get_attribute("data-state") == "done"
            assert [find(".title", c).text for c in chats()] == ["Say hello in one short sentence."]
            assert "active" in chats()[0].get_attribute("class")

        check("the conversation survives a reload", survives_reload)

        def regenerate():
            before = server.metric("ferrite_generation_tokens_total")
            find(".msg.assistant .regenerate").click()
            until("a new reply", lambda: replies() and replies()[0].get_attribute("data-state") == "streaming", 10)
            finished(replies()[0])
            assert len(replies()) == 1 and len(find_all(".msg.user")) == 1, "answered again in place"
            assert server.metric("ferrite_generation_tokens_total") > before, "the engine generated again"
            assert content(replies()[0]) == first_reply["text"], "greedy: the same prompt, the same answer"

        check("Regenerate answers again in place", regenerate)

        def edit():
            driver.execute_script(RECORD_REQUESTS)
            find(".msg.user .edit").click()
            box = find(".msg.user .edit-input")
            box.clear()
            box.send_keys("What is the capital of France?")
            find(".msg.user .save-edit").click()
            until("the edited reply", lambda: replies() and replies()[0].get_attribute("data-state") == "streaming", 10)
            finished(replies()[0])
            assert [e.text for e in find_all(".msg.user .content")] == ["What is the capital of France?"]
            assert len(replies()) == 1
            sent = driver.execute_script("return window.__requests[0].messages")
            assert [m["role"] for m in sent] == ["system", "user"], sent
            assert sent[1]["content"] == "What is the capital of France?", sent
            assert [m["content"] for m in stored()[0]["messages"]][0] == "What is the capital of France?"

        check("editing a user message drops what followed and answers it", edit)

        def model_switch():
            assert server.model_status(SECOND) == "unloaded"
            Select(driver.find_element(By.ID, "model-picker")).select_by_value(SECOND)
            until("the header to name it", lambda: driver.find_element(By.ID, "model").text.startswith(SECOND), 5)
            send("Name a colour.")
            reply = until("a second reply", lambda: len(replies()) == 2 and replies()[1])
            finished(reply, 180)
            assert reply.get_attribute("data-model") == SECOND, reply.get_attribute("data-model")
            assert SECOND in find(".note", reply).text
            assert server.model_status(SECOND) == "loaded", "the pool loaded it on demand"
            reload()
            picker = Select(driver.find_element(By.ID, "model-picker"))
            assert picker.first_selected_option.get_attribute("value") == SECOND, "the choice persists"
            picker.select_by_value(model)

        check("the model picker switches to the second model", model_switch)

        def server_error():
            settings("-1", "24")
            send("This request is refused.")
            reply = until("a third reply", lambda: len(replies()) == 3 and replies()[2])
            until("it to fail", lambda: reply.get_attribute("data-state") == "error", 30)
            error = find(".error-box", reply).text
            assert error.startswith("Error 400"), error
            assert "temperature" in error, f"the server's message is shown: {error!r}"
            settings("0", "24")
            reload()
            assert replies()[2].get_attribute("data-state") == "error", "the error is kept with the chat"

        check("a server error shows its status and message", server_error)

        def scripted_reply():
            driver.find_element(By.ID, "new-chat").click()
            until("an empty chat", lambda: not find_all(".msg"), 5)
            driver.execute_script(STUB_FETCH, SCRIPTED_CHUNKS)
            send("Show me some markup.")
            reply = until("the scripted reply", lambda: replies() and replies()[0])
            finished(reply, 10)
            body = find(".content", reply)
            assert "<script>window.__xss = 1</script>" in body.text, body.text
            assert "<img src=x onerror=" in body.text, body.text
            assert not find_all("script, img", body), "markup in a reply is never parsed"
            assert not find_all("a[href^='javascript']", reply), "no javascript: links"
            assert driver.execute_script("return window.__xss === undefined"), "nothing of the reply ran"
            assert find("strong", body).text == "bold"
            code = find(".code-block code", body)
            assert code.text == "def add(a, b):\n    # the sum\n    return a + b", code.text
            assert [k.text for k in find_all(".hl-kw", code)] == ["def", "return"]
            assert find(".hl-com", code).text == "# the sum"
            assert find(".hl-kw", code).value_of_css_property("color") != code.value_of_css_property("color")
            reasoning = find("details.reasoning", reply)
            assert reasoning.is_displayed() and reasoning.get_attribute("open") is None, "reasoning is collapsed"
            assert find("summary", reasoning).text == "Reasoning"
            assert driver.execute_script("return arguments[0].textContent", find(".text", reasoning)) == "Think <b>x</b>."
            call = find(".tool-call", reply)
            assert "get_weather" in find(".tool-name", call).text
            assert json.loads(find("pre", call).text) == {"city": "Paris"}
            assert "tool_calls" in find(".note", reply).text
            copy = find(".code-block .copy", body)
            copy.click()
            until("the copy to be confirmed", lambda: copy.text == "Copied", 5)
            copied = driver.execute_async_script(
                "navigator.clipboard.readText().then(arguments[0], (e) => arguments[0]('error: ' + e))")
            assert copied == code.text, copied
            screenshot("scripted_reply")

        check("a scripted reply: markup stays text, code highlighted and copyable, reasoning, tool call",
              scripted_reply)

        def stream_error():
            driver.execute_script(STUB_FETCH, [
                {"model": "scripted", "choices": [{"index": 0, "delta": {"content": "Partial answer"}}]},
                {"error": {"message": "the engine process of 'scripted' was killed by signal 9",
                           "type": "server_error"}},
            ])
            find(".msg.assistant .regenerate").click()
            reply = until("the failed reply", lambda: replies()[0].get_attribute("data-state") == "error" and replies()[0])
            assert content(reply) == "Partial answer", "the text so far stays"
            error = find(".error-box", reply).text
            assert error.startswith("Error server_error"), error
            assert "killed by signal 9" in error, error

        check("an error event mid-stream shows with the text so far", stream_error)

        def sidebar():
            assert len(chats()) == 2, [c.text for c in chats()]
            titles = [find(".title", c).text for c in chats()]
            assert titles == ["Show me some markup.", "What is the capital of France?"], titles
            find(".title", chats()[1]).click()
            until("the first chat", lambda: len(find_all(".msg.user")) == 3, 5)
            assert find_all(".msg.user .content")[0].text == "What is the capital of France?"
            find(".rename", chats()[1]).click()
            box = find(".rename-input", chats()[1])
            box.send_keys(Keys.CONTROL, "a")
            box.send_keys("Capitals", Keys.ENTER)
            until("the new title", lambda: [find(".title", c).text for c in chats()][1] == "Capitals", 5)
            delete = find(".delete", chats()[0])
            delete.click()
            assert len(chats()) == 2 and delete.text == "Delete?", "the first click asks"
            delete.click()
            until("one chat left", lambda: len(chats()) == 1, 5)
            reload()
            assert [find(".title", c).text for c in chats()] == ["Capitals"]
            assert len(stored()) == 1 and stored()[0]["title"] == "Capitals"
            assert len(find_all(".msg.user")) == 3, "the open chat stays open"
            screenshot("conversation")

        check("the sidebar switches, renames and deletes conversations", sidebar)

        def stop_a_long_generation():
            settings("", "")
            driver.find_element(By.ID, "new-chat").click()
            before = server.metric("ferrite_generation_tokens_total")
            send("Write a very long story about a dragon who learns to cook. Make it at least two thousand words.")
            reply = until("a reply", lambda: replies() and replies()[0])
            first = until("streamed text", lambda: len(content(reply)), 60)
            until("more streamed text", lambda: len(content(reply)) > first, 60)
            assert reply.get_attribute("data-state") == "streaming"
            assert driver.find_element(By.ID, "send").get_attribute("disabled") is not None
            driver.find_element(By.ID, "stop").click()
            until("the reply to stop", lambda: reply.get_attribute("data-state") == "stopped", 10)
            stopped_at = content(reply)
            assert stopped_at, "the text so far stays"
            assert find(".note", reply).text == "stopped"
            until("the engine to drop the request", lambda: server.metric("ferrite_num_requests_running") == 0, 10)
            generated = server.metric("ferrite_generation_tokens_total")
            time.sleep(1.0)
            assert content(reply) == stopped_at, "no text after Stop"
            assert server.metric("ferrite_generation_tokens_total") == generated, "nothing generates after Stop"
            assert generated - before < 2000, "stopped long before the story ended"
            assert driver.find_element(By.ID, "stop").get_attribute("disabled") is not None
            assert driver.find_element(By.ID, "send").get_attribute("disabled") is None

        check("Stop aborts a long generation", stop_a_long_generation)

        def settings_dialog_shot():
            driver.find_element(By.ID, "open-settings").click()
            screenshot("settings")
            driver.find_element(By.ID, "settings-cancel").click()

        check("screenshots are not blank", settings_dialog_shot)

        def clean_console():
            browser_log.extend(driver.get_log("browser"))
            bad = [e["message"] for e in browser_log
                   if e["level"] == "SEVERE" and "status of 400" not in e["message"]]
            assert not bad, bad

        check("no script or CSP errors in the console", clean_console)
    finally:
        driver.quit()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "ferrite"))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--second", default="qwen2.5-coder-0.5b", help=f"the pool's second model, served as '{SECOND}'")
    args = ap.parse_args()
    ensure_browser()
    ensure_venv()
    artifacts = Path(os.environ.get("FERRITE_ARTIFACTS") or ROOT / "target") / "web-chat"
    shutil.rmtree(artifacts, ignore_errors=True)
    artifacts.mkdir(parents=True)
    profile = Path(tempfile.mkdtemp(prefix="ferrite-web-chat-"))
    server = Server(args.bin, [args.model, "--model", f"{SECOND}={args.second}"])
    try:
        results = run(server, args.model, profile, artifacts)
    finally:
        server.stop()
        shutil.rmtree(profile, ignore_errors=True)
    for name, error in results:
        print(f"{'PASS' if error is None else 'FAIL'} {name}" + (f": {error}" if error else ""))
    failed = sum(1 for _, e in results if e is not None)
    print(f"{len(results) - failed} passed, {failed} failed (screenshots in {artifacts})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
