"""What a new user runs into first: bad input gets one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.contract.signing import public_key_text
from support.relay_harness import forged_connect
from support.node_process import StartNode
from support.tracker_process import TrackerProcess, tracker  # noqa: F401

CLI_TIMEOUT_S = 60


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnet_gguf", *argv], capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
        env={**os.environ, **(env or {})}, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["serve", "--port", "99999", "--dry-run"], {}),
        (["doctor"], {"MESHNET_PORT": "70000"}),
    ],
)
def test_a_port_out_of_range_is_one_clear_line(argv: list[str], env: dict[str, str], tiny_gguf: Path) -> None:
    done = _run(*argv, "--gguf", str(tiny_gguf), env=env)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "OverflowError" not in done.stderr
    assert "error: --port / MESHNET_PORT: Input should be less than or equal to 65535" in done.stderr


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("ftp://tracker.example:8000", "reached over http:// or https://, not ftp://"),
        ("tracker.example:8000", "has no scheme: write it as http://tracker.example:8000"),
        ("http://:8000", "names no host"),
    ],
)
def test_a_tracker_url_that_cannot_work_is_refused_up_front(url: str, said: str, tiny_gguf: Path) -> None:
    done = _run("serve", "--gguf", str(tiny_gguf), "--tracker", url, "--dry-run")
    assert done.returncode == 2
    assert f"error: --tracker / MESHNET_TRACKER: {url!r}" in done.stderr and said in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_node_without_the_enrolment_secret_is_told_what_to_set_and_stops(  # type: ignore[no-untyped-def]
    tracker: TrackerProcess, tiny_gguf: Path, fake_llama_path: Path, start_node: StartNode
) -> None:
    node = start_node("--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path), "--tracker", tracker.url)
    code = node.wait_exit(timeout=60)  # not a retry loop against a 401 that cannot change
    log = node.log_text()
    assert code == 1, log[-3000:]
    assert "MESHNET_ENROLMENT_SECRET" in log and "--enrolment-secret" in log
    assert "this node sent no enrolment secret" in log
    assert log.count("refused registration") == 0  # said once, as the reason it stopped


def test_dev_relay_exits_0_on_sigterm_as_the_others_do() -> None:
    port = free_local_port()
    relay = subprocess.Popen(
        [sys.executable, "-m", "meshnet_gguf", "dev", "relay", "--port", str(port), "--open"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_relay_up(relay, port)
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(timeout=30) == 0, relay.stdout.read() if relay.stdout else ""
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait()


def _answer(port: int, request: bytes, source: str) -> bytes:
    """What the relay says to `request` from `source`: b"" when it resets or closes without a word."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3, source_address=(source, 0)) as sock:
            sock.sendall(request)
            return sock.recv(4096)
    except OSError:
        return b""


def test_dev_relay_stranger_tries_per_s_sets_the_relay_wide_budget_for_strangers(tmp_path: Path) -> None:
    # 0.5 tries a second: a burst of 4, of which the health probe below takes one (loopback is a stranger here).
    # Twelve strangers from twelve networks (one try each, well inside their own network's bucket) then find at most
    # what is left, plus a refill or two; on the default budget (1,024) all twelve would be answered.
    port = free_local_port()
    tracker_key = public_key_text(Ed25519PrivateKey.generate().public_key())
    relay = subprocess.Popen(
        [sys.executable, "-m", "meshnet_gguf", "dev", "relay", "--port", str(port), "--trust-tracker-key", tracker_key,
         "--stranger-tries-per-s", "0.5", "--state-dir", str(tmp_path / "relay")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_relay_up(relay, port)
        connect = forged_connect("node-" + "a" * 26)
        answers = [_answer(port, connect, f"127.0.9.{i + 1}") for i in range(12)]
        answered = [a for a in answers if a]
        assert 1 <= len(answered) <= 4, answers
        assert all(a.startswith(b"HTTP/1.1 407") for a in answered), answered
    finally:
        relay.kill()
        relay.wait()


def _wait_relay_up(relay: subprocess.Popen[str], port: int) -> None:
    """Until the `dev relay` process answers /health on `port`; fails with its output if it exits or never does."""
    deadline = time.monotonic() + CLI_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and relay.poll() is None, relay.stdout.read() if relay.stdout else ""
        time.sleep(0.1)


def test_dev_mesh_on_a_taken_port_says_which_and_how_to_move_it(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        before = set(Path(tempfile.gettempdir()).glob("meshnet-mesh-*"))
        done = _run("dev", "mesh", "--gguf", "unused.gguf", "--tracker-port", str(port), "--relay-port", "0")
    assert done.returncode == 2
    assert f"port {port} (the tracker's) is already in use: pass --tracker-port 0" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Errno" not in done.stdout + done.stderr
    assert set(Path(tempfile.gettempdir()).glob("meshnet-mesh-*")) == before  # no folder left behind


def test_service_install_without_a_model_says_the_unit_could_not_start() -> None:
    from typer.testing import CliRunner

    from meshnet_gguf.cli import app

    done = CliRunner().invoke(app, ["service", "install", "--dry-run"])
    assert "no model: the service would fail at every start; pass --gguf MODEL (or --demo)" in done.output


def test_serve_ends_its_start_with_the_ready_line(  # type: ignore[no-untyped-def]
    tiny_gguf: Path, fake_llama_path: Path, start_node: StartNode
) -> None:
    node = start_node("--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path))
    node.wait_ready()
    deadline = time.monotonic() + 10
    while "ready: tiny at" not in node.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"ready: tiny at {node.url}/v1 (this node's page: {node.url}/)" in node.log_text()


def test_a_second_node_on_the_same_state_dir_is_refused_before_its_launch_plan(  # type: ignore[no-untyped-def]
    tiny_gguf: Path, fake_llama_path: Path, start_node: StartNode
) -> None:
    first = start_node("--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path))
    first.wait_ready()
    second = start_node("--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path))  # same workdir: same state dir
    assert second.wait_exit(timeout=60) == 2
    log = second.log_text()
    assert "another node" in log and "--state-dir" in log
    assert "launch plan" not in log and "hardware:" not in log, log


@pytest.mark.parametrize("given", [["-m", "model.gguf"], ["--model", "model.gguf"], ["--model=model.gguf"]])
def test_llama_cpps_model_flag_is_pointed_at_gguf(given: list[str]) -> None:
    done = _run("serve", *given, "--dry-run")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"No such option: {given[0].split('=')[0]}: the model is given with --gguf here: --gguf FILE.gguf" in done.stderr
    assert "Possible options" not in done.stderr  # not --demo, which click finds nearest
