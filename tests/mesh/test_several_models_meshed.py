"""A meshed node of several models, on loopback with the reference tracker and the real llama-server: the node
announces each model (the one beside the first `loadable` until a request loads it), the tracker routes a request
by its model to it, the node loads the model for it, and the tracker bills each request once, as the model served."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.relay_processes import ledger_rows
from support.tracker_process import TrackerProcess, sdk, wait_for
from support.tracker_process import tracker as tracker  # noqa: F401 - the fixture

from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model

pytestmark = [pytest.mark.real_llama]
CONTEXT = "512"


@pytest.fixture
def workdir() -> Iterator[Path]:
    """Short: each model's socket lives under the node's state dir (a socket's path stays under 108 bytes)."""
    with tempfile.TemporaryDirectory(prefix="mm-") as folder:
        yield Path(folder)


def _states(tracker: TrackerProcess) -> dict[str, str]:
    nodes = httpx.get(tracker.url + "/v1/nodes", timeout=5).json()
    return {m["model"]: m["state"] for node in nodes for m in node.get("models") or []}


def test_the_tracker_routes_each_model_to_the_node_which_loads_it_and_bills_each_request_once(  # type: ignore[no-untyped-def]
    real_llama: BinaryInfo, tracker: TrackerProcess, start_node, workdir: Path
) -> None:
    first = write_tiny_model(workdir / "tiny-a.gguf", TinyModelSpec(seed=1, name="tiny-a"))
    second = write_tiny_model(workdir / "tiny-b.gguf", TinyModelSpec(seed=2, name="tiny-b"))
    node = start_node(
        "--gguf", str(first), "--gguf", f"{second},ctx={CONTEXT}", "--ctx-size", CONTEXT, "--parallel", "1",
        "--tracker", tracker.url, "--llama-server", str(real_llama.path), env=tracker.enrolment(), workdir=workdir,
    )  # fmt: skip
    node.wait_ready()
    wait_for(lambda: sorted(tracker.models()) == ["tiny-a", "tiny-b"], "both models routable", node.log_path)
    assert _states(tracker) == {"tiny-a": "loaded", "tiny-b": "loadable"}

    client = sdk(tracker)
    asked = ["tiny-b", "tiny-a", "tiny-b"]
    for model in asked:
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert answer.model == model
    streamed = list(client.chat.completions.create(model="tiny-b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True))
    assert streamed and all(c.model == "tiny-b" for c in streamed)
    asked.append("tiny-b")
    # The next heartbeat tells the tracker the model is loaded now.
    wait_for(lambda: _states(tracker) == {"tiny-a": "loaded", "tiny-b": "loaded"}, "tiny-b announced loaded", node.log_path)

    wait_for(lambda: len(tracker.usage()) == len(asked), "every request billed", node.log_path)
    billed = tracker.usage()
    assert sorted(u["model"] for u in billed) == sorted(asked)
    assert len({u["request_id"] for u in billed}) == len(asked)
    wait_for(lambda: all(r["has_receipt"] for r in ledger_rows(node.state_dir)), "every receipt delivered", node.log_path)
    rows = ledger_rows(node.state_dir)
    assert len(rows) == len(asked) and not any(r["rejected"] for r in rows)
