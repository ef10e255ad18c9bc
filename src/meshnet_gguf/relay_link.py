"""The node's tunnel to a relay: serve from behind NAT with no public listener.

A part of the running node (`NodePart`). It dials the relay (never the other
way round) and keeps there:

- one **control connection**: it proves the node key by signing the relay's
  challenge, then pings; a relay silent for ping interval + timeout is dead,
  and the link reconnects with backoff and jitter;
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

import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import anyio
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.stapled import StapledByteStream
from anyio.streams.tls import TLSStream
from pydantic import BaseModel, ValidationError

from meshnet_gguf.identity import NODE_KEY_FILE, NodeIdentity
from meshnet_gguf.node_part import BasePart
from meshnet_gguf.node_tls import certificate_pem, certificate_text, node_certificate, server_context
from meshnet_gguf.protocol import (
    MAX_RELAY_HEAD_BYTES,
    MAX_RELAY_MESSAGE_BYTES,
    RELAY_ATTACH_AUDIENCE,
    RELAY_PROOF_LIFETIME_S,
    RELAY_TUNNEL_PATH,
    RELAY_UPGRADE_PROTOCOL,
    HealthReport,
    RelayAttach,
    RelayAttachClaims,
    RelayAttached,
    RelayAttachment,
    RelayChallenge,
    RelayLinkHealth,
    RelayLinkState,
    RelayPing,
    RelayRefused,
    RelayRole,
)
from meshnet_gguf.retry import Backoff
from meshnet_gguf.signing import encode_token

log = logging.getLogger(__name__)

NODE_TLS_CERT_FILE = "node_tls_cert.pem"
# Reconnect soon (a restarted relay is back within a second or two) but never spin; the cap
# keeps a node's return within a few seconds of the relay's, and jitter spreads a fleet.
RECONNECT_INITIAL_S = 0.25
RECONNECT_MAX_S = 4.0
# Dialling the relay and its upgrade answer: any network that can carry inference does this quickly.
DIAL_TIMEOUT_S = 10.0
# Idle work connections the node keeps at the relay (the relay may ask for fewer).
DEFAULT_IDLE_WORK = 8
# A work connection that failed to attach is not retried faster than this, so a refusing relay is not hammered.
WORK_RETRY_DELAY_S = 0.5
# The TLS handshake of a work connection in use; the tracker starts it at once after CONNECT.
TLS_HANDSHAKE_TIMEOUT_S = 10.0
SPLICE_CHUNK_BYTES = 64 * 1024


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
        self._dialing = 0
        self.streams_active = 0
        self.streams_total = 0
        self._pool_changed = anyio.Event()
        self._draining = False
        self._session_scope: anyio.CancelScope | None = None
        self._streams_group: anyio.abc.TaskGroup | None = None

    # --- what the node and the mesh link read -------------------------------
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
        return report.model_copy(update={"relay": self.link_health()})

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
                    tg.start_soon(self._keep_pool, tg, target)
                    silence_limit = attached.ping_interval_s + attached.ping_timeout_s
                    while True:
                        with anyio.fail_after(silence_limit):
                            line = await _receive_line(buffered)
                        message = _parse_line(line, RelayPing, RelayRefused)
                        if isinstance(message, RelayRefused):
                            raise RelayRefusedError(message.code, message.message)
            finally:
                self._attached_at = None

    async def _ping(self, stream: ByteStream, interval_s: float) -> None:
        while True:
            await anyio.sleep(interval_s)
            await _send(stream, RelayPing(type="ping"))

    async def _keep_pool(self, tg: anyio.abc.TaskGroup, target: int) -> None:
        while True:
            while self._idle + self._dialing < target:
                self._dialing += 1
                tg.start_soon(self._work_connection)
            changed = self._pool_changed
            await changed.wait()

    def _pool_change(self) -> None:
        self._pool_changed.set()
        self._pool_changed = anyio.Event()

    async def _work_connection(self) -> None:
        """Dial one work connection, wait idle until the relay splices a tracker to it, then serve that."""
        dialed = False
        try:
            stream, _buffered, _ = await self._dial("work")
            dialed = True
        except Exception as exc:  # noqa: BLE001 - the control session notices a dead relay; here we only pace
            log.debug("work connection failed: %r", exc)
            await anyio.sleep(WORK_RETRY_DELAY_S)
        finally:
            # Also when cancelled with the session: the counts must stay true for the next one.
            self._dialing -= 1
            if not dialed:
                self._pool_change()
        if not dialed:
            return
        self._idle += 1
        in_use = False

        def now_in_use() -> None:
            nonlocal in_use
            in_use = True
            self._idle -= 1
            self.streams_active += 1
            self.streams_total += 1
            self._pool_change()

        try:
            if self._streams_group is None:
                return
            # Idle until the tracker's ClientHello arrives; the stream then lives in the streams group,
            # beyond this control session.
            first = await stream.receive(SPLICE_CHUNK_BYTES)
            now_in_use()
            self._streams_group.start_soon(self._serve_stream, stream, first)
            stream = None  # handed over
        except Exception:  # noqa: BLE001 - the relay closed an idle connection
            pass
        finally:
            if not in_use:
                self._idle -= 1
                self._pool_change()
            if stream is not None:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()

    async def _serve_stream(self, stream: StapledByteStream, first: bytes) -> None:
        try:
            replay = StapledByteStream(stream.send_stream, _Prepended(first, stream.receive_stream))
            with anyio.fail_after(TLS_HANDSHAKE_TIMEOUT_S):
                tls = await TLSStream.wrap(replay, server_side=True, ssl_context=self._tls, standard_compatible=False)
            host, port = self._local_address()
            local = await anyio.connect_tcp(host, port)
            await _splice(tls, local)
        except Exception as exc:  # noqa: BLE001 - one stream's failure never touches another
            log.debug("relayed stream ended: %r", exc)
        finally:
            self.streams_active -= 1
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    # --- dialling --------------------------------------------------------------
    async def _dial(self, role: RelayRole) -> tuple[StapledByteStream, BufferedByteReceiveStream, RelayAttached]:
        ep = self.endpoint
        with anyio.fail_after(DIAL_TIMEOUT_S):
            raw = await anyio.connect_tcp(ep.host, ep.port)
            transport: ByteStream = raw
            try:
                if ep.tls:
                    transport = await TLSStream.wrap(raw, hostname=ep.host, ssl_context=ssl.create_default_context())
                buffered = BufferedByteReceiveStream(transport)
                stream = StapledByteStream(transport, buffered)
                head = (
                    f"GET {RELAY_TUNNEL_PATH} HTTP/1.1\r\nHost: {ep.host}:{ep.port}\r\n"
                    f"Connection: Upgrade\r\nUpgrade: {RELAY_UPGRADE_PROTOCOL}\r\n\r\n"
                )
                await transport.send(head.encode("latin-1"))
                answer = await buffered.receive_until(b"\r\n\r\n", MAX_RELAY_HEAD_BYTES)
                status_line = answer.split(b"\r\n", 1)[0].decode("latin-1", "replace")
                if not status_line.startswith("HTTP/1.1 101"):
                    raise RelayProtocolError(f"relay did not upgrade the tunnel: {status_line!r}")
                challenge = _parse_line(await _receive_line(buffered), RelayChallenge)
                await _send(stream, self._attach_message(role, challenge.nonce))
                answer_message = _parse_line(await _receive_line(buffered), RelayAttached, RelayRefused)
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
            iss=self.identity.node_id, aud=RELAY_ATTACH_AUDIENCE, nonce=nonce, role=role,
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
    OSError, TimeoutError, ssl.SSLError, RelayProtocolError, anyio.BrokenResourceError, anyio.EndOfStream,
    anyio.IncompleteRead, anyio.ClosedResourceError,
)  # fmt: skip


def _first_leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups from task groups."""
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:  # type: ignore[attr-defined]
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return exc


class _Prepended(anyio.abc.ByteReceiveStream):
    """A receive stream that first yields bytes already read from it."""

    def __init__(self, first: bytes, rest: anyio.abc.ByteReceiveStream) -> None:
        self._first: bytes | None = first
        self._rest = rest

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._first:
            chunk, self._first = self._first[:max_bytes], self._first[max_bytes:] or None
            return chunk
        return await self._rest.receive(max_bytes)

    async def aclose(self) -> None:
        await self._rest.aclose()


async def _splice(a: ByteStream, b: ByteStream) -> None:
    """Copy both ways as bytes arrive, until either side ends; then close both."""
    async with anyio.create_task_group() as tg:

        async def pump(source: ByteStream, sink: ByteStream) -> None:
            try:
                while True:
                    await sink.send(await source.receive(SPLICE_CHUNK_BYTES))
            except Exception:  # noqa: BLE001 - EOF, reset or a closed peer: the stream is over
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(pump, a, b)
        tg.start_soon(pump, b, a)
    with anyio.CancelScope(shield=True):
        for side in (a, b):
            try:
                await side.aclose()
            except Exception:  # noqa: BLE001
                pass


async def _receive_line(buffered: BufferedByteReceiveStream) -> bytes:
    try:
        return await buffered.receive_until(b"\n", MAX_RELAY_MESSAGE_BYTES)
    except anyio.DelimiterNotFound:
        raise RelayProtocolError(f"relay sent a message over {MAX_RELAY_MESSAGE_BYTES} bytes") from None


def _parse_line(line: bytes, *models: type[BaseModel]) -> BaseModel:  # type: ignore[return]
    for model in models:
        try:
            return model.model_validate_json(line)
        except ValidationError:
            continue
    raise RelayProtocolError(f"unexpected relay message (wanted {' or '.join(m.__name__ for m in models)})")


async def _send(stream: ByteStream, message: BaseModel) -> None:
    await stream.send(message.model_dump_json().encode() + b"\n")


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
    await stream.aclose()
    return True


def build_relay_link(relay_url: str, state_dir: Path, local_address: Callable[[], tuple[str, int]]) -> RelayLink:
    """The one constructor the node calls: identity from the state dir, certificate written beside the key."""
    endpoint = RelayEndpoint.parse(relay_url)
    state_dir = Path(state_dir)
    identity = NodeIdentity.load_or_create(state_dir)
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
    target = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    return lambda: (target, port)


__all__ = ["RelayEndpoint", "RelayLink", "RelayProtocolError", "RelayRefusedError", "build_relay_link", "local_address_for", "probe_relay"]
