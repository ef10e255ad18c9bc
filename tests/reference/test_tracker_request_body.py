"""The tracker reads a client's body with the node's own strict parser (`contract/strict_json`), played as
an attacker against a real tracker routing to a real node.

A repeated key is the classic smuggle: a JSON reader that keeps the last value (Python's) and one that keeps
the first disagree, so a body with `"max_tokens": 1, "max_tokens": 100000` would be metered by one reading
and served by another. The tracker refuses such a body with a 400 before it routes, signs or records
anything, and no node ever sees it; so does every other body the node refuses as JSON.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from meshnet_gguf.common.asgi import AsgiApp, Receive, Scope, Send
from meshnet_gguf.contract.strict_json import MAX_JSON_DEPTH
from meshnet_gguf.reference.tracker.app import Tracker
from support.mesh_node import MODEL, FakeLlama, MeshNode
from support.mesh_tracker import SECRET, start_tracker, wait_until

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
M = f'"model":"{MODEL}"'
USER = '"messages":[{"role":"user","content":"hi"}]'

# Bodies the node refuses as JSON, each with the code both sides answer with.
SMUGGLED: dict[str, tuple[bytes, str]] = {
    "two max_tokens": (("{" + M + "," + USER + ',"max_tokens":1,"max_tokens":100000}').encode(), "duplicate_key"),
    "two models": (("{" + M + ',"model":"another",' + USER + "}").encode(), "duplicate_key"),
    "two contents in a message": (
        ("{" + M + ',"messages":[{"role":"user","content":"hi","content":"' + "x" * 5000 + '"}]}').encode(),
        "duplicate_key",
    ),
    "NaN": (("{" + M + "," + USER + ',"temperature":NaN}').encode(), "invalid_json"),
    "1e999": (("{" + M + "," + USER + ',"temperature":1e999}').encode(), "invalid_json"),
    "huge integer": (("{" + M + "," + USER + ',"seed":123456789012345678901234567890}').encode(), "invalid_json"),
    "lone surrogate": (("{" + M + ',"messages":[{"role":"user","content":"\\ud800"}]}').encode(), "invalid_unicode"),
    "invalid UTF-8": (("{" + M + ',"messages":[{"role":"user","content":"').encode() + b'\xff"}]}', "invalid_encoding"),
    "just too deep": (
        ("{" + M + "," + USER + ',"x":' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}").encode(),
        "json_too_deep",
    ),
}


@pytest.fixture
def llama(tmp_path: Path) -> Iterator[FakeLlama]:
    fake = FakeLlama(tmp_path, FAKE_LLAMA_TOKENS="4")
    yield fake
    fake.close()


@pytest.fixture
async def tracker(tmp_path: Path) -> AsyncIterator[tuple[Tracker, str]]:
    async with start_tracker(tmp_path) as running:
        yield running


def seen_by(app: AsgiApp, paths: list[str]) -> AsgiApp:
    """`app`, noting the path of every POST that reaches it."""

    async def noted(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            paths.append(scope["path"])
        await app(scope, receive, send)

    return noted


async def test_a_body_the_node_would_refuse_is_refused_by_the_tracker_before_any_node_sees_it(
    tracker: tuple[Tracker, str], tmp_path: Path, tiny_gguf: Path, llama: FakeLlama
) -> None:
    service, url = tracker
    mesh = MeshNode(tmp_path / "n", tiny_gguf, llama, tracker_url=url, tracker_key=service.public_key_text, enrolment_secret=SECRET)
    node_posts: list[str] = []
    mesh.app = seen_by(mesh.app, node_posts)
    async with mesh.running(), httpx.AsyncClient(timeout=10) as http:

        async def routable() -> bool:
            return len(service.registry.routable(MODEL)) == 1

        await wait_until(routable)
        inference_before = [p for p in node_posts if p == CHAT]
        for name, (body, code) in SMUGGLED.items():
            answer = await http.post(url + CHAT, content=body, headers={"content-type": "application/json"})
            assert answer.status_code == 400, (name, answer.text[:200])
            assert answer.json()["error"]["code"] == code, name
        entry = service.registry.get(mesh.node_id)
        assert entry is not None and entry.routed == 0
        assert [p for p in node_posts if p == CHAT] == inference_before == []
        assert await service.ledger.usage_list() == []  # nothing routed, nothing to bill
        assert llama.forwarded() == []
        # The node was there all along: the same request without the smuggled key is served.
        served = await http.post(url + CHAT, content=("{" + M + "," + USER + ',"max_tokens":1}').encode())
        assert served.status_code == 200 and entry.routed == 1
