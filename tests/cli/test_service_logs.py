"""The reference tracker and relay log in the node's format, uvicorn's own lines included.

One format for every line an operator reads (`common.logs`): text lines shaped
as the node's, or JSON lines under `MESHNET_LOG_FORMAT=json`, never uvicorn's
own `INFO:     Started server process` beside them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshnet_gguf.common.ports import free_local_port

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
# The node's text line: `2026-11-30 14:33:01 INFO  logger [tags] message`.
NODE_TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO |WARNING|ERROR|CRITICAL) +\S+ ")


def run_until(argv: list[str], log_format: str, ready: str, tmp_path: Path) -> list[str]:
    """Start a service, wait until its log says `ready`, stop it (SIGTERM), return its log lines."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_")}
    env["MESHNET_LOG_FORMAT"] = log_format
    err = tmp_path / f"{argv[0]}-{log_format}.log"
    with err.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "meshnet_gguf", "dev", *argv], env=env, stdout=subprocess.DEVNULL, stderr=sink)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while ready not in err.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert ready in err.read_text(), err.read_text()
        finally:
            proc.terminate()
            proc.wait(timeout=STOP_TIMEOUT_S)
    return [line for line in err.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_tracker_and_uvicorn_lines_share_the_nodes_format(tmp_path: Path, log_format: str) -> None:
    argv = ["tracker", "--port", str(free_local_port()), "--open", "--state-dir", str(tmp_path / "tracker")]
    lines = run_until(argv, log_format, "Application startup complete", tmp_path)
    if log_format == "json":
        entries = [json.loads(line) for line in lines]  # every line, uvicorn's too
        assert any(e["logger"].startswith("uvicorn") for e in entries)
        assert all("color_message" not in e for e in entries)
    else:
        assert all(NODE_TEXT_LINE.match(line) for line in lines), lines
        assert any(" uvicorn.error " in line for line in lines)


def test_relay_lines_share_the_nodes_format(tmp_path: Path) -> None:
    lines = run_until(["relay", "--port", str(free_local_port()), "--open"], "json", "relay listening", tmp_path)
    assert all(json.loads(line)["logger"] for line in lines)
