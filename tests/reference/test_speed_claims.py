"""The tracker checks a node's speed claim against the streams it forwards (docs/protocol.md, "Routing
by speed"): real node parts in process in front of the fake llama-server, whose decode rate is set."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshnet_gguf.contract.protocol import NodeCapability, RatePoint
from meshnet_gguf.reference.node_speed import TRUST_AFTER_SAMPLES
from meshnet_gguf.reference.tracker.app import Tracker
from support.mesh_node import MODEL, FakeLlama, MeshNode
from support.mesh_tracker import SECRET, start_tracker, wait_until

pytestmark = pytest.mark.anyio
# The fake llama-server streams 12 tokens 10 ms apart: about 100 tokens/s.
TOKENS, TOKEN_DELAY_S = 12, 0.01
DELIVERED_TOKENS_PER_S = 1 / TOKEN_DELAY_S
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS, "stream": True}


def claiming(decode_tokens_per_s: float) -> NodeCapability:
    return NodeCapability(
        prefill_tokens_per_s=[RatePoint(ctx_tokens=32, tokens_per_s=5_000.0)],
        decode_tokens_per_s=[RatePoint(ctx_tokens=32, tokens_per_s=decode_tokens_per_s)],
    )


@pytest.fixture
async def tracker(tmp_path: Path) -> AsyncIterator[tuple[Tracker, str]]:
    async with start_tracker(tmp_path) as running:
        yield running


async def speed_of(http: httpx.AsyncClient, url: str, node_id: str) -> dict[str, Any]:
    [node] = [n for n in (await http.get(url + "/v1/nodes")).json() if n["node_id"] == node_id]
    return node["speed"]


async def stream_once(http: httpx.AsyncClient, url: str) -> None:
    async with http.stream("POST", url + "/v1/chat/completions", json=BODY) as response:
        assert response.status_code == 200
        async for _ in response.aiter_raw():
            pass


@pytest.mark.parametrize("claim_factor", [10.0, 1.0])
async def test_a_node_claiming_ten_times_its_speed_is_flagged_after_n_streams_an_honest_one_never(
    tracker: tuple[Tracker, str], tmp_path: Path, tiny_gguf: Path, claim_factor: float
) -> None:
    service, url = tracker
    llama = FakeLlama(tmp_path, FAKE_LLAMA_TOKENS=str(TOKENS), FAKE_LLAMA_TOKEN_DELAY_S=str(TOKEN_DELAY_S))
    mesh = MeshNode(tmp_path / "n", tiny_gguf, llama, tracker_url=url, tracker_key=service.public_key_text, enrolment_secret=SECRET)
    mesh.capability = claiming(DELIVERED_TOKENS_PER_S * claim_factor)
    try:
        async with mesh.running(), httpx.AsyncClient(timeout=10) as http:

            async def routable() -> bool:
                nodes = (await http.get(url + "/v1/nodes")).json()
                return bool(nodes) and nodes[0]["healthy"] and nodes[0]["speed"]["claimed_decode_tokens_per_s"] is not None

            await wait_until(routable)
            for i in range(TRUST_AFTER_SAMPLES):
                speed = await speed_of(http, url, mesh.node_id)
                assert speed["measured_streams"] == i and not speed["claim_flagged"], speed
                await stream_once(http, url)
            speed = await speed_of(http, url, mesh.node_id)
            assert speed["measured_streams"] == TRUST_AFTER_SAMPLES and speed["trusted"]
            # Measured by the tracker itself from the content events it forwarded, not from the node's word.
            assert DELIVERED_TOKENS_PER_S / 3 < speed["measured_decode_tokens_per_s"] < DELIVERED_TOKENS_PER_S * 1.5, speed
            assert speed["claim_flagged"] is (claim_factor == 10.0), speed
            page = (await http.get(url + "/dashboard.json")).json()
            assert page["nodes"][0]["speed"]["claim_flagged"] is (claim_factor == 10.0)

            # The node restarts (a new registration): nothing measured before holds for it.
            service.registry.remove(mesh.node_id)  # the tracker forgets it; its next heartbeat registers it again
            await wait_until(lambda: _registered(http, url, mesh.node_id))
            speed = await speed_of(http, url, mesh.node_id)
            assert speed["measured_streams"] == 0 and not speed["trusted"] and not speed["claim_flagged"], speed
    finally:
        llama.close()


async def _registered(http: httpx.AsyncClient, url: str, node_id: str) -> bool:
    return any(n["node_id"] == node_id and n["healthy"] for n in (await http.get(url + "/v1/nodes")).json())
