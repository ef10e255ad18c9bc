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


# --- the relay does not die ---------------------------------------------------------------------------

import json
import subprocess
import sys

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.reference.relay import Relay
from support.relay_harness import attach_message, raw_tunnel, read_answer, running_relay

ATTACKER_ADDRESS = "127.0.0.2"  # another loopback source: the honest client's own quota is untouched


async def test_forty_work_attaches_at_once_park_no_more_than_the_cap() -> None:
    relay = Relay(RelayConfig(port=0, max_idle_work=16))
    throwaway = NodeIdentity.from_private_key(Ed25519PrivateKey.generate())
    async with running_relay(relay) as relay_url:
        control, control_buffered, challenge = await raw_tunnel(relay_url)
        async with control:
            await control.send(attach_message(throwaway, challenge["nonce"]))
            assert (await read_answer(control_buffered))["type"] == "attached"
            opened = [await raw_tunnel(relay_url) for _ in range(40)]
            # Every attach is answered before any says `ready`: all forty pass the early check together.
            for stream, buffered, challenge in opened:
                await stream.send(attach_message(throwaway, challenge["nonce"], role="work"))
            answers = [await read_answer(buffered) for _, buffered, _ in opened]
            for (stream, _, _), answer in zip(opened, answers):
                if answer["type"] == "attached":
                    await stream.send(b'{"type": "ready"}\n')
            await anyio.sleep(0.5)
            assert len(relay.tunnels[throwaway.node_id].idle) <= 16
            for stream, _, _ in opened:
                await stream.aclose()


async def test_half_sent_heads_from_one_address_are_bounded_and_others_are_served(tmp_path: Path) -> None:
    config = RelayConfig(port=0, max_pending_per_peer=16)
    async with mesh(tmp_path, relay_config=config) as m, m.client() as client:
        host, port = m.relay_url.removeprefix("http://").split(":")
        held = []
        try:
            for _ in range(16):
                stream = await anyio.connect_tcp(host, int(port), local_host=ATTACKER_ADDRESS)
                await stream.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
                held.append(stream)
            # The next one from that address is answered (503) and closed at once instead of being held; the
            # close may overtake the answer as a reset, since the stranger's unread bytes are discarded.
            async with await anyio.connect_tcp(host, int(port), local_host=ATTACKER_ADDRESS) as extra:
                await extra.send(b"GET /health HTTP/1.1\r\n")
                with anyio.fail_after(2):
                    try:
                        assert (await extra.receive()).startswith(b"HTTP/1.1 503")
                    except (anyio.BrokenResourceError, anyio.EndOfStream):
                        pass
            with anyio.fail_after(3):
                assert (await client.get(m.node_url + "/health")).status_code == 200
        finally:
            for stream in held:
                await stream.aclose()


_LOW_FD_RELAY = """
import resource, sys, anyio
from meshnet_gguf.reference.relay import Relay, RelayConfig
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))
anyio.run(Relay(RelayConfig(port=int(sys.argv[1]), max_pending_per_peer=100_000, max_pending=100_000)).serve)
"""


async def test_a_relay_out_of_file_descriptors_keeps_running_and_serves_again() -> None:
    port = free_local_port()
    proc = subprocess.Popen([sys.executable, "-c", _LOW_FD_RELAY, str(port), "48"], stderr=subprocess.PIPE)
    held: list[anyio.abc.SocketStream] = []
    try:
        with anyio.fail_after(10):
            while True:
                try:
                    async with await anyio.connect_tcp("127.0.0.1", port):
                        break
                except OSError:
                    await anyio.sleep(0.05)
        # Far more half-open heads than the relay has descriptors: accept() fails with EMFILE.
        for _ in range(120):
            stream = await anyio.connect_tcp("127.0.0.1", port)
            await stream.send(b"GET /health HTTP/1.1\r\n")
            held.append(stream)
        await anyio.sleep(1.0)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        for stream in held:
            await stream.aclose()
        held.clear()
        with anyio.fail_after(15):  # the backlog drains as the relay times the held heads out
            while True:
                async with await anyio.connect_tcp("127.0.0.1", port) as probe:
                    await probe.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    try:
                        with anyio.fail_after(1):
                            answer = await probe.receive()
                    except (TimeoutError, anyio.EndOfStream, OSError):
                        await anyio.sleep(0.1)
                        continue
                if answer.startswith(b"HTTP/1.1 200"):
                    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["status"] == "ok"
                    break
        assert proc.poll() is None
    finally:
        for stream in held:
            await stream.aclose()
        proc.kill()
        proc.wait(10)
