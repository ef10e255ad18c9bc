"""The relay and the node's tunnel, in process on loopback: attach proofs, splicing, TLS pinned to the
node identity, and the faults a relay must survive (bad peers, slow readers, dead or restarted tunnels)."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import httpx
import pytest
from support.relay_harness import mesh, read_events, reading_relay, tampering_relay

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


# --- who may attach ---------------------------------------------------------------------------

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from support.relay_harness import attach_message, raw_tunnel, read_answer, running_relay

from meshnet_gguf.mesh.identity import NODE_KEY_FILE, NodeIdentity
from meshnet_gguf.reference.relay.config import RelayConfig
from meshnet_gguf.reference.relay.server import Relay


async def _connect_status(relay_url: str, node_id: str) -> int:
    host, port = relay_url.removeprefix("http://").split(":")
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(f"CONNECT {node_id}:443 HTTP/1.1\r\nHost: {node_id}:443\r\n\r\n".encode())
        head = await stream.receive()
    return int(head.split(b" ")[1])


async def test_a_node_with_a_wrong_or_foreign_key_is_refused_and_never_exposed(tmp_path: Path) -> None:
    victim = NodeIdentity.from_private_key(Ed25519PrivateKey.generate())
    attacker = NodeIdentity.from_private_key(Ed25519PrivateKey.generate())
    relay = Relay(RelayConfig(port=0))
    async with running_relay(relay) as relay_url:
        cases = {
            # the victim's id with the attacker's own key
            "node_id_mismatch": lambda nonce: attach_message(attacker, nonce, to=relay_url, node_id=victim.node_id),
            # the victim's id and public key, but signed by the attacker
            "bad_proof": lambda nonce: attach_message(victim, nonce, to=relay_url, signer=attacker.private_key),
        }
        for code, forge in cases.items():
            stream, buffered, challenge = await raw_tunnel(relay_url)
            async with stream:
                await stream.send(forge(challenge["nonce"]))
                answer = await read_answer(buffered)
            assert answer["type"] == "refused" and answer["code"] == code, answer
        # A genuine proof for one connection does not open another (the nonce is per connection).
        stream, buffered, challenge = await raw_tunnel(relay_url)
        async with stream:
            await stream.send(attach_message(victim, "a-nonce-from-an-earlier-connection", to=relay_url))
            assert (await read_answer(buffered))["code"] == "bad_proof"
        assert victim.node_id not in relay.tunnels
        assert await _connect_status(relay_url, victim.node_id) == 404


async def test_a_second_tunnel_replaces_the_first_only_with_the_same_key(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m, m.client() as client:
        first = m.relay.tunnels[m.identity.node_id]
        stranger = NodeIdentity.from_private_key(Ed25519PrivateKey.generate())
        stream, buffered, challenge = await raw_tunnel(m.relay_url)
        async with stream:
            await stream.send(
                attach_message(
                    m.identity, challenge["nonce"], to=m.relay_url, public_key=stranger.public_key_text, signer=stranger.private_key
                )
            )
            assert (await read_answer(buffered))["type"] == "refused"
        assert m.relay.tunnels[m.identity.node_id] is first  # untouched
        # The same key on a new control connection takes over; the node notices and attaches again.
        connects = m.link.connects
        stream, buffered, challenge = await raw_tunnel(m.relay_url)
        async with stream:
            await stream.send(attach_message(m.identity, challenge["nonce"], to=m.relay_url))
            assert (await read_answer(buffered))["type"] == "attached"
            assert m.relay.tunnels[m.identity.node_id] is not first
        with anyio.fail_after(5):
            while m.link.connects == connects:
                await anyio.sleep(0.02)
        await m.wait_attached()
        assert (await client.get(m.node_url + "/health")).status_code == 200


async def test_garbage_oversize_messages_and_heads_are_refused_while_others_are_served(tmp_path: Path) -> None:
    from meshnet_gguf.contract.relay_wire import MAX_RELAY_HEAD_BYTES, MAX_RELAY_MESSAGE_BYTES

    async with mesh(tmp_path) as m, m.client() as client:
        stream, buffered, _ = await raw_tunnel(m.relay_url)
        async with stream:
            await stream.send(b"\x00\xffnot json at all\n")
            assert (await read_answer(buffered))["code"] == "bad_message"
        stream, buffered, _ = await raw_tunnel(m.relay_url)
        async with stream:
            await stream.send(b"{" + b" " * (MAX_RELAY_MESSAGE_BYTES + 10))
            assert (await read_answer(buffered))["code"] == "message_too_large"
        host, port = m.relay_url.removeprefix("http://").split(":")
        async with await anyio.connect_tcp(host, int(port)) as raw:
            await raw.send(b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * (MAX_RELAY_HEAD_BYTES + 10))
            assert (await raw.receive()).startswith(b"HTTP/1.1 431")
        async with await anyio.connect_tcp(host, int(port)) as raw:
            await raw.send(b"\x16\x03\x01 this is no HTTP\r\n\r\n")
            assert (await raw.receive()).startswith(b"HTTP/1.1 400")
        # None of that disturbed the attached node.
        async with client.stream("POST", m.node_url + "/v1/chat/completions", json={"n": 3}) as response:
            assert await read_events(response) == ["0", "1", "2", "[DONE]"]
        assert m.relay.stats()["tunnels"] == 1


# --- streams -------------------------------------------------------------------------------------


async def test_64_concurrent_streams_through_one_tunnel_each_in_order(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m, m.client(limits=httpx.Limits(max_connections=100)) as client:
        results: dict[int, list[str]] = {}

        async def one(i: int) -> None:
            async with client.stream("POST", m.node_url + "/v1/chat/completions", json={"n": 30, "delay": 0.005}) as response:
                assert response.status_code == 200
                results[i] = await read_events(response)

        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(one, i)
        assert len(results) == 64
        assert all(events == [str(k) for k in range(30)] + ["[DONE]"] for events in results.values())
        assert m.relay.stats()["streams_total"] >= 64


async def test_a_slow_reader_stalls_only_its_own_stream(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m, m.client() as client, m.client() as other:
        # ~40 MB the reader never reads: far beyond every socket buffer on the way.
        request = client.build_request("POST", m.node_url + "/v1/chat/completions", json={"n": 40_000, "pad": 1000})
        stuck = await client.send(request, stream=True)
        try:
            with anyio.fail_after(10):
                for _ in range(5):
                    async with other.stream("POST", m.node_url + "/v1/chat/completions", json={"n": 50}) as response:
                        assert len(await read_events(response)) == 51
            assert m.app.active == 1  # the stuck stream is still being written, held back by its reader
        finally:
            await stuck.aclose()


async def test_a_client_that_goes_away_closes_the_nodes_local_request(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m, m.client() as client:
        async with client.stream("POST", m.node_url + "/v1/chat/completions", json={"n": 1000, "delay": 0.01}) as response:
            async for line in response.aiter_lines():
                if line == "data: 3":
                    break
        # The node's own HTTP server sees the disconnect: that is what frees llama-server's slot.
        with anyio.fail_after(2):
            while m.app.disconnects < 1 or m.app.active:
                await anyio.sleep(0.01)


# --- a relay that dies, restarts or goes silent ----------------------------------------------------

from support.relay_harness import StreamApp, serve_asgi

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.mesh.relay_link import build_relay_link, local_address_for


async def test_killed_mid_stream_the_client_fails_fast_and_a_restarted_relay_serves_within_5_s(tmp_path: Path) -> None:
    app, app_port, relay_port = StreamApp(), free_local_port(), free_local_port()
    relay_url = f"http://127.0.0.1:{relay_port}"
    async with serve_asgi(app, app_port), anyio.create_task_group() as outer:
        link = build_relay_link(
            relay_url, NodeIdentity.load_or_create(tmp_path / "node"), tmp_path / "node", local_address_for("127.0.0.1", app_port)
        )
        relay = Relay(RelayConfig(port=relay_port))
        relay_scope = anyio.CancelScope()

        async def run_relay(relay: Relay, scope: anyio.CancelScope) -> None:
            with scope:
                await relay.serve()

        outer.start_soon(run_relay, relay, relay_scope)
        outer.start_soon(link.run)
        with anyio.fail_after(5):
            while link.link_health().idle_work < 1:
                await anyio.sleep(0.01)
        from support.relay_harness import Mesh

        m = Mesh(relay, relay_url, link, app, app_port, link.identity)
        async with m.client() as client:
            async with client.stream("POST", m.node_url + "/v1/chat/completions", json={"n": 10_000, "delay": 0.01}) as response:
                seen = 0
                with pytest.raises(httpx.TransportError):
                    with anyio.fail_after(10):
                        async for line in response.aiter_lines():
                            seen += line.startswith("data: ")
                            if seen == 5:
                                killed_at = time.monotonic()
                                relay_scope.cancel()  # the relay process dies: every socket it held closes
                assert time.monotonic() - killed_at < 2.0
            # Back up on the same port, as a restarted relay would be.
            restarted_at = time.monotonic()
            restarted = Relay(RelayConfig(port=relay_port))
            outer.start_soon(run_relay, restarted, anyio.CancelScope())
            with anyio.fail_after(5):
                while True:
                    try:
                        async with client.stream("POST", m.node_url + "/v1/chat/completions", json={"n": 3}) as response:
                            assert await read_events(response) == ["0", "1", "2", "[DONE]"]
                            break
                    except httpx.TransportError:
                        await anyio.sleep(0.05)
            assert time.monotonic() - restarted_at < 5.0
            assert link.connects == 2
        await link.drain()
        await link.close()
        outer.cancel_scope.cancel()


class _SilentRelay(Relay):
    """Accepts the control connection, then never answers a ping (a relay wedged or cut off)."""

    async def _control_loop(self, stream, buffered):  # type: ignore[no-untyped-def]
        await anyio.sleep_forever()


async def test_a_silent_relay_is_detected_within_one_ping_interval(tmp_path: Path) -> None:
    relay = _SilentRelay(RelayConfig(port=0, ping_interval_s=0.3, ping_timeout_s=0.3))
    async with mesh(tmp_path, relay=relay) as m:
        connects = m.link.connects
        with anyio.fail_after(0.3 + 0.3 + 1.0):
            while m.link.connects == connects:
                await anyio.sleep(0.01)
        assert "TimeoutError" in (m.link.last_error or "") or m.link.connects > connects


# --- the relay can neither read nor change what it carries ------------------------------------------

from meshnet_gguf.contract.node_tls import node_certificate, pinned_client_context

SECRET_PROMPT = "the-plaintext-prompt-7f3a9c"


async def test_the_tracker_trusts_only_the_registered_node_certificate(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m:
        impostor = Ed25519PrivateKey.generate()
        # A certificate made with another key is refused when the tracker pins it...
        with pytest.raises(ValueError):
            pinned_client_context(node_certificate(impostor), m.identity.public_key)
        # ...and a client pinned to another node's certificate cannot complete the handshake with this node.
        wrong = pinned_client_context(node_certificate(impostor), impostor.public_key())
        async with httpx.AsyncClient(proxy=m.relay_url, verify=wrong, trust_env=False) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(m.node_url + "/health")
        assert m.app.bodies == []


async def test_a_reading_relay_sees_only_ciphertext(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = bytearray()
    reading_relay(monkeypatch, seen)
    async with mesh(tmp_path) as m, m.client() as client:
        async with client.stream("POST", m.node_url + "/v1/chat/completions", json={"n": 3, "prompt": SECRET_PROMPT}) as response:
            assert await read_events(response) == ["0", "1", "2", "[DONE]"]
    assert SECRET_PROMPT.encode() in m.app.bodies[0]  # the node got it...
    assert len(seen) > 1000
    assert SECRET_PROMPT.encode() not in seen  # ...the relay carried it without seeing it
    assert b"data: 0" not in seen and b"keep-this-comment" not in seen


async def test_a_tampering_relay_gets_the_request_refused_not_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tampering_relay(monkeypatch)
    async with mesh(tmp_path) as m, m.client() as client:
        with pytest.raises(httpx.TransportError):
            await client.post(m.node_url + "/v1/chat/completions", json={"n": 3, "prompt": SECRET_PROMPT})
    # TLS dropped the altered record: what the node's HTTP server got (at most the untouched head) never
    # includes the request body the relay changed, and the request failed instead of running altered.
    assert all(SECRET_PROMPT.encode() not in body for body in m.app.bodies)


# --- what operators see ------------------------------------------------------------------------------

from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError

from meshnet_gguf.cli.doctor import doctor_identity
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import HealthReport
from meshnet_gguf.doctor.checks import Finding
from meshnet_gguf.doctor.relay import check_relay
from meshnet_gguf.ops.relay_metrics import RelayLinkCollector


async def test_link_state_in_health_metrics_and_doctor(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m:
        report = m.link.health(HealthReport(state="ready"))
        assert report.relay is not None and report.relay.state == "attached" and report.relay.connects == 1
        registry = CollectorRegistry()
        registry.register(RelayLinkCollector([m.link]))
        text = generate_latest(registry).decode()
        assert f'meshnet_relay_attached{{relay="{m.relay_url}"}} 1.0' in text
        assert "meshnet_relay_idle_work_connections" in text

        def doctor(settings: NodeSettings) -> list[Finding]:
            return check_relay(settings, doctor_identity(settings))  # as `meshnet-gguf doctor` runs it

        up = await anyio.to_thread.run_sync(doctor, NodeSettings(relay_url=m.relay_url, state_dir=tmp_path / "node"))
        assert up[0].status == "ok" and "tunnel is up" in up[0].summary
        other = await anyio.to_thread.run_sync(doctor, NodeSettings(relay_url=m.relay_url, state_dir=tmp_path / "other"))
        assert other[0].status == "ok" and "no tunnel now" in other[0].summary
        assert not (tmp_path / "other" / NODE_KEY_FILE).exists()  # doctor only reads: it never creates a key
        assert m.relay.tunnels[m.identity.node_id] is not None  # the probe left the node's tunnel alone
        # Two relays (protocol 9.7): each is checked, so the one that fails is named while the other works.
        gone = f"http://127.0.0.1:{free_local_port()}"
        both = await anyio.to_thread.run_sync(doctor, NodeSettings(relay_url=[m.relay_url, gone], state_dir=tmp_path / "node"))
        assert [f.status for f in both] == ["ok", "fail"] and gone in both[1].summary
    dead = await anyio.to_thread.run_sync(doctor, NodeSettings(relay_url=f"http://127.0.0.1:{free_local_port()}", state_dir=tmp_path / "x"))
    assert dead[0].status == "fail"
    assert (await anyio.to_thread.run_sync(doctor, NodeSettings(state_dir=tmp_path / "x")))[0].status == "skip"


async def test_garbage_on_a_live_control_connection_drops_only_that_tunnel(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m, m.client() as client:
        other = NodeIdentity.from_private_key(Ed25519PrivateKey.generate())
        stream, buffered, challenge = await raw_tunnel(m.relay_url)
        async with stream:
            await stream.send(attach_message(other, challenge["nonce"], to=m.relay_url))
            assert (await read_answer(buffered))["type"] == "attached"
            assert other.node_id in m.relay.tunnels
            await stream.send(b"\x00garbage that is no ping\n")
            assert (await read_answer(buffered))["code"] == "bad_message"
        with anyio.fail_after(2):
            while other.node_id in m.relay.tunnels:
                await anyio.sleep(0.01)
        async with client.stream("POST", m.node_url + "/v1/chat/completions", json={"n": 2}) as response:
            assert await read_events(response) == ["0", "1", "[DONE]"]


def test_the_relay_url_comes_from_flag_env_or_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshnet_gguf.cli.serve import settings_from_flags

    # One relay as before; two (protocol 9.7) as the flag repeated, a comma-separated variable or a TOML list.
    assert settings_from_flags(relay_url=["http://flag:1"]).relay_url == ["http://flag:1"]
    assert settings_from_flags(relay_url=["http://flag:1", "http://flag:2"]).relay_url == ["http://flag:1", "http://flag:2"]
    monkeypatch.setenv("MESHNET_RELAY_URL", "http://env:2")
    assert NodeSettings().relay_url == ["http://env:2"]
    monkeypatch.setenv("MESHNET_RELAY_URL", "http://env:2, http://env:3")
    assert NodeSettings().relay_url == ["http://env:2", "http://env:3"]
    monkeypatch.delenv("MESHNET_RELAY_URL")
    config = tmp_path / "node.toml"
    config.write_text('relay_url = "http://file:3"\n')
    monkeypatch.setenv("MESHNET_CONFIG", str(config))
    assert NodeSettings().relay_url == ["http://file:3"]
    config.write_text('relay_url = ["http://file:3", "http://file:4"]\n')
    assert NodeSettings().relay_url == ["http://file:3", "http://file:4"]
    # A relay keeps one tunnel per node: the same relay twice would have the two replace each other for ever.
    with pytest.raises(ValidationError, match="named twice"):
        settings_from_flags(relay_url=["http://flag:1", "http://FLAG:1/"])


async def test_a_connect_that_never_starts_tls_releases_the_nodes_connection(tmp_path: Path) -> None:
    async with mesh(tmp_path, relay_config=RelayConfig(port=0, handshake_timeout_s=0.5)) as m, m.client() as client:
        host, port = m.relay_url.removeprefix("http://").split(":")
        async with await anyio.connect_tcp(host, int(port)) as silent:
            await silent.send(f"CONNECT {m.identity.node_id}:443 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert (await silent.receive()).startswith(b"HTTP/1.1 200")
            with anyio.fail_after(3):  # the relay gives up on the silent client and closes it
                with pytest.raises(anyio.EndOfStream):
                    await silent.receive()
        with anyio.fail_after(1):
            while m.relay.stats()["streams_active"]:
                await anyio.sleep(0.01)
        assert (await client.get(m.node_url + "/health")).status_code == 200


# --- the tracker's side: its transport reaches a relayed node only with the registered certificate ----

from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.node_tls import certificate_text
from meshnet_gguf.contract.protocol import NodeAnnouncement, RelayAttachment
from meshnet_gguf.reference.tracker.node_address import AddressPolicy
from meshnet_gguf.reference.tracker.relay_dialer import NodeDialer


def _announcement(identity: NodeIdentity, relay: RelayAttachment) -> NodeAnnouncement:
    return NodeAnnouncement(
        node_id=identity.node_id, public_key=identity.public_key_text, advertised_url=relay.url, model_id="m",
        first_layer=0, last_layer=0, total_layers=1, slots=1, node_version="test", relay=relay,
    )  # fmt: skip


async def test_the_tracker_transport_reaches_a_relayed_node_and_refuses_a_foreign_certificate(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m:
        dialer = NodeDialer(httpx.Limits(), lambda relay_url, node_id: "an open relay asks for no token")
        async with httpx.AsyncClient(transport=dialer, trust_env=False, timeout=10) as http:
            policy = AddressPolicy(allow_loopback=True)
            target = await dialer.through_relay(_announcement(m.identity, m.link.attachment()), policy)
            response = await http.send(target.request(http, "GET", "/health"))
            assert response.json() == {"status": "ok"}
            assert target.endpoint != (await dialer.through_relay(
                _announcement(stranger := NodeIdentity.from_private_key(Ed25519PrivateKey.generate()),
                              RelayAttachment(url=m.relay_url, tls_certificate=certificate_text(node_certificate(stranger.private_key)))),
                policy,
            )).endpoint  # two nodes on one relay are two endpoints  # fmt: skip

            # A registration whose certificate carries another key is refused, and nothing is dialled.
            impostor = Ed25519PrivateKey.generate()
            forged = RelayAttachment(url=m.relay_url, tls_certificate=certificate_text(node_certificate(impostor)))
            with pytest.raises(ApiError) as refused:
                await dialer.through_relay(_announcement(m.identity, forged), policy)
            assert refused.value.code == "bad_relay_certificate"
            # A relay at an address the tracker's policy forbids is refused like a node's URL would be.
            with pytest.raises(ApiError) as unsafe:
                await dialer.through_relay(_announcement(m.identity, m.link.attachment()), AddressPolicy(allow_loopback=False))
            assert unsafe.value.code == "unsafe_relay_url"
