"""Each model's state on the tracker, end to end: the reference tracker and a real node process serving two tiny
models and one that fails to load (each its own real llama-server). The tracker shows each model's state on the node
as its heartbeats say it (loadable, then loaded with the load time the node measured; unavailable once its load
failed, and then routed nowhere and listed nowhere), and what the node earned serving each model. The routing and
billing of each model through the real node are in `tests/mesh/test_several_models_meshed.py`."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.node_process import NodeProcess, StartNode
from support.tracker_process import TrackerProcess, sdk, tracker, wait_for  # noqa: F401

from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model

pytestmark = [pytest.mark.real_llama]
CONTEXT = "512"
WAIT_S = 60.0


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short folder: each model's llama-server socket lives under the node's state dir (108 bytes at most)."""
    with tempfile.TemporaryDirectory(prefix="mm-") as folder:
        yield Path(folder)


def _node_view(on: TrackerProcess) -> dict[str, Any]:
    """The one node `/v1/nodes` of the tracker shows."""
    (node,) = httpx.get(on.url + "/v1/nodes", timeout=5).json()
    return node


def _states(on: TrackerProcess) -> dict[str, str]:
    return {m["model"]: m["state"] for m in _node_view(on)["models"]}


def test_the_tracker_routes_and_bills_each_model_of_a_node_and_sees_it_loaded(
    real_llama: BinaryInfo,
    tracker: TrackerProcess,  # noqa: F811
    start_node: StartNode,
    workdir: Path,
) -> None:
    first = write_tiny_model(workdir / "tiny-a.gguf", TinyModelSpec(seed=1, name="tiny-a"))
    second = write_tiny_model(workdir / "tiny-b.gguf", TinyModelSpec(seed=2, name="tiny-b"))
    broken = workdir / "broken.gguf"
    data = write_tiny_model(workdir / "good-copy.gguf", TinyModelSpec(seed=3, name="broken")).read_bytes()
    broken.write_bytes(data[:4096].replace(b"llama", b"llamx") + data[4096:])  # a header that reads, an architecture that does not load
    (workdir / "node").mkdir()
    node: NodeProcess = start_node(
        "--gguf", str(first), "--gguf", f"{second},ctx={CONTEXT}", "--gguf", f"{broken},ctx={CONTEXT}",
        "--ctx-size", CONTEXT, "--parallel", "1", "--llama-server", str(real_llama.path), "--tracker", tracker.url,
        env=tracker.enrolment(), workdir=workdir / "node",
    )  # fmt: skip
    node.wait_ready()
    wait_for(lambda: tracker.models() == ["broken", "tiny-a", "tiny-b"], "every model listed on the tracker", node.log_path)
    assert _states(tracker) == {"tiny-a": "loaded", "tiny-b": "loadable", "broken": "loadable"}

    client = sdk(tracker)
    for model in ("tiny-b", "tiny-a", "tiny-b"):
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert answer.model == model and answer.choices[0].message.content is not None
    wait_for(lambda: _states(tracker)["tiny-b"] == "loaded", "the node's heartbeat to say tiny-b is loaded", node.log_path, WAIT_S)
    tiny_b = next(m for m in _node_view(tracker)["models"] if m["model"] == "tiny-b")
    assert tiny_b["expected_load_s"] and tiny_b["expected_load_s"] > 0  # measured at its first load

    # The model that cannot load: the node's 503 passes through, then its heartbeat says so and it is routed nowhere.
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="broken", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert refused.value.status_code == 503
    wait_for(lambda: _states(tracker)["broken"] == "unavailable", "the node to say broken is unavailable", node.log_path, WAIT_S)
    wait_for(lambda: "broken" not in tracker.models(), "broken to leave the tracker's models", node.log_path, WAIT_S)

    # Billed per model: each request's row names the model it was routed as, and the node's receipt agrees.
    def receipts_in() -> bool:
        rows = [u for u in tracker.usage() if u["status"] == 200]
        return len(rows) == 3 and all(u["agreement"] == "agree" for u in rows)

    wait_for(receipts_in, "the node's receipts", node.log_path, WAIT_S)
    served = sorted(u["model"] for u in tracker.usage() if u["status"] == 200)
    assert served == ["tiny-a", "tiny-b", "tiny-b"]
    earned = {m["model"]: m["earned"]["requests"] for m in _node_view(tracker)["models"]}
    assert earned == {"tiny-a": 1, "tiny-b": 2, "broken": 0}
