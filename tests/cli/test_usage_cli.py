"""`meshnet-gguf usage` on a standalone node: a real `serve` (in front of the fake llama-server) keeps
its usage in its state dir, and the command reads it after the node is gone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from support.node_process import StartNode

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def usage_cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnet_gguf", "usage", "--state-dir", str(state_dir), *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_standalone_node_keeps_its_usage_and_usage_reads_it_after_the_node_stopped(
    start_node: StartNode, fake_llama_path: Path, tiny_gguf: Path
) -> None:
    node = start_node("--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path))
    node.wait_ready()
    streamed = httpx.post(node.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30)
    whole = httpx.post(node.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert streamed.status_code == whole.status_code == 200
    ids = {streamed.headers["x-meshnet-request-id"], whole.headers["x-meshnet-request-id"]}

    running = usage_cli(node.state_dir, "--json")  # while it runs: the lines are in the file already
    assert running.returncode == 0, running.stderr
    assert {e["request_id"] for e in json.loads(running.stdout)["entries"]} == ids

    node.signal(signal.SIGTERM)
    assert node.wait_exit() == 0
    done = usage_cli(node.state_dir, "--json")
    document = json.loads(done.stdout)
    assert {e["request_id"] for e in document["entries"]} == ids
    assert {e["outbox"] for e in document["entries"]} == {"standalone"}
    assert document["totals"]["requests"] == 2 and document["totals"]["completion_tokens"] == 8
    text = usage_cli(node.state_dir).stdout
    assert "2 requests" in text and "standalone requests: 2" in text and "receipts:" not in text


def test_usage_with_nothing_served_says_so(tmp_path: Path) -> None:
    done = usage_cli(tmp_path)
    assert done.returncode == 0 and "no usage recorded" in done.stdout
    bad = usage_cli(tmp_path, "--limit", "-1")
    assert bad.returncode == 2 and "--limit" in bad.stderr
