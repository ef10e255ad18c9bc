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

It never parses, buffers or logs what passes through a splice. This module holds
the tunnels and the splice; who may hold what (strangers' rates, pending connections,
provisional tunnels) is `relay_admission`'s, who is who (attach proofs, CONNECT tokens)
`relay_proofs`', the limits `relay_config`'s, and the framing on the wire the contract's
(`contract/relay_framing`), shared with the node and the tracker.
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
from collections import deque
from dataclasses import dataclass, field

import anyio
import h11
from anyio.abc import ByteStream, SocketStream, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.stapled import StapledByteStream
from anyio.streams.tls import TLSAttribute, TLSStream

from meshnet_gguf.contract.protocol import relay_audience
from meshnet_gguf.contract.relay_framing import (
    CONNECT_ESTABLISHED,
    HEAD_END,
    UPGRADED,
    RelayFramingError,
    http_error,
    http_response,
    parse_message,
    receive_line,
    send_message,
)
from meshnet_gguf.contract.relay_keepalive import keep_alive
from meshnet_gguf.contract.relay_wire import (
    MAX_RELAY_HEAD_BYTES,
    RELAY_CONNECT_AUTH_SCHEME,
    RELAY_TUNNEL_PATH,
    RELAY_UPGRADE_PROTOCOL,
    RelayAttach,
    RelayAttached,
    RelayChallenge,
    RelayPing,
    RelayReady,
    RelayRefused,
)
from meshnet_gguf.reference.relay.admission import PendingSlot, RelayAdmission, RelayRefusal
from meshnet_gguf.reference.relay.admitted import SAVE_INTERVAL_S
from meshnet_gguf.reference.relay.config import RelayConfig
from meshnet_gguf.reference.relay.proofs import ConnectTokens, verify_attach

log = logging.getLogger(__name__)

# Bytes read per splice step from a plain socket: as much as the event loop's transport reads at once,
# so a long prompt's body crosses in fewer steps (bench/relay_splice_cost.py: 64 KiB moved ~380-460 MB/s,
# 256 KiB ~480-540; a token-sized event costs the same either way).
SPLICE_CHUNK_BYTES = 256 * 1024
# From the relay's own TLS (an https relay): one record is at most ~16 kB, so a read carries a few, and a
# read never allocates more than that.
TLS_SPLICE_CHUNK_BYTES = 64 * 1024
# accept() failing for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM): the relay keeps
# serving what it holds and tries again after this pause, rather than spinning or exiting.
ACCEPT_BACKOFF_S = 0.1
# Connections taken from the listen backlog per wake-up, before the loop serves the splices again. Small: under a
# flood each wake-up is one short turn of the event loop, so an established splice waits behind a few accepts
# rather than a long batch (measured: 64 left a warm honest stream's first byte about 3x slower, 8 about 2x).
ACCEPT_BATCH = 8
# A refused control connection is told why within this long, or closed unanswered.
REFUSAL_SEND_TIMEOUT_S = 1.0
_ACCEPT_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# A refusal the relay answers: its own, or a control line it could not read.
_REFUSALS = (RelayRefusal, RelayFramingError)


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
    network: str = ""  # the source network of its control connection: where it counts while provisional
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

    def evict(self) -> None:
        """A provisional tunnel whose place a newcomer's network took: closed, so its control task ends."""
        self.close()

    def close(self) -> None:
        self.closed.set()
        self._arrival.set()
        while self.idle:
            work = self.idle.popleft()
            work.assigned.set()  # with no peer: the idle connection just ends
            work.idle_scope.cancel()


class Relay:
    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.tunnels: dict[str, _Tunnel] = {}
        self.port: int | None = None
        self.accept_errors = 0
        self.admission = RelayAdmission(config)
        self._connect_tokens = ConnectTokens(config.trusted_tracker_keys)
        self._tls: ssl.SSLContext | None = None
        if config.tls_certificate_file:
            self._tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._tls.load_cert_chain(config.tls_certificate_file, config.tls_key_file)

    @property
    def url(self) -> str:
        """The relay's name in the tokens meant for it."""
        scheme = "https" if self.config.tls_certificate_file else "http"
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host  # an IPv6 address, as a URL spells it
        return relay_audience(self.config.public_url or f"{scheme}://{host}:{self.port or self.config.port}")

    @property
    def open(self) -> bool:
        return self._connect_tokens.open

    @property
    def reset_at_accept(self) -> int:
        """Connections reset at accept, their source out of tries."""
        return self.admission.reset_at_accept

    # --- serving ------------------------------------------------------------
    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host=self.config.host, local_port=self.config.port)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        log.info("relay listening on %s:%s as %s", self.config.host, self.port, self.url)
        if self.open:
            log.warning("no tracker key trusted: CONNECT needs no token and every tunnel is admitted (an open relay)")
        else:
            self.admission.admitted.load()
        task_status.started(self.port)
        try:
            async with listener, anyio.create_task_group() as tg:
                for one in listener.listeners:
                    tg.start_soon(self._accept_loop, one, tg)
                if not self.open:
                    tg.start_soon(self._save_admitted)
        finally:
            if not self.open:
                self.admission.admitted.save()

    async def _save_admitted(self) -> None:
        """Writes the admitted nodes when they changed (at most once per SAVE_INTERVAL_S), and every quarter of their
        memory anyway, so that a relay that crashes still remembers its attached nodes for most of it."""
        admitted = self.admission.admitted
        refresh_s = max(SAVE_INTERVAL_S, admitted.remember_s / 4)
        saved_at = time.monotonic()
        while True:
            await anyio.sleep(SAVE_INTERVAL_S)
            refresh = time.monotonic() - saved_at >= refresh_s
            if refresh:
                admitted.expire()  # a walk of every remembered node: at the refresh's pace, not every second
            if admitted.dirty or refresh:
                admitted.save()
                saved_at = time.monotonic()

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
                        log.warning(
                            "accept failed (%s, %d times so far); serving the tunnels held, retrying", exc.strerror, self.accept_errors
                        )
                    await anyio.sleep(ACCEPT_BACKOFF_S)
                    break
                peer = str(address[0]) if isinstance(address, tuple) and address else "?"
                network = self.admission.network_of(peer)
                if not self.admission.may_connect(network, peer):
                    _reset(client)
                    continue
                tg.start_soon(self._handle, client, peer, network)

    def stats(self) -> dict[str, int]:
        tunnels = list(self.tunnels.values())
        return {
            "tunnels": len(tunnels),
            "provisional": sum(not t.admitted.is_set() for t in tunnels),
            "idle_work": sum(len(t.idle) for t in tunnels),
            "streams_active": sum(t.streams_active for t in tunnels),
            "streams_total": sum(t.streams_total for t in tunnels),
        }

    async def _handle(self, client: socket.socket, peer: str, network: str) -> None:
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
                # Cancelled when a newcomer from a lighter network takes this connection's place while it has
                # proved nothing; never after (a proved connection holds no place to take).
                evictable = anyio.CancelScope()
                slot = self.admission.enter_pending(network, peer, evictable.cancel)
                if slot is None:
                    # Said and closed at once: the answer fits any socket buffer, so a full one costs nothing here.
                    with anyio.move_on_after(0):
                        await socket_stream.send(http_error(503, "too_many_pending", "too many unfinished connections; retry later"))
                    return
                try:
                    with evictable:
                        raw: ByteStream = socket_stream
                        if self._tls is not None:
                            with anyio.fail_after(self.config.handshake_timeout_s):
                                raw = await TLSStream.wrap(
                                    socket_stream, server_side=True, ssl_context=self._tls, standard_compatible=False
                                )
                        buffered = BufferedByteReceiveStream(raw)
                        await self._dispatch(raw, buffered, StapledByteStream(raw, buffered), slot)
                finally:
                    slot.release()
        except Exception as exc:  # noqa: BLE001 - a peer's failure is logged, never raised
            log.debug("connection ended: %r", exc)

    async def _dispatch(self, raw: ByteStream, buffered: BufferedByteReceiveStream, stream: StapledByteStream, slot: PendingSlot) -> None:
        try:
            with anyio.fail_after(self.config.handshake_timeout_s):
                head = await buffered.receive_until(HEAD_END, MAX_RELAY_HEAD_BYTES)
        except anyio.DelimiterNotFound:
            await raw.send(http_error(431, "head_too_large", f"request head exceeds {MAX_RELAY_HEAD_BYTES} bytes"))
            return
        parser = h11.Connection(h11.SERVER)
        parser.receive_data(head + HEAD_END)
        try:
            request = parser.next_event()
        except h11.RemoteProtocolError as exc:
            await raw.send(http_error(400, "bad_request", f"not an HTTP/1.1 request: {exc}"))
            return
        if not isinstance(request, h11.Request):
            await raw.send(http_error(400, "bad_request", "not an HTTP/1.1 request"))
            return
        method, target = request.method.decode("latin-1"), request.target.decode("latin-1")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        if method == "CONNECT":
            try:
                self._connect_tokens.authorise(target, headers.get("proxy-authorization", ""), self.url)
            except RelayRefusal as refusal:
                self.admission.refusals.log(logging.INFO, refusal.code, "CONNECT %s refused: %s", target, refusal.message)
                await raw.send(http_error(407, refusal.code, refusal.message, extra=f"Proxy-Authenticate: {RELAY_CONNECT_AUTH_SCHEME}\r\n"))
                return
            self.admission.connect_proved(slot)
            await self._connect(target, raw, stream)
        elif method == "GET" and target == RELAY_TUNNEL_PATH:
            if headers.get("upgrade", "").lower() != RELAY_UPGRADE_PROTOCOL:
                await raw.send(http_error(426, "upgrade_required", f"upgrade to {RELAY_UPGRADE_PROTOCOL}"))
                return
            await raw.send(UPGRADED)
            await self._attach(stream, buffered, slot)
        elif method == "GET" and target == "/health":
            body = json.dumps({"status": "ok", **self.stats()}).encode()
            await raw.send(http_response(200, body))
        else:
            await raw.send(http_error(404, "not_found", f"{method} {target}: the relay serves CONNECT and {RELAY_TUNNEL_PATH}"))

    # --- tracker side ----------------------------------------------------------
    async def _connect(self, target: str, raw: ByteStream, stream: StapledByteStream) -> None:
        node_id = target.rsplit(":", 1)[0]
        tunnel = self.tunnels.get(node_id)
        if tunnel is None:
            await raw.send(http_error(404, "node_not_attached", f"no tunnel from {node_id} on this relay"))
            return
        if not tunnel.admitted.is_set():
            log.info("node %s admitted: a trusted tracker reaches it", node_id)
            tunnel.admitted.set()
            self.admission.leave_provisional(tunnel.network, tunnel)
            if not self.open:
                self.admission.admitted.admitted(node_id, tunnel.network)
        work = await tunnel.take_work(self.config.work_wait_timeout_s)
        if work is None:
            await raw.send(http_error(503, "no_work_connection", f"{node_id} has no free work connection; retry"))
            return
        tunnel.streams_active += 1
        tunnel.streams_total += 1
        started = time.monotonic()
        try:
            await raw.send(CONNECT_ESTABLISHED)
        finally:
            # Even when the tracker is already gone: the splice then ends at once and releases the node's side.
            work.assign(stream)
        try:
            await work.done.wait()
        finally:
            tunnel.streams_active -= 1
            log.debug("stream to %s closed after %.1f s", node_id, time.monotonic() - started)

    # --- node side -------------------------------------------------------------
    async def _attach(self, stream: StapledByteStream, buffered: BufferedByteReceiveStream, slot: PendingSlot) -> None:
        nonce = secrets.token_urlsafe(32)
        await send_message(stream, RelayChallenge(nonce=nonce))
        try:
            with anyio.fail_after(self.config.handshake_timeout_s):
                attach = parse_message(await receive_line(buffered), RelayAttach)
            if attach.role == "control":
                self.admission.check_new_control(slot.network)
            verify_attach(attach, nonce, self.url)
            slot.release()  # proved: no longer a stranger's connection
            tunnel = self.tunnels.get(attach.node_id)
            new_tunnel = None
            if attach.role == "control":
                if tunnel is None:
                    self.admission.check_new_tunnel(len(self.tunnels))
                new_tunnel = self._new_tunnel(attach, slot.network, tunnel)
            if attach.role == "work":
                if tunnel is None or tunnel.public_key != attach.public_key:
                    raise RelayRefusal("no_control_channel", "attach the control connection first")
                self.admission.check_work(slot, len(tunnel.idle))
        except _REFUSALS as refusal:
            self.admission.refusals.log(logging.WARNING, refusal.code, "attach refused (%s): %s", refusal.code, refusal.message)
            await send_message(stream, RelayRefused(code=refusal.code, message=refusal.message))
            return
        if attach.role == "control":
            self.admission.control_attached(slot)
        attached = RelayAttached(
            node_id=attach.node_id,
            role=attach.role,
            ping_interval_s=self.config.ping_interval_s,
            ping_timeout_s=self.config.ping_timeout_s,
            max_idle_work=self.config.max_idle_work,
        )
        if new_tunnel is not None:
            await self._run_control(new_tunnel, stream, buffered, attached)
        else:
            assert tunnel is not None
            await send_message(stream, attached)
            # The node says `ready` once it listens for TLS; only then may a ClientHello reach it.
            try:
                with anyio.fail_after(self.config.handshake_timeout_s):
                    parse_message(await receive_line(buffered), RelayReady)
            except RelayFramingError as refusal:
                await send_message(stream, RelayRefused(code=refusal.code, message=refusal.message))
                return
            await self._park_work(tunnel, stream)

    def _new_tunnel(self, attach: RelayAttach, network: str, previous: _Tunnel | None) -> _Tunnel:
        """The tunnel a proved control connection will hold: admitted at once when the relay is open or a trusted
        tracker admitted this node (still attached, or remembered since its tunnel dropped), else provisional, with
        a place among the provisional of its network (RelayRefusal when there is none)."""
        tunnel = _Tunnel(node_id=attach.node_id, public_key=attach.public_key, network=network)
        if self.open or (previous is not None and previous.admitted.is_set()) or self.admission.admitted.holds(attach.node_id):
            tunnel.admitted.set()  # the same key, already admitted: a reconnect keeps its standing
            return tunnel
        if previous is not None:
            self.admission.leave_provisional(previous.network, previous)  # it is replaced: its place is this one's
        self.admission.enter_provisional(network, tunnel)
        return tunnel

    async def _run_control(
        self, tunnel: _Tunnel, stream: StapledByteStream, buffered: BufferedByteReceiveStream, attached: RelayAttached
    ) -> None:
        previous = self.tunnels.get(tunnel.node_id)
        if tunnel.admitted.is_set() and not self.open:
            self.admission.admitted.admitted(tunnel.node_id, tunnel.network)
        self.tunnels[tunnel.node_id] = tunnel
        if previous is not None:
            # Same node id means same key (the id is the key's fingerprint, and the proof checked it).
            log.info("node %s attached again; its previous tunnel is replaced", tunnel.node_id)
            previous.close()
        else:
            log.info("node %s attached", tunnel.node_id)
        # A node behind a NAT that forgot its mapping goes silent without a FIN: its kernel stops answering the
        # probes, and the tunnel is dropped within NOTICED_WITHIN_S instead of the pings' interval + timeout.
        keep_alive(stream.extra(anyio.abc.SocketAttribute.raw_socket, None))
        try:
            await send_message(stream, attached)
            async with anyio.create_task_group() as tg:

                async def end_when_replaced() -> None:
                    await tunnel.closed.wait()
                    tg.cancel_scope.cancel()

                async def end_unless_admitted() -> None:
                    with anyio.move_on_after(self.config.admission_window_s):
                        await tunnel.admitted.wait()
                    if not tunnel.admitted.is_set():
                        log.info("node %s: no trusted tracker reached it in %.0f s; tunnel dropped", tunnel.node_id,
                                 self.config.admission_window_s)  # fmt: skip
                        tg.cancel_scope.cancel()

                tg.start_soon(end_when_replaced)
                tg.start_soon(end_unless_admitted)
                ending = await self._control_loop(stream, buffered)
                log.info("node %s: %s; tunnel dropped", tunnel.node_id, ending)
                tg.cancel_scope.cancel()
        finally:
            tunnel.close()
            self.admission.leave_provisional(tunnel.network, tunnel)
            if self.tunnels.get(tunnel.node_id) is tunnel:
                del self.tunnels[tunnel.node_id]
                if tunnel.admitted.is_set() and not self.open:
                    self.admission.admitted.dropped(tunnel.node_id)  # still admitted for a while: a blip is not a stranger

    async def _control_loop(self, stream: StapledByteStream, buffered: BufferedByteReceiveStream) -> str:
        """Answer pings until the node goes silent, breaks the protocol or closes; returns why it ended."""
        silence_limit = self.config.ping_interval_s + self.config.ping_timeout_s
        try:
            while True:
                with anyio.fail_after(silence_limit):
                    message = parse_message(await receive_line(buffered), RelayPing)
                if message.type == "ping":
                    await send_message(stream, RelayPing(type="pong"))
        except TimeoutError:
            return f"control silent for {silence_limit:.1f} s"
        except RelayFramingError as refusal:
            with anyio.move_on_after(REFUSAL_SEND_TIMEOUT_S):
                await send_message(stream, RelayRefused(code=refusal.code, message=refusal.message))
            return refusal.message
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return "control connection closed"

    async def _park_work(self, tunnel: _Tunnel, stream: StapledByteStream) -> None:
        work = _ParkedWork(stream)
        if tunnel.closed.is_set():
            return
        # Checked again here, with no await between check and park: many attaches in flight at once all
        # passed the check before `attached`, and only this one holds.
        if not self.admission.may_park(len(tunnel.idle)):
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
    splice's start, or the splice ends. Either side gone silent (a node whose NAT forgot it, a tracker's
    host gone) ends it within NOTICED_WITHIN_S, so the tracker's client hears of a cut stream in seconds.
    """
    for side in (a, b):
        keep_alive(side.extra(anyio.abc.SocketAttribute.raw_socket, None))
    started = anyio.current_time()
    async with anyio.create_task_group() as tg:

        async def pump(source: ByteStream, sink: ByteStream, first_timeout: float | None) -> None:
            size = SPLICE_CHUNK_BYTES if source.extra(TLSAttribute.ssl_object, None) is None else TLS_SPLICE_CHUNK_BYTES
            try:
                if first_timeout is not None:
                    with anyio.fail_at(started + first_timeout):
                        chunk = await source.receive(size)
                    await sink.send(chunk)
                while True:
                    chunk = await source.receive(size)
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


async def run_relay(config: RelayConfig, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
    await Relay(config).serve(task_status=task_status)


__all__ = ["Relay", "run_relay"]
