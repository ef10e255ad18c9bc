"""The relay and the node's tunnel, in process on loopback: attach proofs, splicing, TLS pinned to the
node identity, and the faults a relay must survive (bad peers, slow readers, dead or restarted tunnels)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from relay_harness import mesh, read_events  # noqa: E402

pytestmark = pytest.mark.anyio


async def test_streams_and_plain_answers_pass_through_the_relay_unchanged(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m, m.client() as client:
        async with client.stream("POST", m.node_url + "/v1/chat/completions", json={"n": 20}) as response:
            assert response.status_code == 200
            raw = b"".join([chunk async for chunk in response.aiter_raw()])
        assert raw.startswith(b": keep-this-comment\n\n")
        assert raw.endswith(b"data: [DONE]\n\n")
        assert [line for line in raw.split(b"\n\n") if line.startswith(b"data: ")][:-1] == [f"data: {i}".encode() for i in range(20)]
        health = await client.get(m.node_url + "/health")
        assert health.json() == {"status": "ok"}
        assert m.link.link_health().streams_total >= 1
