"""In-process pieces for relay tests: the reference relay, a node's relay link, a small streaming
HTTP app standing in for the node's proxy, and a tracker-side client that reaches the node the way
the reference tracker does (CONNECT through the relay, TLS pinned to the node's certificate)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.contract.error_answer import send_error
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.node_tls import certificate_from_text, pinned_client_context
from meshnet_gguf.contract.protocol import NodeAnnouncement
from meshnet_gguf.contract.signing import encode_token, parse_public_key, tracker_issuer_for
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.mesh.relay_link import RelayLink, build_relay_link, local_address_for
from meshnet_gguf.reference.relay.config import RelayConfig
from meshnet_gguf.reference.relay.server import Relay
from meshnet_gguf.reference.tracker.relay_dialer import new_connect_claims
from meshnet_gguf.serving.access import LocalOrKey
from meshnet_gguf.serving.routes import Request
from support.loopback import serve_asgi

WAIT_S = 10.0


@dataclass
class StreamApp:
    """ASGI app: POST streams `n` numbered SSE events `delay` apart; records what it saw."""

    bodies: list[bytes] = field(default_factory=list)
    disconnects: int = 0
    active: int = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        if scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"status":"ok"}'})
            return
        request = json.loads(body or b"{}")
        n, delay = int(request.get("n", 5)), float(request.get("delay", 0))
        pad = "x" * int(request.get("pad", 0))
        self.active += 1
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    self.disconnects += 1
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                await send({"type": "http.response.body", "body": b": keep-this-comment\n\n", "more_body": True})
                for i in range(n):
                    await send({"type": "http.response.body", "body": f"data: {i}{pad}\n\n".encode(), "more_body": True})
                    if delay:
                        await anyio.sleep(delay)
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
                tg.cancel_scope.cancel()
        finally:
            self.active -= 1


@dataclass
class Mesh:
    relay: Relay
    relay_url: str
    link: RelayLink
    app: StreamApp
    app_port: int
    identity: NodeIdentity

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        """Reach the node as the tracker does: through the relay, TLS pinned to the announced certificate."""
        attachment = self.link.attachment()
        context = pinned_client_context(certificate_from_text(attachment.tls_certificate), parse_public_key(self.identity.public_key_text))
        return httpx.AsyncClient(proxy=self.relay_url, verify=context, trust_env=False, timeout=WAIT_S, **kwargs)

    @property
    def node_url(self) -> str:
        return f"https://{self.identity.node_id}"

    async def wait_attached(self, idle: int = 1) -> None:
        with anyio.fail_after(WAIT_S):
            while not (self.link.state == "attached" and self.link.link_health().idle_work >= idle
                       and self.identity.node_id in self.relay.tunnels
                       and len(self.relay.tunnels[self.identity.node_id].idle) >= idle):  # fmt: skip
                await anyio.sleep(0.01)


@contextlib.asynccontextmanager
async def running_relay(relay: Relay) -> AsyncIterator[str]:
    async with anyio.create_task_group() as tg:
        port = await tg.start(relay.serve)
        host = relay.config.host
        try:
            yield f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        finally:
            tg.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def mesh(
    tmp_path: Path, *, relay_config: RelayConfig | None = None, relay: Relay | None = None, metrics_key: str | None = None
) -> AsyncIterator[Mesh]:
    """The relay, a node's link and its stand-in app, whose `/metrics` is guarded as the node guards its own."""
    app = StreamApp()
    app_port = free_local_port()
    relay = relay or Relay(relay_config or RelayConfig(port=0))
    links: list[RelayLink] = []
    metrics_access = LocalOrKey(lambda peer: any(link.is_relayed(peer) for link in links), metrics_key)

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        # The node's `/metrics` row's guard, in front of the stand-in's own answer.
        if scope["type"] == "http" and scope["path"] == "/metrics":
            try:
                metrics_access(Request(scope, receive, send, None))
            except ApiError as exc:
                await send_error(send, exc)
                return
        await app(scope, receive, send)

    async with serve_asgi(guarded, app_port), running_relay(relay) as relay_url:
        link = build_relay_link(
            relay_url, NodeIdentity.load_or_create(tmp_path / "node"), tmp_path / "node", local_address_for("127.0.0.1", app_port)
        )
        links.append(link)
        async with anyio.create_task_group() as tg:
            tg.start_soon(link.run)
            m = Mesh(relay, relay_url, link, app, app_port, link.identity)
            await m.wait_attached()
            try:
                yield m
            finally:
                await link.drain()
                await link.close()
                tg.cancel_scope.cancel()


class _SpliceSide:
    """One side of a relay's splice, seen (and perhaps altered) by a test playing a dishonest relay."""

    def __init__(self, inner: Any, on_receive: Any) -> None:
        self.inner, self.on_receive, self.count = inner, on_receive, 0

    async def receive(self, max_bytes: int = 65536) -> bytes:
        self.count += 1
        return self.on_receive(self.count, await self.inner.receive(max_bytes))

    async def send(self, data: bytes) -> None:
        await self.inner.send(data)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def extra(self, attribute: Any, *default: Any) -> Any:
        return self.inner.extra(attribute, *default)


def reading_relay(monkeypatch: Any, seen: bytearray) -> None:
    """The reference relay, made to copy every byte it splices (both ways) into `seen`."""
    import meshnet_gguf.reference.relay.server as relay_module

    original = relay_module._splice

    def note(count: int, data: bytes) -> bytes:
        seen.extend(data)
        return data

    async def tapping_splice(a: Any, b: Any, **kwargs: Any) -> None:
        await original(_SpliceSide(a, note), _SpliceSide(b, note), **kwargs)

    monkeypatch.setattr(relay_module, "_splice", tapping_splice)


def tampering_relay(monkeypatch: Any) -> None:
    """The reference relay, made to flip one bit in the tracker's first application-data record
    (its third read: ClientHello, then Finished, then the request)."""
    import meshnet_gguf.reference.relay.server as relay_module

    original = relay_module._splice

    def flip(count: int, data: bytes) -> bytes:
        if count == 3 and len(data) > 20:
            altered = bytearray(data)
            altered[-5] ^= 0x01
            return bytes(altered)
        return data

    async def flipping_splice(a: Any, b: Any, **kwargs: Any) -> None:
        await original(_SpliceSide(a, flip), b, **kwargs)

    monkeypatch.setattr(relay_module, "_splice", flipping_splice)


async def read_events(response: httpx.Response) -> list[str]:
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: ") :])
    return events


async def raw_tunnel(relay_url: str, source: str | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """Open an upgraded tunnel connection by hand (an attacker's or a broken node's view), from `source` if given;
    returns the challenge."""
    from anyio.streams.buffered import BufferedByteReceiveStream

    host, port = relay_url.removeprefix("http://").rsplit(":", 1)
    stream = await anyio.connect_tcp(host.strip("[]"), int(port), local_host=source)
    buffered = BufferedByteReceiveStream(stream)
    await stream.send(b"GET /v1/relay/tunnel HTTP/1.1\r\nHost: relay\r\nConnection: Upgrade\r\nUpgrade: meshnet-relay/1\r\n\r\n")
    head = await buffered.receive_until(b"\r\n\r\n", 8192)
    assert head.startswith(b"HTTP/1.1 101"), head
    challenge = json.loads(await buffered.receive_until(b"\n", 65536))
    return stream, buffered, challenge


def forged_connect(node_id: str) -> bytes:
    """A CONNECT to `node_id` with a token no tracker signed."""
    return f"CONNECT {node_id}:443 HTTP/1.1\r\nHost: {node_id}:443\r\nProxy-Authorization: Bearer x.y.z\r\n\r\n".encode()


async def answer_from(relay_url: str, request: bytes, source: str, timeout_s: float = 5.0) -> bytes:
    """What the relay says to `request` from `source`: b"" when it closes or resets without a word."""
    host, port = relay_url.removeprefix("http://").rsplit(":", 1)
    try:
        async with await anyio.connect_tcp(host, int(port), local_host=source) as stream:
            await stream.send(request)
            with anyio.fail_after(timeout_s):
                return await stream.receive()
    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
        return b""


async def read_answer(buffered: Any) -> dict[str, Any]:
    return json.loads(await buffered.receive_until(b"\n", 65536))


def attach_message(
    identity: NodeIdentity,
    nonce: str,
    *,
    to: str,
    role: str = "control",
    node_id: str | None = None,
    public_key: str | None = None,
    signer: Any = None,
    aud: str | None = None,
) -> bytes:
    """An attach line for the relay at URL `to` (its proof names that relay unless `aud` says otherwise)."""
    import time as _time

    from meshnet_gguf.contract.protocol import relay_audience
    from meshnet_gguf.contract.signing import encode_token

    now = int(_time.time())
    node_id = node_id or identity.node_id
    claims = {"iss": node_id, "aud": aud or relay_audience(to), "nonce": nonce, "role": role, "iat": now, "exp": now + 30}
    proof = encode_token(claims, signer or identity.private_key)
    message = {"type": "attach", "role": role, "node_id": node_id, "public_key": public_key or identity.public_key_text, "proof": proof}
    return json.dumps(message).encode() + b"\n"


def connect_signer(key: Ed25519PrivateKey, **override: object):  # type: ignore[no-untyped-def]
    """The tracker's CONNECT token signer (as `NodeDialer` takes it), with claims overridden to play a forger."""
    issuer = tracker_issuer_for(key.public_key())

    def sign(relay_url: str, node_id: str) -> str:
        return encode_token({**new_connect_claims(issuer, relay_url, node_id, 30), **override}, key)

    return sign


def tunnel_announcement(m: Mesh) -> NodeAnnouncement:
    """What the mesh's node would announce to a tracker: reached only through its relay."""
    relay = m.link.attachment()
    return NodeAnnouncement(
        node_id=m.identity.node_id, public_key=m.identity.public_key_text, advertised_url=relay.url, model_id="m",
        first_layer=0, last_layer=0, total_layers=1, slots=1, node_version="test", relay=relay,
    )  # fmt: skip
