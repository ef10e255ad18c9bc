"""Strangers at the relay's edge: each test plays an attacker who can reach the relay's port and
checks that a relayed node stays reachable and the relay stays up (docs/protocol.md 9.5, 9.6)."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

import meshnet_gguf.mesh.relay_link as relay_link_module
from meshnet_gguf.reference.relay import RelayConfig
from support.relay_harness import mesh

pytestmark = pytest.mark.anyio


async def _stalled_connect(relay_url: str, node_id: str, extra_headers: str = "") -> anyio.abc.SocketStream:
    """CONNECT to the node, then one byte of a TLS record header and nothing more."""
    host, port = relay_url.removeprefix("http://").split(":")
    stream = await anyio.connect_tcp(host, int(port))
    await stream.send(f"CONNECT {node_id}:443 HTTP/1.1\r\nHost: {node_id}:443\r\n{extra_headers}\r\n".encode())
    head = await stream.receive()
    assert head.startswith(b"HTTP/1.1 200"), head
    await stream.send(b"\x16")
    return stream


async def _closed_within(stream: anyio.abc.SocketStream, seconds: float) -> float:
    started = time.monotonic()
    with anyio.fail_after(seconds):
        try:
            while await stream.receive():
                pass
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            pass
    return time.monotonic() - started


async def test_four_one_byte_connects_do_not_cut_the_node_off(tmp_path: Path) -> None:
    # The node keeps 4 idle work connections; an attacker takes all four with one byte each and stalls.
    async with mesh(tmp_path) as m, m.client() as client:
        await m.wait_attached(idle=4)
        stalled = [await _stalled_connect(m.relay_url, m.identity.node_id) for _ in range(4)]
        try:
            # Well inside every handshake bound: the node has already dialled replacements for the used four.
            with anyio.fail_after(3):
                assert (await client.get(m.node_url + "/health")).status_code == 200
        finally:
            for stream in stalled:
                await stream.aclose()


async def test_the_node_drops_a_work_connection_whose_tls_handshake_stalls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_link_module, "TLS_HANDSHAKE_TIMEOUT_S", 0.5)
    # The relay's own bound set far off, so only the node's can end the stall.
    async with mesh(tmp_path, relay_config=RelayConfig(port=0, handshake_timeout_s=60)) as m:
        stream = await _stalled_connect(m.relay_url, m.identity.node_id)
        async with stream:
            assert await _closed_within(stream, 3) < 3


async def test_the_relay_bounds_a_splice_until_both_sides_have_spoken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_link_module, "TLS_HANDSHAKE_TIMEOUT_S", 60.0)  # only the relay's bound can end it
    async with mesh(tmp_path, relay_config=RelayConfig(port=0, handshake_timeout_s=0.5)) as m:
        stream = await _stalled_connect(m.relay_url, m.identity.node_id)
        async with stream:
            assert await _closed_within(stream, 3) < 3
        with anyio.fail_after(2):
            while m.relay.stats()["streams_active"]:
                await anyio.sleep(0.01)
