"""The node's tunnel to a relay: serve from behind NAT with no public listener.

A part of the running node (`NodePart`). It dials the relay (never the other
way round) and keeps there:

- one **control connection**: it proves the node key by signing the relay's
  challenge, then pings; a relay silent for ping interval + timeout is dead,
  and the link reconnects with backoff and jitter. A NAT that forgot the
  tunnel says nothing to either end: TCP keep-alive notices it sooner, within
  `NOTICED_WITHIN_S` (`contract/relay_keepalive`), on this connection and on
  every stream's;
- a small pool of **idle work connections**, each proved the same way. When a
  tracker CONNECTs to this node, the relay splices it to one of them; the node
  terminates TLS on it with its identity-bound certificate (`node_tls`) and
  passes the plaintext HTTP/1.1 bytes unchanged to its own local listener. A
  used connection is replaced at once, so the next request does not wait a
  round trip.

Each request has its own connection end to end, so a slow reader stalls only
its own stream, and a client that goes away closes the local connection, which
frees llama-server's slot as for any other client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import anyio
from anyio.abc import ByteStream, SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.stapled import StapledByteStream
from anyio.streams.tls import TLSStream

from meshnet_gguf.common.ports import wildcard_loopback
from meshnet_gguf.common.retry import Backoff
from meshnet_gguf.contract.node_part import BasePart
from meshnet_gguf.contract.node_tls import certificate_pem, certificate_text, node_certificate, server_context
from meshnet_gguf.contract.protocol import HealthReport, RelayAttachment, RelayLinkHealth, RelayLinkState, relay_audience
from meshnet_gguf.contract.relay_framing import (
    HEAD_END,
    RelayFramingError,
    message_line,
    parse_message,
    read_line,
    receive_line,
    send_message,
    upgrade_refusal,
    upgrade_request,
)
from meshnet_gguf.contract.relay_keepalive import IDLE_WORK_KEEPALIVE_S, keep_alive
from meshnet_gguf.contract.relay_wire import (
    MAX_RELAY_HEAD_BYTES,
    MAX_RELAY_MESSAGE_BYTES,
    RELAY_PROOF_LIFETIME_S,
    RelayAttach,
    RelayAttachClaims,
    RelayAttached,
    RelayChallenge,
    RelayPing,
    RelayReady,
    RelayRefused,
    RelayRole,
)
from meshnet_gguf.contract.signing import encode_token
from meshnet_gguf.mesh.identity import NODE_KEY_FILE, NodeIdentity

log = logging.getLogger(__name__)

NODE_TLS_CERT_FILE = "node_tls_cert.pem"
# Reconnect soon (a restarted relay is back within a second or two) but never spin; the cap
# keeps a node's return within a few seconds of the relay's, and jitter spreads a fleet.
RECONNECT_INITIAL_S = 0.25
RECONNECT_MAX_S = 4.0
# Dialling the relay and its upgrade answer: any network that can carry inference does this quickly.
DIAL_TIMEOUT_S = 10.0
# Idle work connections the node keeps at the relay (the relay may ask for fewer).
DEFAULT_IDLE_WORK = 4
# A work connection that failed to attach is not retried faster than this, so a refusing relay is not hammered.
WORK_RETRY_DELAY_S = 0.5
# The TLS handshake of a work connection, counted from the first byte the relay forwards on it: a
# tracker sends its whole ClientHello at once, so a peer that trickles or stops mid-handshake only
# holds the node's connection, and loses it after this long. The connection counts as used from that
# first byte, so a replacement is dialled at once.
TLS_HANDSHAKE_TIMEOUT_S = 10.0
# An idle work connection is renewed after this long, so none lingers forever half-open.
IDLE_WORK_LIFETIME_S = 3600.0


class RelayRefusedError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"relay refused ({code}): {message}")
        self.code = code


class RelayProtocolError(Exception):
    """The relay answered something this node does not understand."""


@dataclass(frozen=True)
class RelayEndpoint:
    host: str
    port: int
    tls: bool
    url: str

    @classmethod
    def parse(cls, url: str) -> RelayEndpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"relay URL must be http://host:port or https://host[:port], not {url!r}")
        tls = parts.scheme == "https"
        return cls(parts.hostname, parts.port or (443 if tls else 80), tls, url.rstrip("/"))


class RelayLink(BasePart):
    name = "relay"

    def __init__(
        self,
        endpoint: RelayEndpoint,
        identity: NodeIdentity,
        tls_context: ssl.SSLContext,
        certificate_der: bytes,
        local_address: Callable[[], tuple[str, int]],
        *,
        idle_work: int = DEFAULT_IDLE_WORK,
    ) -> None:
        self.endpoint = endpoint
        self.identity = identity
        self._tls = tls_context
        self._certificate = certificate_der
        self._local_address = local_address
        self._idle_target = idle_work
        self.state: RelayLinkState = "connecting"
        self.connects = 0
        self.last_error: str | None = None
        self._attached_at: float | None = None
        self._idle = 0
        self.streams_active = 0
        self.streams_total = 0
        self._draining = False
        self._session_scope: anyio.CancelScope | None = None
        self._streams_group: anyio.abc.TaskGroup | None = None
        # (host, port) of each connection this link opened to the node's own listener: what arrives from
        # them came through the relay, though it comes from loopback (`/metrics` and the node's page
        # must tell them apart).
        self._local_peers: set[tuple[str, int]] = set()

    def is_relayed(self, peer: tuple[str, int]) -> bool:
        """Whether a connection to the node's listener from `peer` carries a relayed stream."""
        return (peer[0], peer[1]) in self._local_peers

    # --- what the node and the tracker link read -------------------------------
    def attachment(self) -> RelayAttachment:
        """What the node's announcement carries so the tracker can reach it here."""
        return RelayAttachment(url=self.endpoint.url, tls_certificate=certificate_text(self._certificate))

    def link_health(self) -> RelayLinkHealth:
        attached_for = time.monotonic() - self._attached_at if self._attached_at is not None else None
        return RelayLinkHealth(
            url=self.endpoint.url,
            state=self.state,
            attached_for_s=attached_for,
            connects=self.connects,
            idle_work=self._idle,
            streams_active=self.streams_active,
            streams_total=self.streams_total,
            last_error=self.last_error,
        )

    def health(self, report: HealthReport) -> HealthReport:
        # With several relays each link adds its own, in the order announced; `relay` stays the first,
        # as a reader that knows one relay expects.
        mine = self.link_health()
        return report.model_copy(update={"relay": report.relay or mine, "relays": [*report.relays, mine]})

    # --- NodePart ------------------------------------------------------------
    async def run(self) -> None:
        backoff = Backoff(RECONNECT_INITIAL_S, RECONNECT_MAX_S)
        # Streams outlive a control reconnect: they have their own connections end to end.
        async with anyio.create_task_group() as streams:
            self._streams_group = streams
            while not self._draining:
                try:
                    with anyio.CancelScope() as scope:
                        self._session_scope = scope
                        await self._session(backoff)
                except Exception as exc:  # noqa: BLE001 - sorted below; anything unexpected is re-raised
                    cause = _first_leaf(exc)
                    if isinstance(cause, RelayRefusedError):
                        self._set_down("refused", str(cause))
                    elif isinstance(cause, _CONNECTION_ENDS):
                        self._set_down("disconnected", f"{type(cause).__name__}: {cause}".rstrip(": "))
                    else:
                        raise
                if self._draining:
                    break
                delay = backoff.next_delay()
                log.warning("relay %s: %s; reconnecting in %.2f s", self.endpoint.url, self.last_error, delay)
                await anyio.sleep(delay)
            self.state = "draining"

    async def drain(self) -> None:
        """No new requests through the relay; streams in flight finish on their own connections."""
        self._draining = True
        self.state = "draining"
        if self._session_scope is not None:
            self._session_scope.cancel()

    async def close(self) -> None:
        if self._streams_group is not None:
            self._streams_group.cancel_scope.cancel()

    # --- the control session ---------------------------------------------------
    async def _session(self, backoff: Backoff) -> None:
        self.state = "connecting"
        stream, buffered, attached = await self._dial("control")
        async with stream:
            self.connects += 1
            self._attached_at = time.monotonic()
            self.state = "attached"
            self.last_error = None
            backoff.reset()
            log.info("attached to relay %s as %s", self.endpoint.url, self.identity.node_id)
            target = min(self._idle_target, attached.max_idle_work)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._ping, stream, attached.ping_interval_s)
                    for _ in range(target):
                        tg.start_soon(self._work_slot)
                    silence_limit = attached.ping_interval_s + attached.ping_timeout_s
                    while True:
                        with anyio.fail_after(silence_limit):
                            line = await receive_line(buffered)
                        message = parse_message(line, RelayPing, RelayRefused)
                        if isinstance(message, RelayRefused):
                            raise RelayRefusedError(message.code, message.message)
            finally:
                self._attached_at = None

    async def _ping(self, stream: ByteStream, interval_s: float) -> None:
        while True:
            await anyio.sleep(interval_s)
            await send_message(stream, RelayPing(type="ping"))

    async def _work_slot(self) -> None:
        """Keep one idle work connection at the relay: dial, wait for a tracker, hand it over, dial again.

        A fixed set of these loops, started with the session, is the whole pool. Nothing spawns a
        connection from outside a slot, so when the session ends its cancellation ends every slot: an
        earlier design that re-dialled on a "pool changed" event could keep re-dialling into the
        cancelled session as fast as failed dials woke it, and the node never reconnected.
        """
        while True:
            await self._work_connection()

    async def _work_connection(self) -> None:
        """Dial one work connection and wait idle until the relay splices a tracker to it.

        Returns once the connection is in use (its TLS handshake and stream go on in the streams group)
        or gone. Built on asyncio transports rather than anyio streams: the event loop's own TLS (C in
        uvloop) and a protocol-level splice cost a tenth of the CPU per relayed chunk.
        """
        writer: asyncio.StreamWriter | None = None
        try:
            with anyio.fail_after(DIAL_TIMEOUT_S):
                writer = await self._open_work()
        except Exception as exc:  # noqa: BLE001 - the control session notices a dead relay; here we only pace
            log.debug("work connection failed: %r", exc)
        if writer is None:
            await anyio.sleep(WORK_RETRY_DELAY_S)
            return
        self._idle += 1
        handed_over = False
        try:
            # Nothing more may be read as plaintext: pause, say `ready`, and let TLS take the socket. The
            # relay splices a ClientHello only after `ready`, so it can only reach the TLS layer.
            transport = writer.transport
            # Probed while idle, so a NAT with a short idle timer keeps its mapping (else the relay splices a
            # tracker to a connection the NAT forgot); a probe that fails ends it, and the slot dials anew.
            keep_alive(transport.get_extra_info("socket"), idle_s=IDLE_WORK_KEEPALIVE_S)
            transport.pause_reading()
            writer.write(message_line(RelayReady()))
            # Idle until the relay forwards a first byte (or drops the connection); renewed after a while.
            with anyio.move_on_after(IDLE_WORK_LIFETIME_S) as idle_wait:
                await _wait_readable(transport)
            if idle_wait.cancelled_caught or self._streams_group is None:
                return
            # Used from here on, whoever sent that byte: the slot dials a replacement now, not after a
            # handshake that a stranger may never finish. A stream whose path goes silent ends within
            # NOTICED_WITHIN_S, which frees its llama-server slot.
            keep_alive(transport.get_extra_info("socket"))
            self._streams_group.start_soon(self._serve_stream, writer)
            handed_over = True
        except Exception as exc:  # noqa: BLE001 - the relay closed an idle connection
            log.debug("idle work connection ended: %r", exc, exc_info=True)
        finally:
            self._idle -= 1
            if not handed_over:
                writer.transport.abort()

    async def _serve_stream(self, writer: asyncio.StreamWriter) -> None:
        """Take TLS over the work connection a tracker (or a stranger) started using, then splice it to the proxy."""
        # `writer` is held until the stream ends: a collected StreamWriter closes the socket under the TLS layer.
        tls_side = _Pipe()
        ssl_transport: asyncio.BaseTransport | None = None
        local_side: _Pipe | None = None
        peer: tuple[str, int] | None = None
        try:
            try:
                ssl_transport = await asyncio.get_running_loop().start_tls(
                    writer.transport, tls_side, self._tls, server_side=True, ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S
                )
            except Exception as exc:  # noqa: BLE001 - a handshake that failed or never came ends only this connection
                log.debug("relayed handshake failed: %r", exc, exc_info=True)
                return
            # start_tls does not call connection_made: the app protocol learns its transport here.
            tls_side.transport = ssl_transport  # type: ignore[assignment]
            ssl_transport.pause_reading()  # type: ignore[attr-defined]  # until the local side is connected
            self.streams_active += 1
            self.streams_total += 1
            try:
                host, port = self._local_address()
                _, local_side = await asyncio.get_running_loop().create_connection(_Pipe, host, port)
                sockname = local_side.transport.get_extra_info("sockname") if local_side.transport else None
                if sockname:
                    peer = (str(sockname[0]), int(sockname[1]))
                    self._local_peers.add(peer)
                _Pipe.join(tls_side, local_side)
                await tls_side.closed
                await local_side.closed
            except Exception as exc:  # noqa: BLE001 - one stream's failure never touches another
                log.debug("relayed stream ended: %r", exc, exc_info=True)
            finally:
                self.streams_active -= 1
        finally:
            if peer is not None:
                self._local_peers.discard(peer)
            if ssl_transport is not None:
                ssl_transport.close()
            else:
                writer.transport.abort()
            del writer
            if local_side is not None and local_side.transport is not None:
                local_side.transport.close()

    async def _open_work(self) -> asyncio.StreamWriter:
        """A work connection, upgraded and attached, on asyncio streams; the reader holds nothing unread."""
        ep = self.endpoint
        reader, writer = await asyncio.open_connection(
            ep.host, ep.port, ssl=ssl.create_default_context() if ep.tls else None, limit=MAX_RELAY_MESSAGE_BYTES
        )
        try:
            writer.write(upgrade_request(ep.host, ep.port))
            refusal = upgrade_refusal(await reader.readuntil(HEAD_END))
            if refusal is not None:
                raise RelayProtocolError(refusal)
            challenge = parse_message(await read_line(reader), RelayChallenge)
            writer.write(message_line(self._attach_message("work", challenge.nonce)))
            answer_message = parse_message(await read_line(reader), RelayAttached, RelayRefused)
            if isinstance(answer_message, RelayRefused):
                raise RelayRefusedError(answer_message.code, answer_message.message)
        except BaseException:
            writer.transport.abort()
            raise
        return writer

    # --- dialling --------------------------------------------------------------
    async def _dial(self, role: RelayRole) -> tuple[StapledByteStream, BufferedByteReceiveStream, RelayAttached]:
        ep = self.endpoint
        with anyio.fail_after(DIAL_TIMEOUT_S):
            raw = await anyio.connect_tcp(ep.host, ep.port)
            # A NAT that forgets the mapping drops the tunnel without a word: the kernel's probes notice it
            # within NOTICED_WITHIN_S (the pings alone took interval + timeout, 20 s).
            keep_alive(raw.extra(SocketAttribute.raw_socket))
            transport: ByteStream = raw
            try:
                if ep.tls:
                    transport = await TLSStream.wrap(raw, hostname=ep.host, ssl_context=ssl.create_default_context())
                buffered = BufferedByteReceiveStream(transport)
                stream = StapledByteStream(transport, buffered)
                await transport.send(upgrade_request(ep.host, ep.port))
                refusal = upgrade_refusal(await buffered.receive_until(HEAD_END, MAX_RELAY_HEAD_BYTES))
                if refusal is not None:
                    raise RelayProtocolError(refusal)
                challenge = parse_message(await receive_line(buffered), RelayChallenge)
                await send_message(stream, self._attach_message(role, challenge.nonce))
                answer_message = parse_message(await receive_line(buffered), RelayAttached, RelayRefused)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await transport.aclose()
                raise
        if isinstance(answer_message, RelayRefused):
            await stream.aclose()
            raise RelayRefusedError(answer_message.code, answer_message.message)
        return stream, buffered, answer_message

    def _attach_message(self, role: RelayRole, nonce: str) -> RelayAttach:
        now = int(time.time())
        claims = RelayAttachClaims(
            iss=self.identity.node_id, aud=relay_audience(self.endpoint.url), nonce=nonce, role=role,
            iat=now, exp=now + RELAY_PROOF_LIFETIME_S,
        )  # fmt: skip
        return RelayAttach(
            role=role,
            node_id=self.identity.node_id,
            public_key=self.identity.public_key_text,
            proof=encode_token(claims.model_dump(), self.identity.private_key),
        )

    def _set_down(self, state: RelayLinkState, error: str) -> None:
        self.state = state
        self.last_error = error


# How a session with the relay ends other than by a refusal: the link reconnects after any of them.
_CONNECTION_ENDS = (
    OSError, TimeoutError, ssl.SSLError, RelayProtocolError, RelayFramingError, anyio.BrokenResourceError,
    anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError,
)  # fmt: skip


def _first_leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups from task groups."""
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:  # type: ignore[attr-defined]
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return exc


class _Pipe(asyncio.Protocol):
    """One side of a splice at the transport level: what it receives, its peer writes.

    Backpressure passes through: when a side's write buffer fills, its peer stops reading.
    When either side ends, both close (after their buffered bytes are written).
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self._pending: list[bytes] = []
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @staticmethod
    def join(a: _Pipe, b: _Pipe) -> None:
        a.peer, b.peer = b, a
        for side in (a, b):
            for data in side._pending:
                side.peer.transport.write(data)  # type: ignore[union-attr]
            side._pending.clear()
            if side.transport is not None and not side.transport.is_closing():
                side.transport.resume_reading()
        for side in (a, b):
            if side.closed.done():
                side._close_both()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.peer is None or self.peer.transport is None:
            self._pending.append(data)  # bytes that came before the other side was connected
            if self.transport is not None:
                self.transport.pause_reading()
            return
        self.peer.transport.write(data)

    def eof_received(self) -> bool:
        self._close_both()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        self._close_both()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None and not self.peer.transport.is_closing():
            self.peer.transport.resume_reading()

    def _close_both(self) -> None:
        for side in (self, self.peer):
            if side is not None and side.transport is not None:
                side.transport.close()


async def _wait_readable(transport: asyncio.BaseTransport) -> None:
    """Wait until the peer sends a byte (or closes) without reading it, so the TLS layer reads it all.

    The transport owns its descriptor in the event loop; a duplicate of it is watched instead.
    """
    own = transport.get_extra_info("socket")
    watcher = socket.socket(fileno=os.dup(own.fileno()))
    try:
        await anyio.wait_readable(watcher)
    finally:
        watcher.close()


async def probe_relay(endpoint: RelayEndpoint, identity: NodeIdentity) -> bool:
    """Attach one work connection and let it go: True when the node's tunnel is up, False when the relay
    verified the key but holds no tunnel for it. Raises what dialling raises otherwise."""
    link = RelayLink(endpoint, identity, ssl.create_default_context(), b"", lambda: ("127.0.0.1", 0))
    try:
        stream, _, _ = await link._dial("work")
    except RelayRefusedError as exc:
        if exc.code == "no_control_channel":  # refused only after the proof checked out
            return False
        raise
    except RelayFramingError as exc:  # the relay's lines made no sense: as for any answer this node does not understand
        raise RelayProtocolError(str(exc)) from None
    await stream.aclose()
    return True


def build_relay_link(relay_url: str, identity: NodeIdentity, state_dir: Path, local_address: Callable[[], tuple[str, int]]) -> RelayLink:
    """The one constructor the node calls: the node's identity (loaded once by the node), its
    certificate written beside the key in the state dir."""
    endpoint = RelayEndpoint.parse(relay_url)
    state_dir = Path(state_dir)
    der = node_certificate(identity.private_key)
    cert_path = state_dir / NODE_TLS_CERT_FILE
    pem = certificate_pem(der)
    if not cert_path.exists() or cert_path.read_bytes() != pem:
        tmp = cert_path.with_name(f".{cert_path.name}.tmp")
        tmp.write_bytes(pem)
        tmp.replace(cert_path)
    context = server_context(str(cert_path), str(state_dir / NODE_KEY_FILE))
    return RelayLink(endpoint, identity, context, der, local_address)


def local_address_for(host: str, port: int) -> Callable[[], tuple[str, int]]:
    """Where the relayed bytes go: the node's own listener, on loopback when it listens on every address."""
    target = wildcard_loopback(host) or host
    return lambda: (target, port)


__all__ = ["RelayEndpoint", "RelayLink", "RelayProtocolError", "RelayRefusedError", "build_relay_link", "local_address_for", "probe_relay"]
