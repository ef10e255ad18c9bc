"""Reference Meshnet relay: nodes behind NAT dial out to it; trackers reach them through it.

One TCP port, two kinds of visitor (docs/protocol.md, "Relay"):

- a node upgrades connections with `GET /v1/relay/tunnel` + `Upgrade: meshnet-relay/1`,
  proves its Ed25519 key by signing a fresh challenge, and attaches either its
  control connection (one per node: liveness pings, the tunnel's identity) or
  an idle work connection (a small pool, dialled ahead of demand);
- a tracker sends `CONNECT <node_id>:443`; the relay answers 200 and splices
  that connection to one idle work connection of the node, byte for byte, until
  either side closes. Inside, the tracker speaks TLS with the node, so the relay
  forwards bytes it can neither read nor change unnoticed.

It never parses, buffers or logs what passes through a splice. It speaks only
the shared contract (`meshnet_gguf.contract.protocol`, `meshnet_gguf.contract.signing`).
Run it with `meshnet-gguf dev relay`.
"""

from __future__ import annotations

import errno
import json
import logging
import secrets
import socket
import ssl
import struct
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import anyio
import h11
import jwt
from anyio.abc import ByteStream, SocketStream, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.stapled import StapledByteStream
from anyio.streams.tls import TLSStream
from pydantic import BaseModel, ValidationError

from meshnet_gguf.contract.errors import openai_error_body
from meshnet_gguf.contract.protocol import (
    CLOCK_SKEW_S,
    MAX_RELAY_CONNECT_TOKEN_LIFETIME_S,
    MAX_RELAY_HEAD_BYTES,
    MAX_RELAY_MESSAGE_BYTES,
    RELAY_CONNECT_AUTH_SCHEME,
    RELAY_PING_INTERVAL_S,
    RELAY_PING_TIMEOUT_S,
    RELAY_PROOF_LIFETIME_S,
    RELAY_TUNNEL_PATH,
    RELAY_UPGRADE_PROTOCOL,
    RelayAttach,
    RelayAttached,
    RelayChallenge,
    RelayPing,
    RelayReady,
    RelayRefused,
    relay_audience,
)
from meshnet_gguf.contract.signing import KeyFormatError, decode_token, node_id_for, parse_public_key, tracker_issuer_for

log = logging.getLogger(__name__)

# Idle work connections kept per node: enough for a burst of requests to start without a
# round trip to the node; each costs one socket and ~2 kB here.
DEFAULT_MAX_IDLE_WORK = 16
# A CONNECT that finds no idle work connection waits this long for the node to dial one.
WORK_WAIT_TIMEOUT_S = 5.0
# A node must finish the upgrade and its attach proof in this time, or it is cut off.
HANDSHAKE_TIMEOUT_S = 10.0
# Bounds the relay's memory: one tunnel holds a control connection and up to DEFAULT_MAX_IDLE_WORK sockets.
DEFAULT_MAX_TUNNELS = 10_000
# Bytes read per splice step: one TLS record is at most ~16 kB, so a read carries a few.
SPLICE_CHUNK_BYTES = 64 * 1024
# Connections still in their head or attach handshake (nothing proved yet), per source address and in
# all: each may take HANDSHAKE_TIMEOUT_S, so without a bound a stranger holds every descriptor the relay has.
DEFAULT_MAX_PENDING_PER_PEER = 64
DEFAULT_MAX_PENDING = 2048
# accept() failing for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM): the relay keeps
# serving what it holds and tries again after this pause, rather than spinning or exiting.
ACCEPT_BACKOFF_S = 0.1
# A tunnel is provisional until a trusted tracker CONNECTs to its node with a signed token, which a
# tracker does only for a node that presented its enrolment secret and signed registration (its control
# proof goes through the tunnel). Provisional tunnels are few and short-lived: a stranger's fresh keys
# can hold at most this many, each for at most the window, and never a slot among the admitted.
DEFAULT_MAX_PROVISIONAL_TUNNELS = 256
ADMISSION_WINDOW_S = 60.0
# New control connections per source address: a node reconnects a few times a minute at worst; a
# NAT with many nodes behind it gets the burst.
TUNNEL_ATTACHES_PER_S = 2.0
TUNNEL_ATTACH_BURST = 20
# Source addresses whose rate is remembered; past this, the ones with full buckets are forgotten.
MAX_RATE_LIMITED_PEERS = 100_000
# Connections that have proved nothing, per source address, as a token bucket taken at accept and given back
# when the connection proves itself (an authorised CONNECT, an attached tunnel or work connection). A source
# whose strangers keep failing runs dry, and its next connections are reset at accept: no task, no parse, no
# answer. The burst matches the per-address pending bound, so a tracker or a node, whose connections prove
# themselves, never meets it before that bound; a stranger gets this many tries a second once its burst is spent.
STRANGER_CONNECTIONS_PER_S = 8.0
STRANGER_CONNECTION_BURST = DEFAULT_MAX_PENDING_PER_PEER
# Connections taken from the listen backlog per wake-up, before the loop serves the splices again. Small: under a
# flood each wake-up is one short turn of the event loop, so an established splice waits behind a few accepts
# rather than a long batch (measured: 64 left a warm honest stream's first byte about 3x slower, 8 about 2x).
ACCEPT_BATCH = 8
# A refusal logged under a flood: one line per kind per interval, with the count of those held back.
REFUSAL_LOG_INTERVAL_S = 10.0
_ACCEPT_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True)
class RelayConfig:
    host: str = "127.0.0.1"
    port: int = 8001
    ping_interval_s: float = RELAY_PING_INTERVAL_S
    ping_timeout_s: float = RELAY_PING_TIMEOUT_S
    max_idle_work: int = DEFAULT_MAX_IDLE_WORK
    work_wait_timeout_s: float = WORK_WAIT_TIMEOUT_S
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    max_tunnels: int = DEFAULT_MAX_TUNNELS
    max_pending_per_peer: int = DEFAULT_MAX_PENDING_PER_PEER
    max_pending: int = DEFAULT_MAX_PENDING
    # Public keys (base64url) of the trackers whose CONNECT tokens this relay honours. Empty: an open
    # relay (local experiments): CONNECT needs no token and every tunnel is admitted at once.
    trusted_tracker_keys: tuple[str, ...] = ()
    # The URL nodes and trackers know this relay by (the audience of their tokens) [default: http://host:port].
    public_url: str | None = None
    max_provisional_tunnels: int = DEFAULT_MAX_PROVISIONAL_TUNNELS
    admission_window_s: float = ADMISSION_WINDOW_S
    tunnel_attaches_per_s: float = TUNNEL_ATTACHES_PER_S
    tunnel_attach_burst: int = TUNNEL_ATTACH_BURST
    stranger_connections_per_s: float = STRANGER_CONNECTIONS_PER_S
    stranger_connection_burst: int = STRANGER_CONNECTION_BURST
    # Serve https: a certificate chain (PEM) for the relay's host name and its key. Nodes and trackers check it
    # against the name in the relay's URL.
    tls_certificate_file: str | None = None
    tls_key_file: str | None = None


class _Refusal(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(eq=False)
class _ParkedWork:
    """An idle work connection, waiting to be spliced to a tracker's CONNECT."""

    stream: ByteStream
    peer: ByteStream | None = None
    assigned: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)
    # Cancelled to end the idle wait: by a CONNECT that takes this connection (peer set) or by the
    # tunnel closing (peer left None). One scope, no extra task per idle connection.
    idle_scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)

    def assign(self, peer: ByteStream) -> None:
        self.peer = peer
        self.assigned.set()
        self.idle_scope.cancel()


@dataclass(eq=False)
class _Tunnel:
    node_id: str
    public_key: str
    attached_at: float = field(default_factory=time.monotonic)
    idle: deque[_ParkedWork] = field(default_factory=deque)
    closed: anyio.Event = field(default_factory=anyio.Event)
    streams_active: int = 0
    streams_total: int = 0
    admitted: anyio.Event = field(default_factory=anyio.Event)
    _arrival: anyio.Event = field(default_factory=anyio.Event)

    def park(self, work: _ParkedWork) -> None:
        self.idle.append(work)
        self._arrival.set()
        self._arrival = anyio.Event()

    def unpark(self, work: _ParkedWork) -> bool:
        try:
            self.idle.remove(work)
        except ValueError:
            return False
        return True

    async def take_work(self, timeout_s: float) -> _ParkedWork | None:
        deadline = time.monotonic() + timeout_s
        while not self.closed.is_set():
            if self.idle:
                return self.idle.popleft()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            arrival = self._arrival
            with anyio.move_on_after(remaining):
                await arrival.wait()
        return None

    def close(self) -> None:
        self.closed.set()
        self._arrival.set()
        while self.idle:
            work = self.idle.popleft()
            work.assigned.set()  # with no peer: the idle connection just ends
            work.idle_scope.cancel()


class _Pending:
    """Counts connections that have proved nothing yet, per source address and in all."""

    def __init__(self, per_peer: int, total: int) -> None:
        self.per_peer, self.total = per_peer, total
        self.by_peer: dict[str, int] = {}
        self.count = 0

    def enter(self, peer: str) -> bool:
        if self.count >= self.total or self.by_peer.get(peer, 0) >= self.per_peer:
            return False
        self.count += 1
        self.by_peer[peer] = self.by_peer.get(peer, 0) + 1
        return True

    def leave(self, peer: str) -> None:
        self.count -= 1
        left = self.by_peer[peer] - 1
        if left:
            self.by_peer[peer] = left
        else:
            del self.by_peer[peer]  # the map holds only peers with a connection pending: it cannot grow without bound


@dataclass(eq=False)
class _PendingSlot:
    """One connection's place among the pending; given back once, when it has proved itself or ended."""

    pending: _Pending
    peer: str
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.pending.leave(self.peer)


class _RateLimit:
    """A token bucket per source address, with a bounded memory of addresses."""

    def __init__(self, per_s: float, burst: int) -> None:
        self.per_s, self.burst = per_s, burst
        self._buckets: dict[str, tuple[float, float]] = {}

    def allow(self, peer: str) -> bool:
        now = time.monotonic()
        tokens, at = self._buckets.get(peer, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.per_s)
        if tokens < 1:
            self._buckets[peer] = (tokens, now)
            return False
        self._buckets[peer] = (tokens - 1, now)
        if len(self._buckets) > MAX_RATE_LIMITED_PEERS:
            refill_s = self.burst / self.per_s
            self._buckets = {p: (n, a) for p, (n, a) in self._buckets.items() if now - a < refill_s}
        return True

    def give_back(self, peer: str) -> None:
        """Returns the token `allow` took, to a peer whose attempt turned out to be a fair one."""
        bucket = self._buckets.get(peer)
        if bucket is not None:
            self._buckets[peer] = (min(float(self.burst), bucket[0] + 1), bucket[1])


class _RefusalLog:
    """Logs refusals of one kind at most once per interval, with the number held back since: a flood of
    strangers must not become a flood of log lines (each costs the event loop the honest splices run on)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def log(self, level: int, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.interval_s) < self.interval_s:
            self._held[kind] += 1
            return
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        if held:
            message += " (and %d more refused so since the last such line)"
            args = (*args, held)
        log.log(level, message, *args)


class Relay:
    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.tunnels: dict[str, _Tunnel] = {}
        self.port: int | None = None
        self.pending = _Pending(config.max_pending_per_peer, config.max_pending)
        self.accept_errors = 0
        self.attach_rate = _RateLimit(config.tunnel_attaches_per_s, config.tunnel_attach_burst)
        self.stranger_rate = _RateLimit(config.stranger_connections_per_s, config.stranger_connection_burst)
        self.reset_at_accept = 0
        self._refusals = _RefusalLog(REFUSAL_LOG_INTERVAL_S)
        self._trackers = [(tracker_issuer_for(key), key) for key in map(parse_public_key, config.trusted_tracker_keys)]
        self._connect_tokens_seen: dict[str, float] = {}  # jti -> expiry: each token opens one connection
        # Tokens used before a restart are forgotten with it: a token issued before this second is refused, so
        # one captured earlier cannot be replayed now (a tracker's clock behind ours costs a retry, not a hole).
        self._started_s = int(time.time())
        self._tls: ssl.SSLContext | None = None
        if config.tls_certificate_file:
            self._tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._tls.load_cert_chain(config.tls_certificate_file, config.tls_key_file)

    @property
    def url(self) -> str:
        """The relay's name in the tokens meant for it."""
        scheme = "https" if self.config.tls_certificate_file else "http"
        return relay_audience(self.config.public_url or f"{scheme}://{self.config.host}:{self.port or self.config.port}")

    @property
    def open(self) -> bool:
        return not self._trackers

    # --- serving ------------------------------------------------------------
    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host=self.config.host, local_port=self.config.port)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        log.info("relay listening on %s:%s as %s", self.config.host, self.port, self.url)
        if self.open:
            log.warning("no tracker key trusted: CONNECT needs no token and every tunnel is admitted (an open relay)")
        task_status.started(self.port)
        async with listener, anyio.create_task_group() as tg:
            for one in listener.listeners:
                tg.start_soon(self._accept_loop, one, tg)

    async def _accept_loop(self, listener: anyio.abc.Listener[SocketStream], tg: anyio.abc.TaskGroup) -> None:
        # Accepts on the listening socket itself, so that a source out of stranger tokens is reset before the
        # relay spends a task, a transport or a byte of parsing on it.
        sock: socket.socket = listener.extra(anyio.abc.SocketAttribute.raw_socket)
        while True:
            await anyio.wait_readable(sock)
            for _ in range(ACCEPT_BATCH):  # then back to waiting: a full backlog must not keep the splices waiting
                try:
                    client, address = sock.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    if exc.errno not in _ACCEPT_RESOURCE_ERRORS:
                        raise
                    self.accept_errors += 1
                    if self.accept_errors == 1 or self.accept_errors % 1000 == 0:
                        log.warning("accept failed (%s, %d times so far); serving the tunnels held, retrying", exc.strerror, self.accept_errors)
                    await anyio.sleep(ACCEPT_BACKOFF_S)
                    break
                peer = str(address[0]) if isinstance(address, tuple) and address else "?"
                if not self.stranger_rate.allow(peer):
                    self.reset_at_accept += 1
                    self._refusals.log(logging.WARNING, "reset_at_accept", "%s: too many connections that proved nothing; reset at accept", peer)
                    _reset(client)
                    continue
                tg.start_soon(self._handle, client, peer)

    def stats(self) -> dict[str, int]:
        tunnels = list(self.tunnels.values())
        return {
            "tunnels": len(tunnels),
            "provisional": sum(not t.admitted.is_set() for t in tunnels),
            "idle_work": sum(len(t.idle) for t in tunnels),
            "streams_active": sum(t.streams_active for t in tunnels),
            "streams_total": sum(t.streams_total for t in tunnels),
        }

    async def _handle(self, client: socket.socket, peer: str) -> None:
        # The listener's task group must never see an exception: one bad peer cannot stop the relay.
        try:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socket_stream = await SocketStream.from_socket(client)
        except Exception as exc:  # noqa: BLE001 - already gone
            client.close()
            log.debug("connection ended: %r", exc)
            return
        try:
            async with socket_stream:
                if not self.pending.enter(peer):
                    # Said and closed at once: the answer fits any socket buffer, so a full one costs nothing here.
                    with anyio.move_on_after(0):
                        await socket_stream.send(_http_error(503, "too_many_pending", "too many unfinished connections; retry later"))
                    return
                slot = _PendingSlot(self.pending, peer)
                try:
                    raw: ByteStream = socket_stream
                    if self._tls is not None:
                        with anyio.fail_after(self.config.handshake_timeout_s):
                            raw = await TLSStream.wrap(socket_stream, server_side=True, ssl_context=self._tls, standard_compatible=False)
                    buffered = BufferedByteReceiveStream(raw)
                    await self._dispatch(raw, buffered, StapledByteStream(raw, buffered), slot)
                finally:
                    slot.release()
        except Exception as exc:  # noqa: BLE001 - a peer's failure is logged, never raised
            log.debug("connection ended: %r", exc)

    async def _dispatch(
        self, raw: ByteStream, buffered: BufferedByteReceiveStream, stream: StapledByteStream, slot: _PendingSlot
    ) -> None:
        try:
            with anyio.fail_after(self.config.handshake_timeout_s):
                head = await buffered.receive_until(b"\r\n\r\n", MAX_RELAY_HEAD_BYTES)
        except anyio.DelimiterNotFound:
            await raw.send(_http_error(431, "head_too_large", f"request head exceeds {MAX_RELAY_HEAD_BYTES} bytes"))
            return
        parser = h11.Connection(h11.SERVER)
        parser.receive_data(head + b"\r\n\r\n")
        try:
            request = parser.next_event()
        except h11.RemoteProtocolError as exc:
            await raw.send(_http_error(400, "bad_request", f"not an HTTP/1.1 request: {exc}"))
            return
        if not isinstance(request, h11.Request):
            await raw.send(_http_error(400, "bad_request", "not an HTTP/1.1 request"))
            return
        method, target = request.method.decode("latin-1"), request.target.decode("latin-1")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        if method == "CONNECT":
            try:
                self._authorise_connect(target, headers.get("proxy-authorization", ""))
            except _Refusal as refusal:
                self._refusals.log(logging.INFO, refusal.code, "CONNECT %s refused: %s", target, refusal.message)
                await raw.send(_http_error(407, refusal.code, refusal.message, extra=f"Proxy-Authenticate: {RELAY_CONNECT_AUTH_SCHEME}\r\n"))
                return
            slot.release()
            self.stranger_rate.give_back(slot.peer)  # at once: a tracker's long streams must not drain its bucket
            await self._connect(target, raw, stream)
        elif method == "GET" and target == RELAY_TUNNEL_PATH:
            if headers.get("upgrade", "").lower() != RELAY_UPGRADE_PROTOCOL:
                await raw.send(_http_error(426, "upgrade_required", f"upgrade to {RELAY_UPGRADE_PROTOCOL}"))
                return
            await raw.send(
                b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                + f"Upgrade: {RELAY_UPGRADE_PROTOCOL}\r\n\r\n".encode("latin-1")
            )
            await self._attach(stream, buffered, slot)
        elif method == "GET" and target == "/health":
            body = json.dumps({"status": "ok", **self.stats()}).encode()
            await raw.send(_http_response(200, body))
        else:
            await raw.send(_http_error(404, "not_found", f"{method} {target}: the relay serves CONNECT and {RELAY_TUNNEL_PATH}"))

    # --- tracker side ----------------------------------------------------------
    def _authorise_connect(self, target: str, authorization: str) -> None:
        """A CONNECT must carry a fresh token from a trusted tracker for this relay and this node, used once."""
        if self.open:
            return
        scheme, _, token = authorization.partition(" ")
        if scheme != RELAY_CONNECT_AUTH_SCHEME or not token:
            raise _Refusal("connect_unauthorised", f"CONNECT needs Proxy-Authorization: {RELAY_CONNECT_AUTH_SCHEME} <tracker token>")
        node_id = target.rsplit(":", 1)[0]
        for issuer, key in self._trackers:
            try:
                claims = decode_token(
                    token.strip(), key, required=["iss", "aud", "sub", "jti", "iat", "exp"],
                    leeway=CLOCK_SKEW_S, issuer=issuer, audience=self.url,
                )  # fmt: skip
            except jwt.InvalidSignatureError:
                continue  # another trusted tracker's, maybe
            except jwt.InvalidTokenError as exc:
                raise _Refusal("connect_unauthorised", f"CONNECT token refused: {exc}") from None
            if claims["sub"] != node_id:
                raise _Refusal("connect_unauthorised", "CONNECT token is for another node")
            if claims["exp"] - claims["iat"] > MAX_RELAY_CONNECT_TOKEN_LIFETIME_S:
                raise _Refusal("connect_unauthorised", "CONNECT token lives too long")
            if claims["iat"] < self._started_s:
                raise _Refusal("connect_unauthorised", "CONNECT token was issued before this relay started; ask for a fresh one")
            now = time.time()
            if len(self._connect_tokens_seen) > 1024:
                self._connect_tokens_seen = {j: e for j, e in self._connect_tokens_seen.items() if e + CLOCK_SKEW_S >= now}
            jti = str(claims["jti"])
            if jti in self._connect_tokens_seen:
                raise _Refusal("connect_unauthorised", "CONNECT token already used")
            self._connect_tokens_seen[jti] = float(claims["exp"])
            return
        raise _Refusal("connect_unauthorised", "CONNECT token is not signed by a tracker this relay trusts")

    async def _connect(self, target: str, raw: ByteStream, stream: StapledByteStream) -> None:
        node_id = target.rsplit(":", 1)[0]
        tunnel = self.tunnels.get(node_id)
        if tunnel is None:
            await raw.send(_http_error(404, "node_not_attached", f"no tunnel from {node_id} on this relay"))
            return
        if not tunnel.admitted.is_set():
            log.info("node %s admitted: a trusted tracker reaches it", node_id)
            tunnel.admitted.set()
        work = await tunnel.take_work(self.config.work_wait_timeout_s)
        if work is None:
            await raw.send(_http_error(503, "no_work_connection", f"{node_id} has no free work connection; retry"))
            return
        tunnel.streams_active += 1
        tunnel.streams_total += 1
        started = time.monotonic()
        try:
            await raw.send(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        finally:
            # Even when the tracker is already gone: the splice then ends at once and releases the node's side.
            work.assign(stream)
        try:
            await work.done.wait()
        finally:
            tunnel.streams_active -= 1
            log.debug("stream to %s closed after %.1f s", node_id, time.monotonic() - started)

    # --- node side -------------------------------------------------------------
    async def _attach(self, stream: StapledByteStream, buffered: BufferedByteReceiveStream, slot: _PendingSlot) -> None:
        nonce = secrets.token_urlsafe(32)
        await _send_message(stream, RelayChallenge(nonce=nonce))
        try:
            with anyio.fail_after(self.config.handshake_timeout_s):
                attach = _parse(RelayAttach, await _receive_line(buffered))
            if attach.role == "control" and not self.attach_rate.allow(slot.peer):
                raise _Refusal("rate_limited", f"at most {self.config.tunnel_attaches_per_s:g} new tunnels per second from one address")
            self._verify(attach, nonce)
            slot.release()  # proved: no longer a stranger's connection
            if attach.role == "control" and attach.node_id not in self.tunnels:
                if len(self.tunnels) >= self.config.max_tunnels:
                    raise _Refusal("too_many_tunnels", f"this relay holds its limit of {self.config.max_tunnels} tunnels")
                if self.stats()["provisional"] >= self.config.max_provisional_tunnels:
                    raise _Refusal("too_many_provisional", "too many tunnels wait for a tracker to admit them; retry later")
            tunnel = self.tunnels.get(attach.node_id)
            if attach.role == "work":
                if tunnel is None or tunnel.public_key != attach.public_key:
                    raise _Refusal("no_control_channel", "attach the control connection first")
                self.stranger_rate.give_back(slot.peer)  # the node's own key: a full pool is its race, not a stranger's try
                if len(tunnel.idle) >= self.config.max_idle_work:
                    raise _Refusal("work_pool_full", f"at most {self.config.max_idle_work} idle work connections per node")
        except _Refusal as refusal:
            self._refusals.log(logging.WARNING, refusal.code, "attach refused (%s): %s", refusal.code, refusal.message)
            await _send_message(stream, RelayRefused(code=refusal.code, message=refusal.message))
            return
        if attach.role == "control":
            self.stranger_rate.give_back(slot.peer)
        attached = RelayAttached(
            node_id=attach.node_id,
            role=attach.role,
            ping_interval_s=self.config.ping_interval_s,
            ping_timeout_s=self.config.ping_timeout_s,
            max_idle_work=self.config.max_idle_work,
        )
        if attach.role == "control":
            await self._run_control(attach, stream, buffered, attached)
        else:
            assert tunnel is not None
            await _send_message(stream, attached)
            # The node says `ready` once it listens for TLS; only then may a ClientHello reach it.
            try:
                with anyio.fail_after(self.config.handshake_timeout_s):
                    _parse(RelayReady, await _receive_line(buffered))
            except _Refusal as refusal:
                await _send_message(stream, RelayRefused(code=refusal.code, message=refusal.message))
                return
            await self._park_work(tunnel, stream)

    def _verify(self, attach: RelayAttach, nonce: str) -> None:
        try:
            key = parse_public_key(attach.public_key)
        except KeyFormatError as exc:
            raise _Refusal("bad_public_key", str(exc)) from None
        if node_id_for(key) != attach.node_id:
            raise _Refusal("node_id_mismatch", "node_id is not derived from public_key")
        try:
            claims = decode_token(
                attach.proof, key, required=["iss", "aud", "nonce", "role", "iat", "exp"],
                leeway=CLOCK_SKEW_S, audience=self.url,
            )  # fmt: skip
        except jwt.InvalidTokenError as exc:
            raise _Refusal("bad_proof", f"attach proof is not valid for this key: {exc}") from None
        if claims["iss"] != attach.node_id or claims["role"] != attach.role:
            raise _Refusal("bad_proof", "attach proof is for another node or role")
        if not secrets.compare_digest(str(claims["nonce"]), nonce):
            raise _Refusal("bad_proof", "attach proof signs another challenge (replayed?)")
        if claims["exp"] - claims["iat"] > RELAY_PROOF_LIFETIME_S:
            raise _Refusal("bad_proof", "attach proof lives too long")

    async def _run_control(
        self, attach: RelayAttach, stream: StapledByteStream, buffered: BufferedByteReceiveStream, attached: RelayAttached
    ) -> None:
        tunnel = _Tunnel(node_id=attach.node_id, public_key=attach.public_key)
        previous = self.tunnels.get(attach.node_id)
        if self.open or (previous is not None and previous.admitted.is_set()):
            tunnel.admitted.set()  # the same key, already admitted: a reconnect keeps its standing
        self.tunnels[attach.node_id] = tunnel
        if previous is not None:
            # Same node id means same key (the id is the key's fingerprint, and the proof checked it).
            log.info("node %s attached again; its previous tunnel is replaced", attach.node_id)
            previous.close()
        else:
            log.info("node %s attached", attach.node_id)
        try:
            await _send_message(stream, attached)
            async with anyio.create_task_group() as tg:

                async def end_when_replaced() -> None:
                    await tunnel.closed.wait()
                    tg.cancel_scope.cancel()

                async def end_unless_admitted() -> None:
                    with anyio.move_on_after(self.config.admission_window_s):
                        await tunnel.admitted.wait()
                    if not tunnel.admitted.is_set():
                        log.info("node %s: no trusted tracker reached it in %.0f s; tunnel dropped", attach.node_id,
                                 self.config.admission_window_s)  # fmt: skip
                        tg.cancel_scope.cancel()

                tg.start_soon(end_when_replaced)
                tg.start_soon(end_unless_admitted)
                ending = await self._control_loop(stream, buffered)
                log.info("node %s: %s; tunnel dropped", attach.node_id, ending)
                tg.cancel_scope.cancel()
        finally:
            tunnel.close()
            if self.tunnels.get(attach.node_id) is tunnel:
                del self.tunnels[attach.node_id]

    async def _control_loop(self, stream: StapledByteStream, buffered: BufferedByteReceiveStream) -> str:
        """Answer pings until the node goes silent, breaks the protocol or closes; returns why it ended."""
        silence_limit = self.config.ping_interval_s + self.config.ping_timeout_s
        try:
            while True:
                with anyio.fail_after(silence_limit):
                    message = _parse(RelayPing, await _receive_line(buffered))
                if message.type == "ping":  # type: ignore[attr-defined]
                    await _send_message(stream, RelayPing(type="pong"))
        except TimeoutError:
            return f"control silent for {silence_limit:.1f} s"
        except _Refusal as refusal:
            with anyio.move_on_after(1):
                await _send_message(stream, RelayRefused(code=refusal.code, message=refusal.message))
            return refusal.message
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return "control connection closed"

    async def _park_work(self, tunnel: _Tunnel, stream: StapledByteStream) -> None:
        work = _ParkedWork(stream)
        if tunnel.closed.is_set():
            return
        # Checked again here, with no await between check and park: many attaches in flight at once all
        # passed the check before `attached`, and only this one holds.
        if len(tunnel.idle) >= self.config.max_idle_work:
            log.warning("node %s: work connection closed, %d already idle", tunnel.node_id, len(tunnel.idle))
            return
        tunnel.park(work)
        with work.idle_scope:
            # A node sends nothing on an idle work connection: any byte or EOF ends it.
            try:
                await stream.receive(1)
            except Exception:  # noqa: BLE001 - any end of the idle connection
                pass
            if not tunnel.unpark(work):
                # A CONNECT took it in the same instant: let it assign, so it is not left waiting on `done`.
                with anyio.CancelScope(shield=True):
                    await work.assigned.wait()
        if work.peer is None:
            return
        try:
            # A tracker starts its TLS handshake at once and the node answers it at once: until both have
            # spoken, a CONNECT that says nothing (or too little for the node to answer) only holds the
            # node's connection, so that stretch is bounded.
            await _splice(work.peer, stream, first_bytes_timeout_s=self.config.handshake_timeout_s)
        finally:
            work.done.set()


async def _splice(a: ByteStream, b: ByteStream, *, first_bytes_timeout_s: float | None = None) -> None:
    """Copy both ways as bytes arrive, until either side ends; then close both.

    With `first_bytes_timeout_s`, each side must have sent its first bytes within that time of the
    splice's start, or the splice ends.
    """
    started = anyio.current_time()
    async with anyio.create_task_group() as tg:

        async def pump(source: ByteStream, sink: ByteStream, first_timeout: float | None) -> None:
            try:
                if first_timeout is not None:
                    with anyio.fail_at(started + first_timeout):
                        chunk = await source.receive(SPLICE_CHUNK_BYTES)
                    await sink.send(chunk)
                while True:
                    chunk = await source.receive(SPLICE_CHUNK_BYTES)
                    await sink.send(chunk)
            except Exception:  # noqa: BLE001 - EOF, reset, a closed peer or a silent start: the splice is over
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(pump, a, b, first_bytes_timeout_s)
        tg.start_soon(pump, b, a, first_bytes_timeout_s)
    with anyio.CancelScope(shield=True):
        for side in (a, b):
            try:
                await side.aclose()
            except Exception:  # noqa: BLE001
                pass


def _reset(client: socket.socket) -> None:
    """Closes an accepted socket with a reset: no answer, no FIN handshake, no TIME_WAIT kept here."""
    try:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    client.close()


async def _receive_line(buffered: BufferedByteReceiveStream) -> bytes:
    try:
        return await buffered.receive_until(b"\n", MAX_RELAY_MESSAGE_BYTES)
    except anyio.DelimiterNotFound:
        raise _Refusal("message_too_large", f"messages are at most {MAX_RELAY_MESSAGE_BYTES} bytes") from None


def _parse(model: type[BaseModel], line: bytes) -> BaseModel:  # type: ignore[type-var]
    try:
        return model.model_validate_json(line)
    except ValidationError as exc:
        raise _Refusal("bad_message", f"expected {model.__name__}: {exc.errors()[0]['msg']}") from None


async def _send_message(stream: ByteStream, message: BaseModel) -> None:
    await stream.send(message.model_dump_json().encode() + b"\n")


def _http_response(status: int, body: bytes, *, reason: str = "", extra: str = "") -> bytes:
    reason = reason or {200: "OK", 400: "Bad Request", 404: "Not Found", 407: "Proxy Authentication Required", 426: "Upgrade Required",
                        431: "Request Header Fields Too Large", 503: "Service Unavailable"}.get(status, "Error")  # fmt: skip
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    )
    return head.encode("latin-1") + body


def _http_error(status: int, code: str, message: str, *, extra: str = "") -> bytes:
    return _http_response(status, openai_error_body(message, "relay_error", code), extra=extra)


async def run_relay(config: RelayConfig, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
    await Relay(config).serve(task_status=task_status)


__all__ = ["Relay", "RelayConfig", "run_relay"]
