"""A real browser for page tests: Debian's headless Chromium, driven over the DevTools protocol.

`Browser` starts Chromium with a fresh profile and remote debugging on a port the
kernel picks, opens one page, and offers the few calls the tests need: go to a
URL, evaluate JavaScript, wait until an expression is true, take a screenshot.
Everything has a deadline; the browser is stopped by its own PID.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
# Chromium prints its DevTools address within a second or two; a cold start on 2 busy cores is slower.
START_TIMEOUT_S = 30.0
COMMAND_TIMEOUT_S = 30.0
POLL_S = 0.1
WINDOW = (1280, 900)
# Flags for a quiet, offline, root-run headless browser: nothing reaches out on its own.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
)
_DEVTOOLS_LINE = re.compile(r"DevTools listening on (ws://[^\s]+)")


def chromium_path() -> str | None:
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def require_chromium() -> str:
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium here (apt-get install chromium; .ci/run installs it)")
    return path


class Browser:
    def __init__(self, binary: str) -> None:
        self._profile = tempfile.mkdtemp(prefix="meshnet-chromium-")
        self._stderr_path = Path(self._profile) / "stderr.log"
        self._stderr = self._stderr_path.open("wb")
        self.proc = subprocess.Popen(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={self._profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            start_new_session=True,
        )
        self._next_id = 0
        self._connections = contextlib.ExitStack()
        try:
            debugger = self._debugger_port()
            page = next(t for t in httpx.get(f"http://127.0.0.1:{debugger}/json/list").json() if t["type"] == "page")
            self._ws = self._connections.enter_context(
                connect(page["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024, open_timeout=COMMAND_TIMEOUT_S)
            )
            self.command("Page.enable")
            self.command("Runtime.enable")
        except BaseException:
            self.close()
            raise

    def _debugger_port(self) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = _DEVTOOLS_LINE.search(self._stderr_path.read_text(errors="replace"))
            if found:
                return int(found.group(1).split(":")[2].split("/")[0])
            if self.proc.poll() is not None:
                break
            time.sleep(POLL_S)
        raise AssertionError(f"Chromium did not start:\n{self._stderr_path.read_text(errors='replace')[-2000:]}")

    def command(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        ident = self._next_id
        self._ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while time.monotonic() < deadline:
            message = json.loads(self._ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if message.get("id") == ident:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                return message.get("result", {})
        raise TimeoutError(method)

    def goto(self, url: str) -> None:
        self.command("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.command("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Poll until `expression` is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = self.evaluate(expression)
            except AssertionError:
                last = None  # the page is still loading
            if last:
                return last
            time.sleep(POLL_S)
        text = self.evaluate("document.body ? document.body.innerText : ''")
        raise AssertionError(f"timed out waiting for {expression!r} (last {last!r}); page text:\n{text[:2000]}")

    def text_of(self, element_id: str, kind: str = "textContent") -> str:
        """The text of the element with this id: its `textContent`, or its rendered `innerText`."""
        return str(self.evaluate(f"document.getElementById({json.dumps(element_id)}).{kind}"))

    def screenshot(self, path: Path) -> None:
        data = self.command("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        self._connections.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Chromium's helper processes live in its session; end them by that session's id, never by name.
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self._stderr.close()
        shutil.rmtree(self._profile, ignore_errors=True)


@contextlib.contextmanager
def opened_browser() -> Iterator[Browser]:
    """A Browser on this machine's Chromium (the test is skipped without one), closed afterwards."""
    browser = Browser(require_chromium())
    try:
        yield browser
    finally:
        browser.close()


def screenshot_target(name: str) -> Path | None:
    """Where a test keeps its page's screenshot: docs/screenshots when MESHNET_SCREENSHOTS=1, else nowhere."""
    if os.environ.get("MESHNET_SCREENSHOTS") != "1":
        return None
    return Path(__file__).resolve().parents[2] / "docs" / "screenshots" / name
