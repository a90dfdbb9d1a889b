#!/usr/bin/env python3
"""The web chat at `/` in a real headless browser (Debian's chromium + chromedriver, driven by
selenium).

Starts `ferrite serve smollm2` on a free port of 127.0.0.1, opens the page, sends a message and
waits for the streamed reply, starts a long generation and stops it with the Stop button (the
request must end in the engine too), starts a new chat, and checks a screenshot is not blank.
The screenshot is kept in the test's temp dir (printed at the end). Prints one PASS/FAIL line
per check; exits non-zero on any failure.

    python3 scripts/web_chat_test.py [--bin target/release/ferrite] [--model smollm2]

Installs what it needs: chromium and chromium-driver with apt-get when they are missing (as
root), and the pinned selenium and pillow into a venv under $FERRITE_HOME/venv-web.
"""
import argparse
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

    def __init__(self, binary: str, model: str):
        self.proc = subprocess.Popen([binary, "serve", model, "--host", "127.0.0.1", "--port", "0"],
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

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

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


def run(server: Server, workdir: Path) -> list[tuple[str, str | None]]:
    from PIL import Image
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={workdir / 'profile'}", "--window-size=1100,800"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    results: list[tuple[str, str | None]] = []

    def check(name: str, body) -> None:
        try:
            body()
            results.append((name, None))
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the next check runs
            results.append((name, f"{type(e).__name__}: {e}"))

    def replies():
        return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")

    def send(text: str) -> None:
        box = driver.find_element(By.ID, "input")
        box.send_keys(text)
        box.send_keys(Keys.ENTER)

    def content(reply) -> str:
        return reply.find_element(By.CSS_SELECTOR, ".content").text

    try:
        driver.get(server.url + "/")

        def page_loads():
            assert driver.title == "ferrite chat", driver.title
            until("the model name", lambda: "smollm2" in driver.find_element(By.ID, "model").text, 30)

        check("the page loads and names the model", page_loads)

        def streamed_reply():
            send("Say hello in one short sentence.")
            reply = until("an assistant reply", lambda: replies() and replies()[0])
            until("the reply to finish", lambda: reply.get_attribute("data-state") == "done", 120)
            assert content(reply).strip(), "the reply has text"
            assert "stop" in reply.find_element(By.CSS_SELECTOR, ".note").text, "the note shows how it ended"
            assert driver.find_element(By.CSS_SELECTOR, ".msg.user").text.startswith("Say hello")

        check("a message gets a streamed reply", streamed_reply)

        def stop_a_long_generation():
            before = server.metric("ferrite_generation_tokens_total")
            send("Write a very long story about a dragon who learns to cook. Make it at least two thousand words.")
            reply = until("a second reply", lambda: len(replies()) >= 2 and replies()[1])
            first = until("streamed text", lambda: len(content(reply)), 60)
            until("more streamed text", lambda: len(content(reply)) > first, 60)
            assert reply.get_attribute("data-state") == "streaming"
            assert driver.find_element(By.ID, "send").get_attribute("disabled") is not None
            driver.find_element(By.ID, "stop").click()
            until("the reply to stop", lambda: reply.get_attribute("data-state") == "stopped", 10)
            stopped_at = content(reply)
            assert stopped_at, "the text so far stays"
            assert reply.find_element(By.CSS_SELECTOR, ".note").text == "stopped"
            until("the engine to drop the request", lambda: server.metric("ferrite_num_requests_running") == 0, 10)
            generated = server.metric("ferrite_generation_tokens_total")
            time.sleep(1.0)
            assert content(reply) == stopped_at, "no text after Stop"
            assert server.metric("ferrite_generation_tokens_total") == generated, "nothing generates after Stop"
            assert generated - before < 2000, "stopped long before the story ended"
            assert driver.find_element(By.ID, "stop").get_attribute("disabled") is not None
            assert driver.find_element(By.ID, "send").get_attribute("disabled") is None

        check("Stop aborts a long generation", stop_a_long_generation)

        def screenshot():
            path = workdir / "web_chat.png"
            driver.save_screenshot(str(path))
            image = Image.open(path).convert("RGB")
            colors = image.getcolors(maxcolors=1 << 20) or []
            assert image.width > 500 and image.height > 400, image.size
            assert len(colors) > 20, f"{len(colors)} colors: the screenshot looks blank"
            print(f"screenshot: {path}", flush=True)

        check("a screenshot of the conversation is not blank", screenshot)

        def new_chat():
            driver.find_element(By.ID, "new-chat").click()
            until("the conversation to clear", lambda: not driver.find_elements(By.CSS_SELECTOR, ".msg"), 5)
            send("Hi")
            reply = until("a reply in the new chat", lambda: replies() and replies()[0])
            try:
                until("it to finish", lambda: reply.get_attribute("data-state") == "done", 60)
            except AssertionError:
                # The reply is sampled and has no length limit: now and then it runs on toward
                # the context's end. Stopping it shows the new chat as well.
                driver.find_element(By.ID, "stop").click()
                until("it to stop", lambda: reply.get_attribute("data-state") in ("stopped", "done"), 10)
            assert len(driver.find_elements(By.CSS_SELECTOR, ".msg.user")) == 1
            assert len(replies()) == 1

        check("New chat starts over", new_chat)
    finally:
        driver.quit()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "ferrite"))
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    ensure_browser()
    ensure_venv()
    workdir = Path(tempfile.mkdtemp(prefix="ferrite-web-chat-"))
    server = Server(args.bin, args.model)
    try:
        results = run(server, workdir)
    finally:
        server.stop()
    for name, error in results:
        print(f"{'PASS' if error is None else 'FAIL'} {name}" + (f": {error}" if error else ""))
    failed = sum(1 for _, e in results if e is not None)
    print(f"{len(results) - failed} passed, {failed} failed (artifacts in {workdir})")
    shutil.rmtree(workdir / "profile", ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
