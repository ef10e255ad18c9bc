"""The tracker checks a node's speed claim against the streams it forwards (docs/protocol.md, "Routing
by speed"): real node parts in process in front of the fake llama-server, whose decode rate is set."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshnet_gguf.contract.protocol import NodeCapability, RatePoint
from meshnet_gguf.reference.tracker.market import RECENT_REQUESTS, REMEASURE_AFTER_REQUESTS, UNMEASURED_CREDIT_CAP, UNMEASURED_SHARE
from meshnet_gguf.reference.tracker.node_speed import TRUST_AFTER_SAMPLES
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


# --- the liar, played against a real tracker ---------------------------------------------------

# The honest nodes answer at once; the liar takes this long to its first token (a slower box) and
# claims 1,000x the rates it delivers.
LIAR_FIRST_TOKEN_S = 0.1
# The honest nodes are both measured (trusted) within this many requests: with no claim, the first one's few streams
# may rank it first alone, and the other is then measured by the unmeasured share (one request in five).
WARM_WITHIN = 2 * TRUST_AFTER_SAMPLES + int(TRUST_AFTER_SAMPLES / UNMEASURED_SHARE)
# The liar's fifth stream is due within this many requests (one in 1/UNMEASURED_SHARE, none banked when it joins),
# and one more: the check may come a moment before the tracker has timed the last stream.
FLAGGED_WITHIN = int(TRUST_AFTER_SAMPLES / UNMEASURED_SHARE) + 1
AFTER_FLAG_REQUESTS = 2 * REMEASURE_AFTER_REQUESTS


async def served_by(http: httpx.AsyncClient, url: str) -> str:
    """One streamed request, read to its end; the node the tracker billed it to."""
    async with http.stream("POST", url + "/v1/chat/completions", json=BODY) as response:
        assert response.status_code == 200
        async for _ in response.aiter_raw():
            pass
        request_id = response.headers["x-meshnet-request-id"]
    return str((await http.get(f"{url}/v1/usage/{request_id}")).json()["node_id"])


async def test_a_liar_claiming_a_thousand_times_its_speed_gets_the_unmeasured_share_at_most_then_is_flagged_and_ranked_by_what_it_delivered(
    tracker: tuple[Tracker, str], tmp_path: Path, tiny_gguf: Path
) -> None:
    """The attacker: a slow node that claims 1,000x what it delivers joins two measured honest nodes. Before
    the fair market it drew its first request (its claim beat every measured node), then none (its TTFT did not),
    so its claim was never flagged."""
    service, url = tracker
    honest_llama = FakeLlama(tmp_path, FAKE_LLAMA_TOKENS=str(TOKENS), FAKE_LLAMA_TOKEN_DELAY_S="0.002")
    liar_llama = FakeLlama(
        tmp_path, FAKE_LLAMA_TOKENS=str(TOKENS), FAKE_LLAMA_TOKEN_DELAY_S="0.002", FAKE_LLAMA_FIRST_TOKEN_DELAY_S=str(LIAR_FIRST_TOKEN_S)
    )
    honest = [
        MeshNode(tmp_path / name, tiny_gguf, honest_llama, tracker_url=url, tracker_key=service.public_key_text, enrolment_secret=SECRET)
        for name in ("a", "b")
    ]
    liar = MeshNode(tmp_path / "liar", tiny_gguf, liar_llama, tracker_url=url, tracker_key=service.public_key_text, enrolment_secret=SECRET)
    liar.capability = NodeCapability(
        prefill_tokens_per_s=[RatePoint(ctx_tokens=32, tokens_per_s=32 / LIAR_FIRST_TOKEN_S * 1000)],
        decode_tokens_per_s=[RatePoint(ctx_tokens=32, tokens_per_s=500.0 * 1000)],
    )
    try:
        async with honest[0].running(), honest[1].running(), httpx.AsyncClient(timeout=10) as http:
            await wait_until(lambda: _healthy(http, url, {n.node_id for n in honest}))
            warm = 0
            while not all([(await speed_of(http, url, n.node_id))["trusted"] for n in honest]):
                assert warm < WARM_WITHIN, f"the honest nodes were not both measured within {WARM_WITHIN} requests"
                await served_by(http, url)
                warm += 1

            async with liar.running():
                await wait_until(lambda: _healthy(http, url, {liar.node_id}))
                served: list[str] = []
                while not (await speed_of(http, url, liar.node_id))["claim_flagged"]:
                    assert len(served) < FLAGGED_WITHIN, f"the liar's claim was not flagged within {FLAGGED_WITHIN} requests: {served}"
                    served.append(await served_by(http, url))
                    assert served.count(liar.node_id) <= UNMEASURED_CREDIT_CAP + UNMEASURED_SHARE * len(served), served
                speed = await speed_of(http, url, liar.node_id)
                assert speed["measured_streams"] == TRUST_AFTER_SAMPLES and speed["trusted"], speed
                # Ranked by what it delivered (a first token 0.1 s late): only measured again now and then.
                after = [await served_by(http, url) for _ in range(AFTER_FLAG_REQUESTS)]
                assert after.count(liar.node_id) <= AFTER_FLAG_REQUESTS / REMEASURE_AFTER_REQUESTS, after
                # /v1/nodes says what each got: its share of the last requests and its billed receipts.
                nodes = {n["node_id"]: n for n in (await http.get(url + "/v1/nodes")).json()}
                shares = {node_id: n["recent_share"] for node_id, n in nodes.items()}
                total = warm + len(served) + AFTER_FLAG_REQUESTS
                assert all(s["of_last"] == min(total, RECENT_REQUESTS) for s in shares.values()), shares
                assert shares[liar.node_id]["requests"] == served.count(liar.node_id) + after.count(liar.node_id), shares

                async def billed() -> bool:
                    earned = [n["earned"] for n in (await http.get(url + "/v1/nodes")).json()]
                    return sum(e["requests"] for e in earned) == total and all(e["completion_tokens"] > 0 for e in earned)

                await wait_until(billed)
    finally:
        honest_llama.close()
        liar_llama.close()


async def _healthy(http: httpx.AsyncClient, url: str, node_ids: set[str]) -> bool:
    found = {n["node_id"] for n in (await http.get(url + "/v1/nodes")).json() if n["healthy"]}
    return node_ids <= found
