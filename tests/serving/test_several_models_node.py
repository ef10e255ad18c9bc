"""Several models on one node, through a real node process and the real llama-server: `serve` with a repeated
`--gguf`, the official `openai` SDK against each model (whole and streamed), a model that fails to load refused
with its reason while the others serve, an unknown model OpenAI's 404, `/v1/models` and `meshnet-gguf ps` listing
every model with its state, an idle model unloaded (its llama-server gone), and one usage row per request across
the load and the unload, each naming the model that served it."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from support.node_process import NodeProcess, StartNode

from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
from meshnet_gguf.serving.usage_journal import read_journal

pytestmark = [pytest.mark.real_llama]
CONTEXT = "512"
IDLE_S = 10  # the least idle time a model may have (model_set.MIN_IDLE_UNLOAD_S)
# The node looks for idle models every quarter of the shortest idle time: unloaded within IDLE_S * 1.25.
UNLOAD_WAIT_S = IDLE_S * 2 + 10
POLL_S = 0.1


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short folder: each model's socket lives under the state dir, and a socket's path must stay under
    108 bytes (pytest's own folders, named after the test, leave too few)."""
    with tempfile.TemporaryDirectory(prefix="mm-") as folder:
        yield Path(folder)


def _broken_model(workdir: Path) -> Path:
    """A GGUF whose header reads well (the node's checks pass it) but whose architecture llama-server does not know:
    it fails in llama-server's load, as a model the build cannot run does."""
    good = write_tiny_model(workdir / "good-copy.gguf", TinyModelSpec(seed=3, name="broken"))
    data = good.read_bytes()
    path = workdir / "broken.gguf"
    path.write_bytes(data[:4096].replace(b"llama", b"llamx") + data[4096:])
    good.unlink()
    return path


@pytest.fixture
def node(real_llama: BinaryInfo, workdir: Path, start_node: StartNode) -> NodeProcess:
    first = write_tiny_model(workdir / "tiny-a.gguf", TinyModelSpec(seed=1, name="tiny-a"))
    second = write_tiny_model(workdir / "tiny-b.gguf", TinyModelSpec(seed=2, name="tiny-b"))
    broken = _broken_model(workdir)
    started = start_node(
        "--gguf", str(first), "--gguf", f"{second},ctx={CONTEXT},idle={IDLE_S}", "--gguf", f"{broken},ctx={CONTEXT}",
        "--ctx-size", CONTEXT, "--parallel", "1", "--llama-server", str(real_llama.path),
        workdir=workdir,
    )  # fmt: skip
    started.wait_ready()
    return started


def _models(node: NodeProcess) -> dict[str, dict]:
    document = httpx.get(node.url + "/status.json", timeout=5).json()
    return {m["alias"]: m for m in document["models"]}


def _wait_for(node: NodeProcess, alias: str, state: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        model = _models(node)[alias]
        if model["state"] == state:
            return model
        time.sleep(POLL_S)
    raise AssertionError(f"{alias} not {state} after {timeout} s: {_models(node)[alias]}\n{node.log_text()[-2000:]}")


def _ask(client: openai.OpenAI, model: str) -> str:
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert answer.model == model
    return answer.choices[0].message.content or ""


def _stream(client: openai.OpenAI, model: str) -> str:
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True))
    assert chunks and all(c.model == model for c in chunks)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_two_models_answer_through_one_node_and_a_broken_one_is_refused_with_its_reason(node: NodeProcess) -> None:
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    assert _models(node)["tiny-b"]["state"] == "unloaded"
    for model in ("tiny-a", "tiny-b"):
        _ask(client, model)
        _stream(client, model)
    first_b = _models(node)["tiny-b"]
    assert first_b["state"] == "loaded" and first_b["loads"] == 1 and first_b["requests"] == 2 and first_b["pid"]

    # The broken model: OpenAI's error shape, 503, naming llama-server's own reason; the others keep serving.
    with pytest.raises(openai.APIStatusError) as refused:
        _ask(client, "broken")
    assert refused.value.status_code == 503
    assert "failed to load" in refused.value.message and "unknown model architecture" in refused.value.message
    again = httpx.post(
        node.url + "/v1/chat/completions", json={"model": "broken", "messages": [{"role": "user", "content": "Hi"}]}, timeout=10
    )
    assert again.status_code == 503 and again.json()["error"]["code"] == "model_unavailable"
    assert _ask(client, "tiny-a") is not None and _stream(client, "tiny-b") is not None

    # A model nobody serves here: OpenAI's 404, naming the ones served.
    with pytest.raises(openai.NotFoundError) as unknown:
        _ask(client, "nope")
    assert unknown.value.code == "model_not_found" and "tiny-b" in unknown.value.message

    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"tiny-a", "tiny-b", "broken"}
    states = {name: (m.model_extra or {}).get("status", {}).get("value") for name, m in listed.items()}
    assert states == {"tiny-a": "loaded", "tiny-b": "loaded", "broken": "failed"}

    ps = subprocess.run(
        [sys.executable, "-m", "meshnet_gguf", "ps", "--port", str(node.port)], capture_output=True, text=True, timeout=30, check=True
    )
    rows = {line.split()[0]: line.split() for line in ps.stdout.splitlines()[1:] if line and not line.startswith("broken:")}
    assert rows["tiny-a"][1:3] == ["loaded", "yes"] and rows["tiny-b"][1:3] == ["loaded", "no"] and rows["broken"][1] == "failed"
    assert ps.stdout.splitlines()[0].split() == ["MODEL", "STATE", "PINNED", "PID", "RSS", "PLANNED", "IDLE", "REQUESTS", "LOADS"]
    assert rows["tiny-b"][3] == str(_models(node)["tiny-b"]["pid"]) and rows["tiny-b"][4] != "-"  # its pid and its RSS
    assert rows["broken"][3:5] == ["-", "-"]  # no process, no memory
    assert "broken: llama-server exited" in ps.stdout


def test_an_idle_model_is_unloaded_its_process_gone_and_billing_is_one_row_per_request(node: NodeProcess) -> None:
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    asked = {"tiny-a": 0, "tiny-b": 0}
    for model in ("tiny-b", "tiny-a", "tiny-b"):
        _ask(client, model)
        asked[model] += 1
    pid = _models(node)["tiny-b"]["pid"]
    assert pid and psutil.pid_exists(pid)
    assert _models(node)["tiny-b"]["rss_bytes"] > 10 * 2**20  # a llama-server's RSS, even for a tiny model

    unloaded = _wait_for(node, "tiny-b", "unloaded", UNLOAD_WAIT_S)
    assert unloaded["pid"] is None and unloaded["rss_bytes"] is None and not psutil.pid_exists(pid)
    scrape = httpx.get(node.url + "/metrics", timeout=5).text
    assert 'meshnet_model_loaded{model="tiny-b"} 0.0' in scrape and 'meshnet_model_rss_bytes{model="tiny-b"} 0.0' in scrape
    assert 'meshnet_model_loaded{model="tiny-a"} 1.0' in scrape and 'meshnet_model_failed{model="broken"} 0.0' in scrape
    assert _models(node)["tiny-a"]["state"] == "loaded"  # the first model is never unloaded

    # Asked again: loaded anew (a new process), and still one usage row per request.
    _stream(client, "tiny-b")
    asked["tiny-b"] += 1
    again = _models(node)["tiny-b"]
    assert again["state"] == "loaded" and again["loads"] == 2 and again["pid"] != pid
    scrape = httpx.get(node.url + "/metrics", timeout=5).text
    assert 'meshnet_model_loaded{model="tiny-b"} 1.0' in scrape and 'meshnet_model_loads_total{model="tiny-b"} 2.0' in scrape
    assert f'meshnet_model_requests_total{{model="tiny-b"}} {asked["tiny-b"]}.0' in scrape
    journal = read_journal(node.state_dir, limit=100)
    assert journal is not None
    by_model = {m: sum(1 for r in journal.latest if r.model == m) for m in asked}
    assert by_model == asked
    assert len({r.request_id for r in journal.latest}) == len(journal.latest) == sum(asked.values())
    assert all(r.status == 200 for r in journal.latest)


def test_with_room_for_one_model_beside_the_first_each_request_loads_its_model_and_is_billed_once(
    real_llama: BinaryInfo, workdir: Path, start_node: StartNode
) -> None:
    first = write_tiny_model(workdir / "tiny-a.gguf", TinyModelSpec(seed=1, name="tiny-a"))
    others = [
        write_tiny_model(workdir / f"{name}.gguf", TinyModelSpec(seed=seed, name=name)) for seed, name in ((2, "tiny-b"), (4, "tiny-c"))
    ]
    node = start_node(
        "--gguf", str(first), *(arg for path in others for arg in ("--gguf", f"{path},ctx={CONTEXT}")),
        "--ctx-size", CONTEXT, "--parallel", "1", "--llama-server", str(real_llama.path),
        workdir=workdir, env={"MESHNET_MAX_LOADED_MODELS": "1"},
    )  # fmt: skip
    node.wait_ready()
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    order = ["tiny-b", "tiny-c", "tiny-b", "tiny-a", "tiny-c"]
    for model in order:
        _stream(client, model) if model == "tiny-c" else _ask(client, model)
        loaded = {alias for alias, m in _models(node).items() if m["state"] == "loaded"}
        # The first model and one other: the one just asked for (the first model's request leaves the other as it was).
        assert "tiny-a" in loaded and len(loaded) == 2 and (model == "tiny-a" or model in loaded)
    models = _models(node)
    assert (models["tiny-b"]["loads"], models["tiny-c"]["loads"]) == (2, 2)  # each unloaded for the other
    journal = read_journal(node.state_dir, limit=100)
    assert journal is not None
    assert [r.model for r in reversed(journal.latest)] == order
    assert len({r.request_id for r in journal.latest}) == len(order) and all(r.status == 200 for r in journal.latest)


def test_a_model_busy_in_all_its_slots_refuses_at_once_while_the_others_serve(  # type: ignore[no-untyped-def]
    fake_llama_path: Path, workdir: Path, start_node: StartNode
) -> None:
    """And with room for one model beside the first, a model that would need the busy one unloaded is refused at
    once: the stream in flight is never cut to make room."""
    first = write_tiny_model(workdir / "tiny-a.gguf", TinyModelSpec(seed=1, name="tiny-a"))
    second = write_tiny_model(workdir / "tiny-b.gguf", TinyModelSpec(seed=2, name="tiny-b"))
    third = write_tiny_model(workdir / "tiny-c.gguf", TinyModelSpec(seed=4, name="tiny-c"))
    node = start_node(
        "--gguf", str(first), "--gguf", f"{second},ctx={CONTEXT},slots=1", "--gguf", f"{third},ctx={CONTEXT}",
        "--ctx-size", CONTEXT, "--parallel", "2", "--llama-server", str(fake_llama_path), workdir=workdir,
        env={"FAKE_LLAMA_TOKENS": "40", "FAKE_LLAMA_TOKEN_DELAY_S": "0.05", "MESHNET_MAX_LOADED_MODELS": "1"},
    )  # fmt: skip
    node.wait_ready()
    body = {"model": "tiny-b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", node.url + "/v1/chat/completions", json=body) as streaming:
        assert streaming.status_code == 200
        lines = streaming.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # tiny-b's one slot is in use from here
        busy = client.post(node.url + "/v1/chat/completions", json={**body, "stream": False})
        assert busy.status_code == 503 and "slots of model tiny-b are busy" in busy.json()["error"]["message"]
        assert busy.headers["retry-after"]
        other = client.post(node.url + "/v1/chat/completions", json={**body, "model": "tiny-a", "stream": False})
        assert other.status_code == 200 and other.json()["model"] == "tiny-a"
        no_room = client.post(node.url + "/v1/chat/completions", json={**body, "model": "tiny-c", "stream": False})
        assert no_room.status_code == 503 and no_room.headers["retry-after"]
        assert "no room to load model tiny-c: it would need unloading tiny-b (busy)" in no_room.json()["error"]["message"]
        assert [line for line in lines if line][-1] == "data: [DONE]"  # the stream in flight was answered whole
    # Once it has ended, tiny-b is idle and makes room for tiny-c.
    after = httpx.post(node.url + "/v1/chat/completions", json={**body, "model": "tiny-c", "stream": False}, timeout=30)
    assert after.status_code == 200 and _models(node)["tiny-b"]["state"] == "unloaded"
