"""The node serving real GGUF models through the real llama-server, driven by the official openai SDK,
what it does with a llama-server build too new for the CPU it runs on, and a meshed serve that reads its
key and checks its first contact once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model

MESSAGES = [{"role": "user", "content": "Say hello."}]
# A second Ctrl-C must end the node this soon: well inside the 10 s llama-server lets a SIGTERM wait
# while it streams (the node's whole stop took 11-13 s before the second signal killed it).
SECOND_SIGNAL_EXIT_S = 4.0
# The first Ctrl-C drains: with a stream in flight the node must still be up this long after it.
DRAINING_AFTER_FIRST_S = 1.0


def llama_client(pid: int) -> httpx.Client:
    """A client of llama-server itself (its UNIX socket, or its loopback port) with its internal
    key, both read the way an operator with root could."""
    proc = psutil.Process(pid)
    argv = proc.cmdline()
    host = argv[argv.index("--host") + 1]
    headers = {"authorization": f"Bearer {proc.environ()['LLAMA_API_KEY']}"}
    if host.endswith(".sock"):
        return httpx.Client(transport=httpx.HTTPTransport(uds=host), base_url="http://localhost", headers=headers)
    return httpx.Client(base_url=f"http://127.0.0.1:{argv[argv.index('--port') + 1]}", headers=headers)


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.real_llama
@pytest.mark.parametrize("model", ["tiny_gguf", "tiny_split_gguf"])
def test_serves_single_file_and_split_models_to_the_openai_sdk(model: str, request, real_llama, start_node) -> None:  # type: ignore[no-untyped-def]
    path: Path = request.getfixturevalue(model)
    node = start_node("--gguf", str(path), "--ctx-size", "2048")
    node.wait_ready()
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused")
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8)
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert answer.usage is not None and answer.usage.completion_tokens >= 1

    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks and all(c.usage is None for c in chunks)  # usage chunk hidden: not asked for
    assert text.isascii()

    # ignore_eos: the random tiny model may sample its end token early; this count must be exact.
    completion = client.completions.create(model="tiny", prompt="abc", max_tokens=4, extra_body={"ignore_eos": True})
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    assert [m.id for m in client.models.list()] == [node.health().json()["model"]]
    health = node.health().json()
    assert health["usage"]["requests"] == 3
    assert health["usage"]["completion_tokens"] >= answer.usage.completion_tokens + 4


@pytest.mark.real_llama
def test_back_to_back_requests_after_streams_never_hit_a_closed_connection(real_llama, start_node, tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    # llama-server closes the connection after each streamed answer; a pooled client that
    # reused it for the next request would fail with 503 "Can not write request body".
    node = start_node("--gguf", str(tiny_gguf), "--ctx-size", "2048")
    node.wait_ready()
    statuses = []
    with httpx.Client(base_url=node.url, timeout=30) as client:
        for _ in range(150):
            statuses.append(client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "stream": True}).status_code)
            statuses.append(client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).status_code)
            statuses.append(client.get("/v1/models").status_code)
    assert set(statuses) == {200}


@pytest.mark.real_llama
def test_kill_9_of_llama_server_recovers_without_operator_action(real_llama, start_node, gemma_gguf) -> None:  # type: ignore[no-untyped-def]
    node = start_node("--gguf", str(gemma_gguf), "--ctx-size", "2048", "--parallel", "2")
    node.wait_ready()
    child = node.llama_pid()
    assert child
    received: list[bytes] = []
    finished_at: list[float] = []

    def stream() -> None:
        with httpx.Client(timeout=60) as client:
            body = {"messages": MESSAGES, "max_tokens": 400, "stream": True}
            with client.stream("POST", node.url + "/v1/chat/completions", json=body) as response:
                for chunk in response.iter_bytes():
                    received.append(chunk)
        finished_at.append(time.monotonic())

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 30
    while sum(c.count(b'"content"') for c in received) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    killed_at = time.monotonic()
    os.kill(child, signal.SIGKILL)
    reader.join(timeout=10)
    assert finished_at and finished_at[0] - killed_at < 1.0
    body = b"".join(received)
    assert b'data: {"error"' in body and body.endswith(b"data: [DONE]\n\n")

    unhealthy = node.health()
    assert unhealthy is not None and unhealthy.status_code == 503
    health = node.wait_ready(timeout=60)
    assert health["restarts"] == 1
    assert node.llama_pid() != child
    answer = openai.OpenAI(base_url=node.url + "/v1", api_key="x").chat.completions.create(
        model=gemma_gguf.stem, messages=MESSAGES, max_tokens=3
    )
    assert answer.choices[0].message.content is not None


@pytest.mark.real_llama
def test_client_disconnect_frees_the_llama_slot_at_once(real_llama, start_node, gemma_gguf) -> None:  # type: ignore[no-untyped-def]
    node = start_node("--gguf", str(gemma_gguf), "--ctx-size", "4096", "--parallel", "1")
    node.wait_ready()
    llama = llama_client(node.llama_pid())  # type: ignore[arg-type]
    with httpx.Client(timeout=60) as client, llama:
        body = {"messages": MESSAGES, "max_tokens": 1000, "stream": True, "ignore_eos": True}
        with client.stream("POST", node.url + "/v1/chat/completions", json=body) as response:
            chunks = response.iter_bytes()
            for _ in range(3):
                next(chunks)
            assert any(s["is_processing"] for s in llama.get("/slots").json())
        # Leaving the block closed the connection mid-stream.
        closed_at = time.monotonic()
        while any(s["is_processing"] for s in llama.get("/slots").json()):
            assert time.monotonic() - closed_at < 2.0, "llama-server kept generating for a gone client"
            time.sleep(0.02)
    usage = node.health().json()["usage"]
    assert usage["cancelled"] == 1 and 0 < usage["completion_tokens"] < 1000


@pytest.mark.real_llama
def test_sigterm_exits_0_and_leaves_no_llama_server(real_llama, start_node, tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    node = start_node("--gguf", str(tiny_gguf))
    node.wait_ready()
    child = node.llama_pid()
    assert child and not gone(child)
    node.signal(signal.SIGTERM)
    assert node.wait_exit() == 0
    assert gone(child)
    assert not (node.state_dir / "llama-server.pid").exists()


# Room for a stream that outlasts the draining second on a fast CPU: the tiny model's 2,048-token slot (llama-server
# caps a slot at the model's trained context) is full in under a second there.
LONG_STREAM_CONTEXT = 65_536


@pytest.mark.real_llama
def test_a_second_sigint_stops_a_streaming_llama_server_at_once(real_llama, start_node, tmp_path) -> None:  # type: ignore[no-untyped-def]
    long_context = write_tiny_model(tmp_path / "long-context.gguf", TinyModelSpec(context_length=LONG_STREAM_CONTEXT))
    node = start_node("--gguf", str(long_context), "--parallel", "1", "--ctx-size", str(LONG_STREAM_CONTEXT))
    node.wait_ready()
    child = node.llama_pid()
    assert child
    streaming = threading.Event()
    ended: list[str] = []

    def stream() -> None:
        body = {"messages": MESSAGES, "max_tokens": 100_000, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", node.url + "/v1/chat/completions", json=body, timeout=60) as response:
                for _ in response.iter_bytes():
                    streaming.set()
            ended.append("closed")
        except httpx.HTTPError as exc:
            ended.append(type(exc).__name__)

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert streaming.wait(30)
    node.signal(signal.SIGINT)
    time.sleep(DRAINING_AFTER_FIRST_S)
    assert node.proc.poll() is None, "the first SIGINT drains: the stream in flight may finish"
    second = time.monotonic()
    node.signal(signal.SIGINT)
    assert node.wait_exit(timeout=30) == 0
    took = time.monotonic() - second
    assert took < SECOND_SIGNAL_EXIT_S, f"the second SIGINT took {took:.1f} s to stop the node"
    assert gone(child)
    assert f"SIGINT again: stopping now; llama-server (pid {child}) killed with SIGKILL" in node.log_text()
    reader.join(10)
    assert ended  # the client's stream ended too, not left hanging


@pytest.mark.real_llama
@pytest.mark.slow
def test_demo_model_answers_real_text_streamed_and_not(real_llama, start_node, gemma_gguf) -> None:  # type: ignore[no-untyped-def]
    node = start_node("--gguf", str(gemma_gguf), "--ctx-size", "2048")
    node.wait_ready()
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused")
    answer = client.chat.completions.create(model=gemma_gguf.stem, messages=MESSAGES, max_tokens=16)
    assert answer.choices[0].message.content and answer.choices[0].message.content.strip()
    stream = client.chat.completions.create(
        model=gemma_gguf.stem, messages=MESSAGES, max_tokens=16, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    usage = chunks[-1].usage
    assert usage is not None and 1 <= usage.completion_tokens <= 16 and usage.prompt_tokens > 0


def test_a_chosen_build_too_new_for_this_cpu_is_refused_before_launch_with_the_fix(  # type: ignore[no-untyped-def]
    newer_cpu_llama_path: Path, start_node, tmp_path: Path
) -> None:
    quantized = write_tiny_model(tmp_path / "q8.gguf", TinyModelSpec(weight_type="Q8_0"))
    node = start_node("--gguf", str(quantized), "--llama-server", str(newer_cpu_llama_path))
    assert node.wait_exit() == 2  # refused at setup: the operator's choice is never swapped for a build
    log = node.log_text()
    assert "dies with SIGILL on this CPU running Q8_0 weights" in log and "meshnet-gguf build-llama-server" in log
    assert node.llama_pid() is None  # no llama-server was launched to crash


def test_a_crash_the_probe_could_not_foresee_is_explained_with_the_fix(  # type: ignore[no-untyped-def]
    newer_cpu_llama_path: Path, start_node, tiny_gguf: Path, tmp_path: Path
) -> None:
    wrapper = tmp_path / "llama-server"
    wrapper.write_text(f'#!/bin/sh\nexport STAND_IN_DIES_ON=every-model-but-the-probe\nexec "{newer_cpu_llama_path}" "$@"\n')
    wrapper.chmod(0o755)
    node = start_node("--gguf", str(tiny_gguf), "--llama-server", str(wrapper))
    assert node.wait_exit() == 1
    log = node.log_text()
    assert "illegal instruction (SIGILL)" in log and "meshnet-gguf build-llama-server" in log and "cmake ninja-build g++" in log


# Loaded first in the node's process (PYTHONPATH): counts the first-contact checks and the reads of
# the node's key file, and writes the counts when the node exits. Only `serve` counts (llama-server and
# any other Python child the node starts see the same PYTHONPATH).
COUNTING_SITECUSTOMIZE = """
import atexit, json, os, sys
if sys.argv[1:2] == ["serve"]:
    import meshnet_gguf.mesh.identity as identity
    import meshnet_gguf.mesh.tracker_link as tracker_link
    counts = {"first_contact_checks": 0, "key_reads": 0}

    def counted(module, name, what):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[what] += 1
            return real(*args, **kwargs)

        setattr(module, name, wrapper)

    counted(tracker_link, "first_contact_problem", "first_contact_checks")
    counted(identity, "load_or_create_private_key", "key_reads")
    counted(identity, "load_private_key", "key_reads")
    atexit.register(lambda: open(os.environ["MESHNET_TEST_COUNTS"], "w").write(json.dumps(counts)))
"""


@pytest.mark.real_llama
def test_a_meshed_serve_reads_its_key_once_and_checks_first_contact_once(real_llama, start_node, tiny_gguf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    counting = tmp_path / "counting"
    counting.mkdir()
    (counting / "sitecustomize.py").write_text(COUNTING_SITECUSTOMIZE)
    counts = tmp_path / "counts.json"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(counting), os.environ.get("PYTHONPATH")])), "MESHNET_TEST_COUNTS": str(counts)}
    # A tracker on loopback that is not there: the key is learnt on first contact (safe on loopback), so the
    # check runs; the link keeps retrying in the background while the node serves.
    tracker = f"http://127.0.0.1:{free_local_port()}"
    node = start_node("--gguf", str(tiny_gguf), "--tracker", tracker, env=env)
    node.wait_ready()
    node.signal(signal.SIGTERM)
    assert node.wait_exit() == 0
    assert json.loads(counts.read_text()) == {"first_contact_checks": 1, "key_reads": 1}
