"""The tracker's routed requests to a relayed node go through a lean client whose connections are
tunnels (`RelayTunnel`: CONNECT through the relay, then TLS pinned to the node's certificate). Each
trust claim of the httpx path holds here too, and a kept tunnel lives and dies with its target."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.common.http1_client import Http1Client, HttpClientError, HttpConnectError
from meshnet_gguf.contract.node_tls import node_certificate, pinned_client_context
from meshnet_gguf.contract.protocol import NodeAnnouncement, RelayAttachment
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.reference.tracker.node_address import AddressPolicy, pin_node_url
from meshnet_gguf.reference.tracker.relay_dialer import ConnectRefused, NodeDialer, RelayedNodeTarget, RelayTunnel
from meshnet_gguf.reference.tracker.relay_failover import RelayOrder
from support.relay_harness import Mesh, mesh, reading_relay, tampering_relay

pytestmark = pytest.mark.anyio

SECRET_PROMPT = "the lean tunnel carries this only as ciphertext"
CHAT = "/v1/chat/completions"
OPEN_RELAY = "an open relay asks for no token"


def _announcement(identity: NodeIdentity, relay: RelayAttachment) -> NodeAnnouncement:
    return NodeAnnouncement(
        node_id=identity.node_id, public_key=identity.public_key_text, advertised_url=relay.url, model_id="m",
        first_layer=0, last_layer=0, total_layers=1, slots=1, node_version="test", relay=relay,
    )  # fmt: skip


async def _target(m: Mesh, dialer: NodeDialer) -> RelayedNodeTarget:
    target = await dialer.through_relay(_announcement(m.identity, m.link.attachment()), AddressPolicy(allow_loopback=True))
    assert target.client is not None
    return target


async def _post(target: RelayedNodeTarget, body: bytes) -> tuple[int, bytes]:
    assert target.client is not None
    response = await target.client.send("POST", target.forward_url(CHAT), {"content-type": "application/json"}, body)
    try:
        return response.status, await response.read()
    finally:
        await response.aclose()


async def test_routed_requests_reach_a_relayed_node_through_one_kept_tunnel(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m:
        dialer = NodeDialer(httpx.Limits(), lambda relay_url, node_id: OPEN_RELAY)
        target = await _target(m, dialer)
        for n in (3, 5, 1):
            status, body = await _post(target, b'{"n": %d}' % n)
            assert status == 200
            assert body.count(b"data: ") == n + 1 and body.endswith(b"data: [DONE]\n\n")
            assert b": keep-this-comment" in body  # the node's bytes, unchanged
        # A streamed answer leaves the node's connection open, so one tunnel (one CONNECT, one
        # handshake) served all three: what makes the relayed hop as quick as the direct one.
        assert target.client.opened == 1
        assert len(m.app.bodies) == 3
        await dialer.aclose()


async def test_a_reading_relay_sees_only_ciphertext_of_a_lean_tunnel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = bytearray()
    reading_relay(monkeypatch, seen)
    async with mesh(tmp_path) as m:
        dialer = NodeDialer(httpx.Limits(), lambda relay_url, node_id: OPEN_RELAY)
        target = await _target(m, dialer)
        status, body = await _post(target, b'{"n": 3, "prompt": "%s"}' % SECRET_PROMPT.encode())
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        assert SECRET_PROMPT.encode() in m.app.bodies[0]  # the node got it...
        assert len(seen) > 1000
        assert SECRET_PROMPT.encode() not in seen and b"data: 0" not in seen  # ...the relay never saw it
        await dialer.aclose()


async def test_a_tunnel_to_a_node_showing_another_certificate_is_refused_before_the_request_leaves(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m:
        # The tracker pinned a certificate that is not the one the node behind this relay shows
        # (a relay that routes the CONNECT to an impostor looks the same from here).
        impostor = Ed25519PrivateKey.generate()
        relay = await pin_node_url(m.relay_url, AddressPolicy(allow_loopback=True))
        wrong = pinned_client_context(node_certificate(impostor), impostor.public_key())
        client = Http1Client(
            4, peer="node", open_connection=RelayTunnel(RelayOrder([relay]), m.identity.node_id, lambda *_: OPEN_RELAY, wrong, wrong)
        )
        with pytest.raises(HttpConnectError, match="(?i)certificate"):
            await client.send("POST", f"https://{m.identity.node_id}{CHAT}", {}, b'{"n": 1, "prompt": "%s"}' % SECRET_PROMPT.encode())
        assert m.app.bodies == []  # the node's server never got a request
        client.close()


async def test_a_tampering_relay_gets_the_lean_request_refused_not_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tampering_relay(monkeypatch)
    async with mesh(tmp_path) as m:
        dialer = NodeDialer(httpx.Limits(), lambda relay_url, node_id: OPEN_RELAY)
        target = await _target(m, dialer)
        with pytest.raises(HttpClientError):
            await _post(target, b'{"n": 3, "prompt": "%s"}' % SECRET_PROMPT.encode())
        assert all(SECRET_PROMPT.encode() not in body for body in m.app.bodies)
        await dialer.aclose()


async def _fake_relay(answer: bytes | None) -> tuple[asyncio.Server, int, list[bytes]]:
    """A relay that answers every CONNECT with `answer` (None: never answers)."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        if answer is not None:
            writer.write(answer)
            await writer.drain()
        await reader.read()  # until the tracker hangs up
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], heads


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b"HTTP/1.1 407 Proxy Authentication Required\r\ncontent-length: 0\r\n\r\n", "407"),
        (b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n", "502"),
        # A relay that answers for the node: a forged HTTP answer right behind its 200.
        (b"HTTP/1.1 200 OK\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi", "bytes after"),
        (b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"p" * 9000 + b"\r\n\r\n", "too long"),
        (b"", "without an answer"),
        (None, "TimeoutError"),
    ],
)
async def test_a_relay_that_refuses_or_misspeaks_is_a_connect_error(answer: bytes | None, why: str) -> None:
    server, port, heads = await _fake_relay(answer if answer != b"" else None)
    if answer == b"":  # closes at once instead
        server.close()
        await server.wait_closed()

        async def slam(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.close()

        server = await asyncio.start_server(slam, "127.0.0.1", port)
    relay = await pin_node_url(f"http://127.0.0.1:{port}", AddressPolicy(allow_loopback=True))
    node = NodeIdentity.from_private_key(Ed25519PrivateKey.generate())
    pinned = pinned_client_context(node_certificate(node.private_key), node.private_key.public_key())
    tunnel = RelayTunnel(RelayOrder([relay]), node.node_id, lambda relay_url, node_id: "token-for-" + node_id, pinned, pinned)
    client = Http1Client(1, peer="node", open_connection=tunnel, connect_timeout_s=0.5)
    try:
        with anyio.fail_after(5), pytest.raises(HttpConnectError, match=why) as refused:
            await client.send("POST", f"https://{node.node_id}{CHAT}", {}, b"{}")
        if answer is not None and answer.startswith(b"HTTP/1.1 200 OK\r\n\r\n"):
            assert isinstance(refused.value, ConnectRefused)
        if heads:  # what the relay was asked: this node, with the tracker's token
            assert heads[0].startswith(f"CONNECT {node.node_id}:443 HTTP/1.1\r\n".encode())
            assert f"Proxy-Authorization: Bearer token-for-{node.node_id}".encode() in heads[0]
    finally:
        client.close()
        server.close()
        await server.wait_closed()


async def test_a_forgotten_target_closes_its_kept_tunnels_and_lets_a_running_answer_finish(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m:
        dialer = NodeDialer(httpx.Limits(), lambda relay_url, node_id: OPEN_RELAY)
        first = await _target(m, dialer)
        assert first.client is not None
        dialer.adopt(first)
        assert (await _post(first, b'{"n": 1}'))[0] == 200  # one tunnel, kept
        running = await first.client.send("POST", first.forward_url(CHAT), {}, b'{"n": 6, "delay": 0.05}')
        # The node misses its heartbeats and is dropped: its way in is retired.
        await dialer.forget_all_but([])
        assert dialer.held() == (0, 0)  # its httpx transport held nothing, so it is closed at once
        with anyio.fail_after(5):
            body = await running.read()  # the answer under way finishes on its tunnel...
        await running.aclose()
        assert body.endswith(b"data: [DONE]\n\n")
        with pytest.raises(HttpConnectError, match="closed"):  # ...and the retired client opens no more
            await first.client.send("POST", first.forward_url(CHAT), {}, b'{"n": 1}')
        with anyio.fail_after(5):  # neither of its two tunnels is left open at the relay
            while m.relay.stats()["streams_active"]:
                await anyio.sleep(0.02)
        await dialer.aclose()
