"""Strangers at the relay's edge: each test plays an attacker who can reach the relay's port and
checks that a relayed node stays reachable and the relay stays up (docs/protocol.md 9.5, 9.6)."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
from support.relay_harness import mesh

import meshnet_gguf.mesh.relay_link as relay_link_module
from meshnet_gguf.reference.relay.config import RelayConfig

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
from support.relay_harness import attach_message, raw_tunnel, read_answer, running_relay

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.reference.relay.server import Relay

ATTACKER_ADDRESS = "127.0.0.2"  # another loopback source: the honest client's own quota is untouched


async def test_forty_work_attaches_at_once_park_no_more_than_the_cap() -> None:
    relay = Relay(RelayConfig(port=0, max_idle_work=16))
    throwaway = NodeIdentity.from_private_key(Ed25519PrivateKey.generate())
    async with running_relay(relay) as relay_url:
        control, control_buffered, challenge = await raw_tunnel(relay_url)
        async with control:
            await control.send(attach_message(throwaway, challenge["nonce"], to=relay_url))
            assert (await read_answer(control_buffered))["type"] == "attached"
            opened = [await raw_tunnel(relay_url) for _ in range(40)]
            # Every attach is answered before any says `ready`: all forty pass the early check together.
            for stream, buffered, challenge in opened:
                await stream.send(attach_message(throwaway, challenge["nonce"], to=relay_url, role="work"))
            answers = [await read_answer(buffered) for _, buffered, _ in opened]
            for (stream, _, _), answer in zip(opened, answers):
                if answer["type"] == "attached":
                    await stream.send(b'{"type": "ready"}\n')
            await anyio.sleep(0.5)
            assert len(relay.tunnels[throwaway.node_id].idle) <= 16
            for stream, _, _ in opened:
                await stream.aclose()


async def test_half_sent_heads_from_one_address_are_bounded_and_others_are_served(tmp_path: Path) -> None:
    config = RelayConfig(port=0, max_pending_per_network=16)
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
from meshnet_gguf.reference.relay.server import Relay
from meshnet_gguf.reference.relay.config import RelayConfig
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))
anyio.run(Relay(RelayConfig(port=int(sys.argv[1]), max_pending_per_network=100_000, max_pending=100_000,
                            stranger_connection_burst=100_000)).serve)
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


# --- CONNECT is authorised; tunnels are admitted by a tracker ----------------------------------------

import httpx
from support.relay_harness import answer_from, connect_signer, forged_connect, tunnel_announcement

from meshnet_gguf.common.http1_client import HttpConnectError
from meshnet_gguf.contract.protocol import relay_audience
from meshnet_gguf.contract.signing import public_key_text
from meshnet_gguf.reference.tracker.node_address import AddressPolicy
from meshnet_gguf.reference.tracker.relay_dialer import TLS_IN_TLS, NodeDialer


async def _connect_answer(relay_url: str, node_id: str, authorization: str | None) -> bytes:
    host, port = relay_url.removeprefix("http://").split(":")
    async with await anyio.connect_tcp(host, int(port)) as stream:
        auth = f"Proxy-Authorization: {authorization}\r\n" if authorization is not None else ""
        await stream.send(f"CONNECT {node_id}:443 HTTP/1.1\r\nHost: {node_id}:443\r\n{auth}\r\n".encode())
        with anyio.fail_after(5):
            return await stream.receive()


async def test_connect_without_a_fresh_token_from_a_trusted_tracker_gets_407_and_no_work_connection(tmp_path: Path) -> None:
    tracker, stranger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    config = RelayConfig(port=0, trusted_tracker_keys=(public_key_text(tracker.public_key()),))
    async with mesh(tmp_path, relay_config=config) as m:
        await m.wait_attached(idle=4)
        node_id, url = m.identity.node_id, m.relay_url
        now = int(time.time())
        valid = connect_signer(tracker)(url, node_id)
        forged = {
            "no token": None,
            "another scheme": f"Basic {valid}",
            "an untrusted tracker": "Bearer " + connect_signer(stranger)(url, node_id),
            "another node": "Bearer " + connect_signer(tracker)(url, "node-someone-else"),
            "another relay": "Bearer " + connect_signer(tracker)("http://relay.elsewhere:8001", node_id),
            "expired": "Bearer " + connect_signer(tracker, iat=now - 120, exp=now - 60)(url, node_id),
            "too long-lived": "Bearer " + connect_signer(tracker, exp=now + 3600)(url, node_id),
        }
        for case, authorization in forged.items():
            answer = await _connect_answer(url, node_id, authorization)
            assert answer.startswith(b"HTTP/1.1 407") and b"connect_unauthorised" in answer, (case, answer)
        assert len(m.relay.tunnels[node_id].idle) == 4 and m.relay.stats()["streams_total"] == 0  # nothing touched
        # The genuine token opens one connection, once.
        dialer = NodeDialer(httpx.Limits(), lambda relay_url, nid: valid)
        async with httpx.AsyncClient(transport=dialer, trust_env=False, timeout=5) as http:
            target = await dialer.through_relay(tunnel_announcement(m), AddressPolicy(allow_loopback=True))
            assert (await http.send(target.request(http, "GET", "/health"))).status_code == 200
        replayed = await _connect_answer(url, node_id, f"Bearer {valid}")
        assert replayed.startswith(b"HTTP/1.1 407") and b"already used" in replayed


async def test_a_source_whose_connections_prove_nothing_is_reset_at_accept_and_a_tracker_is_not(tmp_path: Path) -> None:
    tracker = Ed25519PrivateKey.generate()
    config = RelayConfig(port=0, trusted_tracker_keys=(public_key_text(tracker.public_key()),),
                         stranger_connection_burst=8, stranger_connections_per_s=0.01)  # fmt: skip
    async with mesh(tmp_path, relay_config=config) as m:
        await m.wait_attached(idle=4)
        node_id, url = m.identity.node_id, m.relay_url
        answers = [await answer_from(url, forged_connect(node_id), ATTACKER_ADDRESS) for _ in range(12)]
        assert all(a.startswith(b"HTTP/1.1 407") for a in answers[:8]), answers
        assert answers[8:] == [b""] * 4  # out of tokens: reset before a byte is read, no answer
        assert m.relay.reset_at_accept == 4
        # The tracker's own CONNECTs prove themselves and give their token back: far more than the burst all pass.
        dialer = NodeDialer(httpx.Limits(max_keepalive_connections=0), connect_signer(tracker))
        async with httpx.AsyncClient(transport=dialer, trust_env=False, timeout=5) as http:
            target = await dialer.through_relay(tunnel_announcement(m), AddressPolicy(allow_loopback=True))
            for _ in range(12):
                assert (await http.send(target.request(http, "GET", "/health"))).status_code == 200
        assert m.relay.reset_at_accept == 4 and m.relay.stats()["streams_total"] == 12


async def test_a_connect_token_issued_before_the_relay_started_is_refused(tmp_path: Path) -> None:
    # Used tokens are remembered in memory only: without this, one captured on an http relay could be
    # replayed after a restart for the rest of its life.
    tracker = Ed25519PrivateKey.generate()
    config = RelayConfig(port=0, trusted_tracker_keys=(public_key_text(tracker.public_key()),))
    async with mesh(tmp_path, relay_config=config) as m:
        await m.wait_attached(idle=1)
        node_id, url = m.identity.node_id, m.relay_url
        now = int(time.time())
        before_start = connect_signer(tracker, iat=now - 5, exp=now + 20)(url, node_id)
        answer = await _connect_answer(url, node_id, f"Bearer {before_start}")
        assert answer.startswith(b"HTTP/1.1 407") and b"before this relay started" in answer, answer
        assert m.relay.stats()["streams_total"] == 0
        fresh = connect_signer(tracker)(url, node_id)
        assert (await _connect_answer(url, node_id, f"Bearer {fresh}")).startswith(b"HTTP/1.1 200")


async def test_a_tunnel_stays_only_when_a_trusted_tracker_reaches_it(tmp_path: Path) -> None:
    tracker = Ed25519PrivateKey.generate()
    config = RelayConfig(port=0, trusted_tracker_keys=(public_key_text(tracker.public_key()),), admission_window_s=1.0,
                         max_provisional_tunnels=2)  # fmt: skip
    async with mesh(tmp_path, relay_config=config) as m:
        node_id = m.identity.node_id
        dialer = NodeDialer(httpx.Limits(), connect_signer(tracker))
        async with httpx.AsyncClient(transport=dialer, trust_env=False, timeout=5) as http:
            target = await dialer.through_relay(tunnel_announcement(m), AddressPolicy(allow_loopback=True))
            assert (await http.send(target.request(http, "GET", "/health"))).status_code == 200
        assert m.relay.tunnels[node_id].admitted.is_set()
        # Strangers' fresh keys from one network: its share of provisional tunnels (one of two), then refusals; all
        # gone after the window.
        strangers, answers = [], []
        for _ in range(3):
            identity = NodeIdentity.from_private_key(Ed25519PrivateKey.generate())
            stream, buffered, challenge = await raw_tunnel(m.relay_url, source=ATTACKER_ADDRESS)
            await stream.send(attach_message(identity, challenge["nonce"], to=m.relay_url))
            answers.append((await read_answer(buffered))["type"])
            strangers.append(stream)
        assert answers == ["attached", "refused", "refused"]  # the admitted node takes no place among the provisional
        with anyio.fail_after(3):
            while m.relay.stats()["tunnels"] > 1:
                await anyio.sleep(0.05)
        assert list(m.relay.tunnels) == [node_id] and m.link.connects == 1  # the admitted node never left
        for stream in strangers:
            await stream.aclose()


async def test_new_tunnels_from_one_address_are_rate_limited() -> None:
    relay = Relay(RelayConfig(port=0, tunnel_attaches_per_s=0.1, tunnel_attach_burst=3))
    async with running_relay(relay) as relay_url:
        answers = []
        for _ in range(5):
            identity = NodeIdentity.from_private_key(Ed25519PrivateKey.generate())
            stream, buffered, challenge = await raw_tunnel(relay_url)
            async with stream:
                await stream.send(attach_message(identity, challenge["nonce"], to=relay_url))
                answers.append((await read_answer(buffered)).get("code", "attached"))
        assert answers == ["attached"] * 3 + ["rate_limited"] * 2


async def test_an_attach_proof_for_another_relay_is_refused(tmp_path: Path) -> None:
    relay = Relay(RelayConfig(port=0))
    identity = NodeIdentity.from_private_key(Ed25519PrivateKey.generate())
    async with running_relay(relay) as relay_url:
        stream, buffered, challenge = await raw_tunnel(relay_url)
        async with stream:
            # A hostile relay passes this relay's challenge to the node, which signs it for the hostile one.
            await stream.send(attach_message(identity, challenge["nonce"], to=relay_url, aud=relay_audience("http://hostile:8001")))
            assert (await read_answer(buffered))["code"] == "bad_proof"
        assert identity.node_id not in relay.tunnels


# --- https relays ---------------------------------------------------------------------------------------

import datetime
import ssl

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from support.loopback import serve_asgi
from support.relay_harness import StreamApp

from meshnet_gguf.common.ports import free_local_port as _free_port
from meshnet_gguf.mesh.relay_link import build_relay_link, local_address_for


def _certificate_authority(tmp_path: Path, server_name: str) -> tuple[Path, Path, Path]:
    """A CA made for this test and a server certificate it signed for `server_name`: (ca, cert, key) PEM files."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshnet test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, server_name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(server_name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))  # fmt: skip
    folder = tmp_path / f"ca-{server_name}"
    folder.mkdir()
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "cert.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))  # fmt: skip
    return folder / "ca.pem", folder / "cert.pem", folder / "key.pem"


class _SniRecordingRelay(Relay):
    def __init__(self, config: RelayConfig) -> None:
        super().__init__(config)
        self.server_names: list[str | None] = []
        assert self._tls is not None
        self._tls.sni_callback = lambda sock, name, ctx: self.server_names.append(name)


async def test_an_https_relay_is_reached_by_name_with_sni(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca, cert, key = _certificate_authority(tmp_path, "localhost")
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # the node trusts the test CA as it would a public one
    tracker = Ed25519PrivateKey.generate()
    port, app, app_port = _free_port(), StreamApp(), _free_port()
    relay = _SniRecordingRelay(RelayConfig(
        host="localhost", port=port, public_url=f"https://localhost:{port}", tls_certificate_file=str(cert), tls_key_file=str(key),
        trusted_tracker_keys=(public_key_text(tracker.public_key()),),
    ))  # fmt: skip
    async with serve_asgi(app, app_port), anyio.create_task_group() as tg:
        await tg.start(relay.serve)
        link = build_relay_link(
            f"https://localhost:{port}",
            NodeIdentity.load_or_create(tmp_path / "node"),
            tmp_path / "node",
            local_address_for("127.0.0.1", app_port),
        )
        tg.start_soon(link.run)
        with anyio.fail_after(10):
            while link.link_health().idle_work < 1:
                await anyio.sleep(0.02)
        from support.relay_harness import Mesh

        m = Mesh(relay, f"https://localhost:{port}", link, app, app_port, link.identity)
        trusting = ssl.create_default_context(cafile=str(ca))
        dialer = NodeDialer(httpx.Limits(), connect_signer(tracker), relay_tls=trusting)
        async with httpx.AsyncClient(transport=dialer, trust_env=False, timeout=10) as http:
            target = await dialer.through_relay(tunnel_announcement(m), AddressPolicy(allow_loopback=True))
            request = target.request(
                http, "POST", "/v1/chat/completions", content=b'{"n": 3}', headers={"content-type": "application/json"}
            )
            response = await http.send(request, stream=True)
            try:
                body = b"".join([chunk async for chunk in response.aiter_raw()])
            finally:
                await response.aclose()
            assert response.status_code == 200 and body.endswith(b"data: [DONE]\n\n")
            # The tracker's routed requests go through the target's lean client: the node's TLS inside the relay's
            # (Python 3.10's own loop cannot nest TLS; such a target has no lean client and keeps httpx).
            assert (target.client is not None) == TLS_IN_TLS
            if target.client is not None:
                lean = await target.client.send(
                    "POST", target.forward_url("/v1/chat/completions"), {"content-type": "application/json"}, b'{"n": 3}'
                )
                try:
                    assert lean.status == 200 and (await lean.read()).endswith(b"data: [DONE]\n\n")
                finally:
                    await lean.aclose()
        assert relay.server_names and set(relay.server_names) == {"localhost"}  # node and tracker both sent SNI
        # A relay whose certificate names another host is refused by the tracker, whatever its CA.
        other_ca, other_cert, other_key = _certificate_authority(tmp_path, "elsewhere.test")
        impostor = Relay(RelayConfig(host="localhost", port=0, tls_certificate_file=str(other_cert), tls_key_file=str(other_key)))
        impostor_port = await tg.start(impostor.serve)
        wrong_name = NodeDialer(httpx.Limits(), connect_signer(tracker), relay_tls=ssl.create_default_context(cafile=str(other_ca)))
        async with httpx.AsyncClient(transport=wrong_name, trust_env=False, timeout=5) as http:
            announcement = tunnel_announcement(m).model_copy(
                update={"relay": m.link.attachment().model_copy(update={"url": f"https://localhost:{impostor_port}"})}
            )
            target = await wrong_name.through_relay(announcement, AddressPolicy(allow_loopback=True))
            with pytest.raises(httpx.ConnectError, match="(?i)hostname|certificate"):
                await http.send(target.request(http, "GET", "/health"))
            if target.client is not None:
                with pytest.raises(HttpConnectError, match="(?i)hostname|certificate"):
                    await target.client.send("POST", target.forward_url("/v1/chat/completions"), {}, b'{"n": 1}')
        await link.drain()
        await link.close()
        tg.cancel_scope.cancel()


# --- private stays private ----------------------------------------------------------------------------


async def test_metrics_answer_local_scrapes_and_the_operator_key_never_a_relayed_stranger(tmp_path: Path) -> None:
    async with mesh(tmp_path, metrics_key="operator-key-1") as m, m.client() as stranger:
        # Through the relay: a CONNECT, TLS with the node, GET /metrics without a route. Not found, as any unknown path.
        relayed = await stranger.get(m.node_url + "/metrics")
        assert relayed.status_code == 404
        assert (await stranger.get(m.node_url + "/health")).status_code == 200  # what 9.5 lists stays public
        keyed = await stranger.get(m.node_url + "/metrics", headers={"authorization": "Bearer operator-key-1"})
        assert keyed.status_code == 200
        async with httpx.AsyncClient(trust_env=False) as local:  # a scrape on this machine
            assert (await local.get(f"http://127.0.0.1:{m.app_port}/metrics")).status_code == 200
