"""How the tracker settles a forward's outcome when its client leaves right after the answer's end.

The openai SDK closes its connection as soon as it has read `data: [DONE]`, before the chunked
body's end arrives. A node whose stream closes a moment after its [DONE] (llama-server finishing a
slot under load; here the fake's FAKE_LLAMA_HOLD_AFTER_DONE_S) left the tracker still reading when
that close came, and the README's SDK snippet through `dev mesh` was recorded `cancelled (200)`
although the client had the whole answer. An answer whose terminal event was forwarded is complete.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from meshnet_gguf.contract.protocol import REQUEST_ID_HEADER
from meshnet_gguf.reference.tracker.app import Tracker
from support.mesh_node import MODEL, FakeLlama, MeshNode
from support.mesh_tracker import SECRET, models, start_tracker, wait_until

pytestmark = pytest.mark.anyio

# Long enough that the client's close always lands while the node's stream is still open.
HOLD_AFTER_DONE_S = "1.0"
TOKENS = 5


@pytest.fixture
async def tracker(tmp_path: Path) -> AsyncIterator[tuple[Tracker, str]]:
    async with start_tracker(tmp_path) as running:
        yield running


async def _usage(http: httpx.AsyncClient, url: str, rid: str) -> dict:  # type: ignore[type-arg]
    response = await http.get(f"{url}/v1/usage/{rid}")
    return response.json() if response.status_code == 200 else {}


async def _read_to_done_and_close(http: httpx.AsyncClient, url: str, body: dict) -> tuple[str, list[str]]:  # type: ignore[type-arg]
    """As the openai SDK does: read events up to `data: [DONE]`, then close the connection at once."""
    lines: list[str] = []
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        rid = response.headers[REQUEST_ID_HEADER]
        async for line in response.aiter_lines():
            lines.append(line)
            if line == "data: [DONE]":
                break
    return rid, lines


async def test_a_client_that_closes_right_after_done_gets_a_complete_outcome(tracker, tmp_path: Path, tiny_gguf: Path) -> None:  # type: ignore[no-untyped-def]
    service, url = tracker
    llama = FakeLlama(tmp_path, FAKE_LLAMA_TOKENS=str(TOKENS), FAKE_LLAMA_HOLD_AFTER_DONE_S=HOLD_AFTER_DONE_S)
    node = MeshNode(
        tmp_path / "node", tiny_gguf, llama, tracker_url=url, tracker_key=service.public_key_text, enrolment_secret=SECRET
    )  # fmt: skip
    try:
        async with node.running(), httpx.AsyncClient(timeout=10) as http:
            await wait_until(lambda: _listed(http, url))
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS, "stream": True}
            rid, lines = await _read_to_done_and_close(http, url, body)
            assert lines[-1] == "data: [DONE]" and sum('"content":"x"' in line for line in lines) == TOKENS

            async def settled() -> bool:
                usage = await _usage(http, url, rid)
                return usage.get("outcome") not in (None, "in_flight") and usage.get("node") is not None

            await wait_until(settled)
            usage = await _usage(http, url, rid)
            # Before the fix: "cancelled", decided by which came first, the client's close or the node's end.
            assert (usage["outcome"], usage["status"]) == ("complete", 200)
            assert usage["node_finish_reason"] == "length" and usage["tracker"]["completion_tokens"] == TOKENS
            assert usage["billed"]["completion_tokens"] == TOKENS and usage["flagged"] is False
    finally:
        llama.close()


async def test_a_client_that_leaves_before_done_is_still_cancelled(tracker, tmp_path: Path, tiny_gguf: Path) -> None:  # type: ignore[no-untyped-def]
    service, url = tracker
    llama = FakeLlama(tmp_path, FAKE_LLAMA_TOKENS="40", FAKE_LLAMA_TOKEN_DELAY_S="0.05")
    node = MeshNode(
        tmp_path / "node", tiny_gguf, llama, tracker_url=url, tracker_key=service.public_key_text, enrolment_secret=SECRET
    )  # fmt: skip
    try:
        async with node.running(), httpx.AsyncClient(timeout=10) as http:
            await wait_until(lambda: _listed(http, url))
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                rid = response.headers[REQUEST_ID_HEADER]
                async for line in response.aiter_lines():
                    if '"content":"x"' in line:
                        break

            async def settled() -> bool:
                return (await _usage(http, url, rid)).get("outcome") not in (None, "in_flight")

            await wait_until(settled)
            assert (await _usage(http, url, rid))["outcome"] == "cancelled"
    finally:
        llama.close()


async def _listed(http: httpx.AsyncClient, url: str) -> bool:
    return await models(http, url) == [MODEL]
