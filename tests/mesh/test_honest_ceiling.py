"""The tracker's completion ceiling never flags an honest node (docs/protocol.md §11, T13).

A real llama-server runs the demo model (real text) behind a node built from the real parts, in front
of the reference tracker. llama-server sends several tokens in one content event wherever it holds
text back (an incomplete UTF-8 character, whitespace its grammar parser has not settled, a stop string
it may still match): counting events flagged such nodes and under-billed them. Each answer here must
be billed exactly the node's true count (llama-server's own `usage`), unflagged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.reference.tracker.app import Tracker
from support.mesh_node import FAKE_LLAMA_KEY, MODEL, MeshNode
from support.mesh_tracker import SECRET, models, start_tracker, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.real_llama]

CHAT = "/v1/chat/completions"
START_TIMEOUT_S = 60.0
# The base model has no chat template: llama-server's ChatML fallback makes it echo and continue the prompt.
PERSON = {
    "name": "Person",
    "schema": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]},
}


class RealLlama:
    """The real llama-server on `model`, on a free loopback port, with the key the test node uses."""

    def __init__(self, binary: BinaryInfo, model: Path) -> None:
        port = free_local_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [str(binary.path), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "2048",
                "--parallel", "1", "-t", "2", "--api-key", FAKE_LLAMA_KEY]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, env=binary.environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.close()
        raise RuntimeError("llama-server did not become ready")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # module-wide, so one tracker and node serve every test here (each start costs seconds)


@pytest.fixture(scope="module")
def gemma_llama(real_llama: BinaryInfo, gemma_gguf: Path) -> Iterator[RealLlama]:
    llama = RealLlama(real_llama, gemma_gguf)
    yield llama
    llama.close()


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory, gemma_gguf: Path, gemma_llama: RealLlama) -> AsyncIterator[tuple[Tracker, str]]:
    tmp_path = tmp_path_factory.mktemp("honest-ceiling")
    async with start_tracker(tmp_path) as (service, url):
        node = MeshNode(tmp_path / "node", gemma_gguf, gemma_llama, tracker_url=url, tracker_key=service.public_key_text,
                        enrolment_secret=SECRET)  # fmt: skip
        async with node.running(), httpx.AsyncClient(timeout=10) as http:
            await wait_until(lambda: _listed(http, url))
            yield service, url


async def _listed(http: httpx.AsyncClient, url: str) -> bool:
    return await models(http, url) == [MODEL]


async def _through_the_tracker(url: str, request: dict[str, Any]) -> tuple[str, int]:
    """Send `request` through the tracker; the request id and the true count llama-server reported."""
    body = {"model": MODEL, **request}
    async with httpx.AsyncClient(timeout=120) as http:
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
            async with http.stream("POST", url + body.pop("path", CHAT), json=body) as answer:
                raw = b"".join([chunk async for chunk in answer.aiter_raw()])
            assert answer.status_code == 200, raw
            usages = [json.loads(line[6:])["usage"] for line in raw.splitlines() if line.startswith(b'data: {"') and b'"usage"' in line]
            true = [u for u in usages if u][-1]["completion_tokens"]
        else:
            answer = await http.post(url + body.pop("path", CHAT), json=body)
            assert answer.status_code == 200, answer.text
            true = answer.json()["usage"]["completion_tokens"]
        return answer.headers["x-meshnet-request-id"], true


async def _billed_honestly(url: str, rid: str, true: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as http:

        async def settled() -> bool:
            got = await http.get(f"{url}/v1/usage/{rid}")
            return got.status_code == 200 and got.json()["agreement"] in ("agree", "mismatch")

        await wait_until(settled)
        usage = (await http.get(f"{url}/v1/usage/{rid}")).json()
    assert usage["node"]["completion_tokens"] == true, usage
    assert usage["billed"]["completion_tokens"] == true and not usage["flagged"] and usage["agreement"] == "agree", usage
    return usage


# Each kind of text, streamed. `several_per_event`: with this seed the stream carries fewer content
# events than tokens by more than the old slack (2): the event-count ceiling flagged exactly these answers.
KINDS = {
    "english": ({"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 12, "temperature": 0}, False),
    "code": (
        {
            "messages": [{"role": "user", "content": "def fibonacci(n):\n    if n < 2:\n        return n\n"}],
            "max_tokens": 16,
            "temperature": 0,
        },
        False,
    ),
    "grammar_json": (
        {
            "messages": [{"role": "user", "content": "Give a person"}],
            "max_tokens": 40,
            "seed": 3,
            "temperature": 1,
            "response_format": {"type": "json_schema", "json_schema": PERSON},
        },
        True,
    ),  # fmt: skip
    "chinese": ({"messages": [{"role": "user", "content": "请重复：龘靐齉爩麤"}], "max_tokens": 12, "temperature": 0}, True),
    "emoji": ({"messages": [{"role": "user", "content": "Repeat: 🫠🪿🪼🪽🫎🫏"}], "max_tokens": 16, "temperature": 0}, True),
}


@pytest.mark.parametrize("kind", list(KINDS))
async def test_an_honest_node_is_billed_its_true_count_unflagged(kind: str, mesh: tuple[Tracker, str]) -> None:
    _, url = mesh
    request, several_per_event = KINDS[kind]
    rid, true = await _through_the_tracker(url, {**request, "stream": True})
    usage = await _billed_honestly(url, rid, true)
    if several_per_event:
        # The witness: what the tracker saw as content events is fewer than the tokens by more than 2.
        assert usage["tracker"]["completion_tokens"] + 2 < true, usage


# Every request shape the project's own end-to-end and SDK tests send through a node (chat and completions,
# whole and streamed, usage asked or not, stop strings, structured output, tools, logprobs, ignore_eos).
SHAPES: dict[str, dict[str, Any]] = {
    "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "chat_stream": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
    "chat_max_completion_tokens": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4},
    "chat_ignore_eos": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True, "stream": True},
    # The base model writes "<|im_end|>" as text, several tokens: the stop string is cut from the answer.
    "chat_stop": {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 24,
        "stop": ["<|im_end|>"],
        "stream": True,
        "temperature": 0,
    },
    "chat_stop_whole": {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 24, "stop": "<|im_end|>", "temperature": 0},
    "json_object": {
        "messages": [{"role": "user", "content": "A JSON object"}],
        "max_tokens": 8,
        "response_format": {"type": "json_object"},
        "stream": True,
    },
    "json_schema_whole": {
        "messages": [{"role": "user", "content": "Give a person"}],
        "max_tokens": 40,
        "seed": 5,
        "temperature": 1.5,
        "response_format": {"type": "json_schema", "json_schema": PERSON},
    },  # fmt: skip
    "tools": {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 4,
        "stream": True,
        "tools": [
            {
                "type": "function",
                "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
            }
        ],
    },  # fmt: skip
    "logprobs": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2, "stream": True},
    "completion": {"path": "/v1/completions", "prompt": "The sea is", "max_tokens": 4},
    "completion_stream": {"path": "/v1/completions", "prompt": "请重复：龘靐齉", "max_tokens": 8, "stream": True, "temperature": 0},
}


async def test_no_request_shape_flags_an_honest_node(mesh: tuple[Tracker, str]) -> None:
    _, url = mesh
    for shape, request in SHAPES.items():
        rid, true = await _through_the_tracker(url, request)
        try:
            await _billed_honestly(url, rid, true)
        except AssertionError as exc:
            raise AssertionError(f"{shape}: {exc}") from None
    async with httpx.AsyncClient(timeout=10) as http:
        [listed] = (await http.get(url + "/v1/nodes")).json()
    assert listed["receipt_flags"] == 0
