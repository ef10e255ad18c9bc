"""`meshnet-gguf dev mesh`: one command starts tracker, relay and a node reachable only through the
relay; the snippet it prints works as printed; Ctrl-C stops everything, exit 0, nothing left running."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

pytestmark = [pytest.mark.real_llama, pytest.mark.slow]
READY_S = 90.0


def test_dev_mesh_serves_the_printed_snippet_and_stops_cleanly_on_ctrl_c(real_llama, tiny_gguf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out_path = tmp_path / "mesh.out"
    argv = [sys.executable, "-m", "meshnet_gguf", "dev", "mesh", "--gguf", str(tiny_gguf),
            "--tracker-port", "0", "--relay-port", "0", "--state-dir", str(tmp_path / "mesh")]  # fmt: skip
    mesh = subprocess.Popen(argv, stdout=out_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + READY_S
        while "Ctrl-C stops" not in out_path.read_text():
            assert mesh.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.1)
        out = out_path.read_text()
        snippet = out[out.index("from openai import OpenAI") : out.index("Ctrl-C stops")].strip()
        base_url = re.search(r'base_url="([^"]+)"', snippet).group(1)  # type: ignore[union-attr]
        [node] = httpx.get(base_url.removesuffix("/v1") + "/v1/nodes").json()
        assert node["announcement"]["relay"] is not None  # the tracker reaches it only through the relay
        # The pages it prints: the tracker's lists the node; the node's own answers on this machine.
        pages = re.search(r"tracker page: (\S+)\s+node page \(this machine only\): (\S+)", out)
        assert pages is not None, out
        assert "<title>meshnet tracker</title>" in httpx.get(pages.group(1)).text
        assert httpx.get(pages.group(1) + "dashboard.json").json()["nodes"][0]["reached"] == "relayed"
        assert httpx.get(pages.group(2) + "status.json").json()["health"]["relay"]["state"] == "attached"

        ran = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0, ran.stderr
        # The SDK closes on [DONE], maybe before the node's stream has ended: complete all the same.
        tracker_url = base_url.removesuffix("/v1")
        deadline = time.monotonic() + 10
        while (routed := httpx.get(tracker_url + "/v1/usage").json())[0]["outcome"] == "in_flight" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [(u["outcome"], u["status"]) for u in routed] == [("complete", 200)]

        family = psutil.Process(mesh.pid).children(recursive=True)
        assert len(family) >= 4  # tracker, relay, node, llama-server
        mesh.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
        assert mesh.wait(60) == 0, out_path.read_text()
        out = out_path.read_text()
        assert "mesh stopped" in out and f"state (keys, ledgers, logs) in {tmp_path / 'mesh'}" in out
        # The state is kept, and the node's usage reads after the mesh is gone.
        usage = subprocess.run([sys.executable, "-m", "meshnet_gguf", "usage", "--json", "--state-dir", str(tmp_path / "mesh" / "node")],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert json.loads(usage.stdout)["totals"]["requests"] == 1, usage.stdout + usage.stderr
        assert f"meshnet-gguf usage --state-dir {tmp_path / 'mesh' / 'node'}" in out
        _, alive = psutil.wait_procs(family, timeout=5)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if mesh.poll() is None:
            mesh.kill()
            mesh.wait()
        for proc in family:
            if proc.is_running():
                proc.kill()
