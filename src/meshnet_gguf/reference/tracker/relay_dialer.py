"""How the tracker reaches a node through its relay.

A node that announced a relay (`NodeAnnouncement.relay`) is reached at
`https://<node_id>` through the relay: the tracker dials the relay at the
address it pinned (with TLS checked against the relay's own host name, SNI
sent, when the relay URL is https), asks `CONNECT <node_id>:443` with a fresh
tracker-signed token in `Proxy-Authorization`, and speaks TLS 1.3 inside that
trusts only the certificate the node registered, after checking that
certificate carries the node's registered key. The relay therefore splices
bytes it cannot read; a relay that alters them breaks the TLS record MACs and
the request fails.

`NodeDialer` is the tracker's HTTP transport: a request built by a
`RelayedNodeTarget` goes through that target's own transport (its relay, its
pinned certificate); every other request goes out directly. A target's
transport is kept only once the tracker `adopt`s it (after the control proof);
a failed registration's is closed at once, and a replaced or forgotten one is
closed when its last request has finished, so failed or repeated registrations
leave nothing behind.

A node that announced several relays (`NodeAnnouncement.relays`, protocol 9.7) is reached through
whichever of them answers: each new connection dials them in a `RelayOrder` (the one that worked
last first) and moves to the next when a CONNECT fails, before any byte of a request is written
(`relay_failover`).

Routed requests, the hot path, do not go through httpx: each target also has a
lean client (`common/http1_client`) whose connections `RelayTunnel` opens, the
same CONNECT and the same pinned TLS on asyncio's own `start_tls`. httpx costs
~0.85 ms a request to its first chunk where the lean client costs ~0.1 ms
(`bench/http_client_cost.py`). Its kept connections live and die with the target's.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import anyio
import httpcore
import httpx

from meshnet_gguf.common.http1_client import Http1Client, HttpAnswer, HttpConnectError
from meshnet_gguf.common.httpx_answer import send_through_httpx
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.node_tls import NodeCertificateError, certificate_from_text, pinned_client_context
from meshnet_gguf.contract.protocol import NodeAnnouncement, relay_audience
from meshnet_gguf.contract.relay_framing import HEAD_END, connect_refusal, connect_request
from meshnet_gguf.contract.relay_wire import MAX_RELAY_HEAD_BYTES, RelayConnectClaims
from meshnet_gguf.contract.signing import KeyFormatError, parse_public_key
from meshnet_gguf.reference.tracker.node_address import AddressPolicy, NodeTarget, UnsafeNodeURL, pin_node_url
from meshnet_gguf.reference.tracker.node_clients import NODE_PEER, NodeClients
from meshnet_gguf.reference.tracker.relay_failover import RelayOrder, dial_in_order

log = logging.getLogger(__name__)

# The request extension that carries a relayed target's transport to the dialer.
_TRANSPORT_EXTENSION = "meshnet_relay_transport"

# Signs a CONNECT token: (relay URL as announced, node id) -> token.
ConnectSigner = Callable[[str, str], str]

# What the lean client of one relayed node keeps and how long it waits (the tracker's
# httpx limits hold for the rest). A relay tunnel costs a CONNECT, its token and a TLS
# handshake, so warm ones are kept; a node's uvicorn closes one idle for 5 s.
RELAYED_KEPT_CONNECTIONS = 64
# Per relay tried: a node with two relays may take twice this before its connection fails.
RELAYED_CONNECT_TIMEOUT_S = 5.0
RELAYED_IDLE_TTL_S = 2.0
RELAYED_READ_IDLE_TIMEOUT_S = 600.0
# A standby relay (one a node is not reached through now) is visited this often: a CONNECT through it
# is what makes a trusting relay admit the node's tunnel there (it drops one no tracker reached within
# 60 s, ADMISSION_WINDOW_S), so failover finds the tunnel still there; and the log says when it would not.
STANDBY_VISIT_INTERVAL_S = 20.0
# The node's TLS inside an https relay's is `start_tls` on a TLS transport, which asyncio's own
# loop allows from Python 3.11; before that such targets keep httpx for routed requests too.
TLS_IN_TLS = sys.version_info >= (3, 11)


class ConnectRefused(HttpConnectError):
    """The relay would not open the tunnel (or spoke no HTTP): the node never saw the request."""


# How dialling through one relay can fail before a request is written, so the next relay may be tried:
# the TCP connect, the relay's TLS, a refused or unanswered CONNECT, the node's TLS inside (ssl errors
# are OSErrors), or a try past its time.
_LEAN_DIAL_FAILURES: tuple[type[BaseException], ...] = (OSError, TimeoutError, HttpConnectError)
_HTTPCORE_DIAL_FAILURES: tuple[type[BaseException], ...] = (httpcore.NetworkError, httpcore.TimeoutException, httpcore.ProxyError)


def _check_connect_answer(answer: bytes) -> None:
    refusal = connect_refusal(answer)
    if refusal is not None:
        raise ConnectRefused(refusal)


class _RelayNetwork(httpcore.AsyncNetworkBackend):
    """Every connection httpcore opens "to the node" is a CONNECT through its relay, with a fresh token.

    httpcore then runs the node's TLS inside the stream this returns.
    """

    def __init__(self, relays: RelayOrder[NodeTarget], node_id: str, sign: ConnectSigner, relay_tls: ssl.SSLContext) -> None:
        self._relays, self._node_id, self._sign, self._relay_tls = relays, node_id, sign, relay_tls
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[object] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        # Each step below is bounded by `timeout` already; whatever fails here failed before httpcore wrote the request.
        return await dial_in_order(
            self._relays, lambda relay: self._connect_through(relay, timeout, local_address), _HTTPCORE_DIAL_FAILURES,
            node_id=self._node_id,
        )  # fmt: skip

    async def _connect_through(self, relay: NodeTarget, timeout: float | None, local_address: str | None) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(str(relay.address), relay.port, timeout=timeout, local_address=local_address)
        try:
            if relay.scheme == "https":  # the pinned address dialled, the relay's own name checked and sent as SNI
                stream = await stream.start_tls(self._relay_tls, server_hostname=relay.host, timeout=timeout)
            await stream.write(connect_request(self._node_id, self._sign(relay.url, self._node_id)), timeout=timeout)
            answer = b""
            while HEAD_END not in answer:
                chunk = await stream.read(MAX_RELAY_HEAD_BYTES, timeout=timeout)
                if not chunk:
                    raise httpcore.ProxyError("the relay closed the CONNECT without an answer")
                answer += chunk
                if len(answer) > MAX_RELAY_HEAD_BYTES:
                    raise httpcore.ProxyError("the relay's answer to CONNECT is too long")
            try:
                _check_connect_answer(answer)
            except ConnectRefused as refused:
                raise httpcore.ProxyError(str(refused)) from None
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _ConnectAnswer(asyncio.Protocol):
    """Reads the relay's answer to CONNECT; reading pauses once it is whole, until the node's TLS takes over."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.answer = b""
        self.ended = loop.create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.answer += data
        if HEAD_END in self.answer or len(self.answer) > MAX_RELAY_HEAD_BYTES:
            assert self.transport is not None
            self.transport.pause_reading()
            self._end(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(ConnectRefused(f"the relay closed the CONNECT without an answer ({exc or 'EOF'})"))

    def _end(self, error: Exception | None) -> None:
        if not self.ended.done():
            self.ended.set_exception(error) if error is not None else self.ended.set_result(None)


class RelayTunnel:
    """Opens one connection to a relayed node for the lean client: TCP to the relay's pinned address
    (TLS checked against the relay's name when it is https), `CONNECT <node_id>:443` with a fresh
    token, then TLS 1.3 inside that trusts only the node's registered certificate. What httpx's
    `_RelayNetwork` does, on asyncio's transports (`loop.start_tls`)."""

    def __init__(
        self, relays: RelayOrder[NodeTarget], node_id: str, sign: ConnectSigner, relay_tls: ssl.SSLContext, node_tls: ssl.SSLContext
    ) -> None:
        self._relays, self._node_id, self._sign = relays, node_id, sign
        self._relay_tls, self._node_tls = relay_tls, node_tls

    async def __call__(self, protocol: asyncio.Protocol) -> None:
        # `protocol` sees nothing until a tunnel is whole (connection_made comes last), so a failed
        # relay leaves it clean for the next; the request is written only after this returns.
        await dial_in_order(
            self._relays, lambda relay: self._open_through(relay, protocol), _LEAN_DIAL_FAILURES,
            each_timeout_s=RELAYED_CONNECT_TIMEOUT_S, node_id=self._node_id,
        )  # fmt: skip

    async def visit(self, relay: NodeTarget) -> None:
        """Open one tunnel through `relay`, the node's TLS included, and close it: no request is sent."""
        visit = _Visit()
        with anyio.fail_after(RELAYED_CONNECT_TIMEOUT_S):
            await self._open_through(relay, visit)
        visit.close()

    async def _open_through(self, relay: NodeTarget, protocol: asyncio.Protocol) -> None:
        loop = asyncio.get_running_loop()
        head = _ConnectAnswer(loop)
        transport, _ = await loop.create_connection(lambda: head, str(relay.address), relay.port)
        try:
            if relay.scheme == "https":  # the pinned address dialled, the relay's own name checked and sent as SNI
                transport = await loop.start_tls(transport, head, self._relay_tls, server_hostname=relay.host)  # type: ignore[assignment]
                head.transport = transport
            transport.write(connect_request(self._node_id, self._sign(relay.url, self._node_id)))
            await head.ended
            if len(head.answer) > MAX_RELAY_HEAD_BYTES:
                raise ConnectRefused("the relay's answer to CONNECT is too long")
            _check_connect_answer(head.answer)
            node = await loop.start_tls(transport, protocol, self._node_tls, server_hostname=self._node_id)
        except BaseException:
            head.ended.cancel()  # its close below must not leave an error nobody reads
            transport.close()
            raise
        if node is None:  # the connection closed during the handshake
            transport.close()
            raise ConnectRefused("the tunnel closed during the node's TLS handshake")
        protocol.connection_made(node)


class _Visit(asyncio.Protocol):
    """The far end of a standby visit: takes the tunnel and closes it."""

    transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _relayed_transport(
    relays: RelayOrder[NodeTarget],
    node_id: str,
    node_tls: ssl.SSLContext,
    limits: httpx.Limits,
    sign: ConnectSigner,
    relay_tls: ssl.SSLContext,
) -> httpx.AsyncHTTPTransport:
    transport = httpx.AsyncHTTPTransport(verify=node_tls, limits=limits)
    # httpx has no public hook for the network backend; its pool is swapped for one whose every connection is a
    # token-carrying CONNECT (httpx's request mapping and error translation stay as they are).
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=node_tls,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=_RelayNetwork(relays, node_id, sign, relay_tls),
    )
    return transport


@dataclass(frozen=True)
class RelayedNodeTarget:
    """A node reached through a relay: same interface as `NodeTarget` (url, endpoint, request, send)."""

    node_id: str
    relay: NodeTarget  # the first relay's URL, checked against the address policy and pinned like a node's
    certificate: str
    transport: httpx.AsyncHTTPTransport = field(compare=False, repr=False)
    # Routed requests: the lean client, its connections opened by a RelayTunnel (see the module's
    # text); None where this Python cannot nest TLS for an https relay (TLS_IN_TLS).
    client: Http1Client | None = field(compare=False, repr=False)
    tunnel: RelayTunnel | None = field(compare=False, repr=False)  # what the lean client opens its connections with
    # Every relay the node announced (the first is `relay`), each pinned the same way, in the order to dial them.
    relays: RelayOrder[NodeTarget] = field(compare=False, repr=False)

    def forward_url(self, path: str) -> str:
        """`path` on the node, as both clients ask for it (the relay and the pinned TLS do the reaching)."""
        return f"https://{self.node_id}{path}"

    @property
    def url(self) -> str:
        return f"https://{self.node_id} through {self.relay.url}"

    @property
    def endpoint(self) -> tuple[str, int, str]:
        # Many nodes share one relay: each is its own endpoint there.
        return (str(self.relay.address), self.relay.port, f"relay:{self.node_id}")

    def request(
        self,
        http: httpx.AsyncClient,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        content: bytes | None = None,
    ) -> httpx.Request:
        return http.build_request(
            method, self.forward_url(path), params=params, headers=headers, content=content,
            extensions={_TRANSPORT_EXTENSION: self.transport},
        )  # fmt: skip

    async def send(self, clients: NodeClients, method: str, path: str, headers: dict[str, str], body: bytes) -> HttpAnswer:
        """As `NodeTarget.send`: with this target's own lean client, whose connections are tunnels through
        the relay, or through httpx where it has none (TLS_IN_TLS)."""
        if self.client is not None:
            return await self.client.send(method, self.forward_url(path), headers, body)
        request = self.request(clients.http, method, path, headers=headers, content=body)
        return await send_through_httpx(clients.http, request, peer=NODE_PEER)


class NodeDialer(httpx.AsyncBaseTransport):
    def __init__(self, limits: httpx.Limits, sign_connect: ConnectSigner, *, relay_tls: ssl.SSLContext | None = None) -> None:
        self._limits = limits
        self._sign = sign_connect
        self._relay_tls = relay_tls or ssl.create_default_context()
        self.direct = httpx.AsyncHTTPTransport(limits=limits)
        self._adopted: dict[str, RelayedNodeTarget] = {}
        self._retired: list[httpx.AsyncHTTPTransport] = []

    async def through_relay(self, announcement: NodeAnnouncement, policy: AddressPolicy) -> RelayedNodeTarget:
        """Check a relayed node's announcement and make it reachable (not yet kept: see `adopt`); refusals are the
        registration's answer."""
        relay = announcement.relay
        assert relay is not None
        # Every relay passes the address checks (T6) and is pinned once, as the first always was.
        relay_targets: list[NodeTarget] = []
        for attachment in announcement.relay_attachments():
            try:
                relay_targets.append(await pin_node_url(attachment.url, policy))
            except UnsafeNodeURL as exc:
                raise ApiError(422, "unsafe_relay_url", str(exc)) from None
        relay_target = relay_targets[0]
        try:
            context = pinned_client_context(certificate_from_text(relay.tls_certificate), parse_public_key(announcement.public_key))
        except (NodeCertificateError, KeyFormatError) as exc:
            raise ApiError(422, "bad_relay_certificate", f"relay.tls_certificate: {exc}") from None
        known = self._adopted.get(announcement.node_id)
        if known is not None and (known.relays.relays, known.certificate) == (tuple(relay_targets), relay.tls_certificate):
            return known  # the same way in: keep its warm connections (and which relay works)
        # One order for both clients: what the health polls learn about a dead relay, routed requests use too.
        relays = RelayOrder(relay_targets)
        transport = _relayed_transport(relays, announcement.node_id, context, self._limits, self._sign, self._relay_tls)
        client, tunnel = None, None
        if relay_target.scheme == "http" or TLS_IN_TLS:
            tunnel = RelayTunnel(relays, announcement.node_id, self._sign, self._relay_tls, context)
            client = Http1Client(
                RELAYED_KEPT_CONNECTIONS, peer="node", read_idle_timeout_s=RELAYED_READ_IDLE_TIMEOUT_S, keep_streamed=True,
                open_connection=tunnel,
                # Room for each relay's own try (RelayTunnel bounds each), so the last is not cut short.
                connect_timeout_s=RELAYED_CONNECT_TIMEOUT_S * len(relay_targets), idle_ttl_s=RELAYED_IDLE_TTL_S,
                # A kept tunnel that ends unanswered may have carried the request to the node before its relay
                # died: sending it again (through the other relay) could run it twice. Only a dial is retried.
                resend_on_stale=False,
            )  # fmt: skip
        return RelayedNodeTarget(announcement.node_id, relay_target, relay.tls_certificate, transport, client, tunnel, relays)

    def adopt(self, target: RelayedNodeTarget) -> None:
        """Keep `target` as the way to its node (after the node proved control through it)."""
        previous = self._adopted.get(target.node_id)
        self._adopted[target.node_id] = target
        if previous is not None and previous.transport is not target.transport:
            self._retired.append(previous.transport)  # requests in flight on it finish first
            _close_lean(previous)

    async def discard(self, target: RelayedNodeTarget) -> None:
        """Close a target that was never adopted (its registration failed)."""
        if self._adopted.get(target.node_id) is not target:
            await target.transport.aclose()
            _close_lean(target)

    async def forget_all_but(self, node_ids: Iterable[str]) -> None:
        """Retire the ways to nodes no longer registered, and close retired transports with nothing in flight."""
        keep = set(node_ids)
        for node_id in [n for n in self._adopted if n not in keep]:
            forgotten = self._adopted.pop(node_id)
            self._retired.append(forgotten.transport)
            _close_lean(forgotten)
        still_busy = []
        for transport in self._retired:
            if any(not c.is_idle() for c in transport._pool.connections):
                still_busy.append(transport)
            else:
                await transport.aclose()
        self._retired = still_busy

    async def visit_standby_relays(self) -> None:
        """One tunnel through every relay each node is not reached through now, opened and closed at once
        (STANDBY_VISIT_INTERVAL_S says why). A failed visit changes nothing: routed requests still fail
        over by themselves, and the standby may be back by then."""

        async def visit(target: RelayedNodeTarget, tunnel: RelayTunnel, relay: NodeTarget) -> None:
            try:
                await tunnel.visit(relay)
            except _LEAN_DIAL_FAILURES as exc:
                log.warning("node %s: its standby relay %s does not reach it (%s: %s)", target.node_id, relay.url, type(exc).__name__, exc)

        async with anyio.create_task_group() as visits:
            for target in list(self._adopted.values()):
                if target.tunnel is None:
                    continue
                for relay in target.relays.order()[1:]:
                    visits.start_soon(visit, target, target.tunnel, relay)

    def held(self) -> tuple[int, int]:
        """(adopted, retired) transports: what registrations left behind."""
        return len(self._adopted), len(self._retired)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        relayed = request.extensions.get(_TRANSPORT_EXTENSION)
        if relayed is not None:
            return await relayed.handle_async_request(request)
        return await self.direct.handle_async_request(request)

    async def aclose(self) -> None:
        for target in self._adopted.values():
            _close_lean(target)
        for transport in [self.direct, *(t.transport for t in self._adopted.values()), *self._retired]:
            await transport.aclose()
        self._adopted.clear()
        self._retired.clear()


def _close_lean(target: RelayedNodeTarget) -> None:
    """Close the target's kept tunnels now; answers still being read on others finish, then close."""
    if target.client is not None:
        target.client.close()


def new_connect_claims(issuer: str, relay_url: str, node_id: str, lifetime_s: int) -> dict[str, object]:
    """The claims of one CONNECT token (RelayConnectClaims): this relay, this node, once, briefly."""
    now = int(time.time())
    return RelayConnectClaims(
        iss=issuer, aud=relay_audience(relay_url), sub=node_id, jti=uuid.uuid4().hex, iat=now, exp=now + lifetime_s
    ).model_dump()


__all__ = ["ConnectRefused", "NodeDialer", "RelayTunnel", "RelayedNodeTarget", "new_connect_claims"]
