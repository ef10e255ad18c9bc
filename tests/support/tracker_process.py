"""The reference tracker in front of real nodes, for the end-to-end and crash tests of the mesh."""

from __future__ import annotations

import re
import shlex
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from meshnet_gguf.contract.protocol import WELL_KNOWN_PATH
from meshnet_gguf.reference.tracker.ledger import TRACKER_LEDGER_FILE
from support.node_process import NodeProcess, free_port
from support.relay_processes import HEARTBEAT_S, WAIT_S, ServiceProcess

MESSAGES = [{"role": "user", "content": "Say hello."}]


class TrackerProcess(ServiceProcess):
    """`python -m meshnet_gguf dev tracker` as a child (the tracker's enrolment hint in its log); stopped by PID only."""

    def __init__(self, workdir: Path, *extra_args: str) -> None:
        port = free_port()
        super().__init__("tracker", [
            "dev", "tracker", "--port", str(port), "--state-dir", str(workdir / "tracker"),
            "--heartbeat-interval", str(HEARTBEAT_S), *extra_args,
        ], workdir, port=port)  # fmt: skip
        self.state_dir = workdir / "tracker"
        self.start()

    def public_key(self) -> str:
        return httpx.get(self.url + WELL_KNOWN_PATH).json()["public_key"]

    def serve_line(self) -> dict[str, str]:
        """The `serve` line the tracker's banner prints, as the environment it sets and its arguments."""
        lines = [line for line in self.log_path.read_text().splitlines() if " meshnet-gguf serve " in line]
        words = shlex.split(lines[-1])
        env = dict(w.split("=", 1) for w in words if re.fullmatch(r"MESHNET_[A-Z_]+=.*", w))
        for name, value in env.items():  # a secret the banner names by its file (it prints one only on a terminal)
            if (kept := re.fullmatch(r"\$\(cat (.+)\)", value)) is not None:
                env[name] = Path(kept.group(1)).read_text().strip()
        argv = words[words.index("serve") + 1 :]
        assert argv[argv.index("--tracker") + 1] == self.url
        return env

    def enrolment(self) -> dict[str, str]:
        """Only what a node needs to enrol, without the pinned key: the node learns that on first contact."""
        return {"MESHNET_ENROLMENT_SECRET": self.serve_line()["MESHNET_ENROLMENT_SECRET"]}

    def usage(self) -> list[dict[str, Any]]:
        return httpx.get(self.url + "/v1/usage?limit=10000").json()

    def receipt_rows(self) -> list[str]:
        db = sqlite3.connect(f"file:{self.state_dir / TRACKER_LEDGER_FILE}?mode=ro", uri=True)
        try:
            return [row[0] for row in db.execute("SELECT request_id FROM receipts")]
        finally:
            db.close()

    def models(self) -> list[str]:
        try:
            return [m["id"] for m in httpx.get(self.url + "/v1/models", timeout=2).json()["data"]]
        except httpx.HTTPError:
            return []


def wait_for(condition: Callable[[], bool], what: str, log: Path | None = None, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


@pytest.fixture
def tracker(tmp_path: Path) -> Iterator[TrackerProcess]:
    proc = TrackerProcess(tmp_path)
    yield proc
    proc.close()
    # pytest shows this only when the test failed: both sides' logs, to see why.
    for log in [proc.log_path, *sorted(tmp_path.glob("*/node-*.log"))]:
        print(f"----- {log.name}\n{log.read_text(errors='replace')[-4000:]}")


def start_meshed_node(start_node, tracker: TrackerProcess, gguf: Path, workdir: Path, **env: str) -> NodeProcess:  # type: ignore[no-untyped-def]
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**tracker.enrolment(), **env}  # the tracker requires its enrolment secret by default
    node = start_node("--gguf", str(gguf), "--tracker", tracker.url, "--parallel", "2", "--ctx-size", "2048", env=env, workdir=workdir)
    node.wait_ready()
    wait_for(lambda: tracker.models() == [gguf.stem], "the node to become routable", node.log_path)
    return node


# The fake llama-server's stream for the durability-window tests: slow enough that a kill lands mid-stream.
SLOW_FAKE_TOKENS = {"FAKE_LLAMA_TOKEN_DELAY_S": "0.5", "FAKE_LLAMA_TOKENS": "8"}


def start_meshed_fake_node(
    start_node, tracker: TrackerProcess, gguf: Path, fake_llama_path: Path, workdir: Path, **env: str
) -> NodeProcess:  # type: ignore[no-untyped-def]
    """A meshed node of `tracker` in front of the fake llama-server (`SLOW_FAKE_TOKENS`), ready and routable."""
    workdir.mkdir(parents=True, exist_ok=True)
    node = start_node(
        "--gguf", str(gguf), "--llama-server", str(fake_llama_path), "--tracker", tracker.url, "--parallel", "2",
        env={**tracker.enrolment(), "MESHNET_TRACKER_PUBLIC_KEY": tracker.public_key(), **SLOW_FAKE_TOKENS, **env}, workdir=workdir,
    )  # fmt: skip
    node.wait_ready()
    wait_for(lambda: tracker.models() == [gguf.stem], "the node to become routable", node.log_path)
    return node


def sdk(tracker: TrackerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tracker.url + "/v1", api_key="unused", max_retries=0, timeout=30)
