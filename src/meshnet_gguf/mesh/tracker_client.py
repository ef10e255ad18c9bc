"""Talk to the tracker: registration, heartbeats, deregistration and receipt batches.

`TrackerClient` makes single calls (each signed with the node key) and sorts
failures into "try again later" and "the tracker forgot us". `NodePresence` is
the long-running task that keeps the node registered: it announces the node,
heartbeats on the tracker's period, re-registers when the tracker lost it, and
retries with backoff and jitter while the tracker is unreachable. Serving never
waits on any of this: routes verify against the pinned key alone.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlsplit

import anyio
import httpx
from pydantic import BaseModel, ValidationError

from meshnet_gguf.common.retry import Backoff
from meshnet_gguf.contract.protocol import (
    ENROLMENT_HEADER,
    WELL_KNOWN_PATH,
    Deregistration,
    Heartbeat,
    HeartbeatAck,
    MeshState,
    NodeAnnouncement,
    NodeLoad,
    ReceiptAck,
    ReceiptBatch,
    RegistrationAck,
    TrackerInfo,
    UsageReceipt,
)
from meshnet_gguf.mesh.identity import NodeIdentity

log = logging.getLogger(__name__)

# A tracker that has not answered in this long is treated as down for this call; the caller retries.
TRACKER_CALL_TIMEOUT_S = 10.0
# Connecting should be quick on any network that can carry inference at all.
TRACKER_CONNECT_TIMEOUT_S = 5.0
# Retry a tracker that is down: soon at first, then at most once a minute per node,
# so a fleet does not hammer a tracker that is coming back.
RETRY_INITIAL_S = 1.0
RETRY_MAX_S = 60.0
# How often the heartbeat loop looks at the node's state, so `online`/`draining` reach
# the tracker within a second instead of waiting for the next period.
STATE_CHECK_INTERVAL_S = 1.0
# Deregistering is a courtesy on the way out; shutdown must not hang on a dead tracker.
DEREGISTER_TIMEOUT_S = 3.0
# The tracker key learnt on first contact, pinned in the state dir (delete it to learn again).
TRACKER_KEY_PIN_FILE = "tracker_public_key"

M = TypeVar("M", bound=BaseModel)


class TrackerUnavailable(Exception):
    """The call did not go through (network, timeout, 5xx, 429, unexpected answer): retry later."""


class TrackerRefused(TrackerUnavailable):
    """The tracker answered 4xx: retrying the same call will not help until something changes."""

    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(f"tracker refused ({status} {code}): {message}")
        self.status = status
        self.code = code


# The reference tracker's code for a registration without (or with the wrong) enrolment secret.
BAD_ENROLMENT_CODE = "bad_enrolment_secret"


class EnrolmentRefused(Exception):
    """The tracker wants an enrolment secret this node does not have: only its operator can fix that."""


class NodeUnknown(TrackerRefused):
    """The tracker does not know this node (it restarted, or dropped us after missed heartbeats): register again."""


class TrackerClient:
    def __init__(
        self,
        base_url: str,
        identity: NodeIdentity,
        *,
        enrolment_secret: str | None = None,
        audience: str | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.identity = identity
        # The tracker's issuer (from its pinned key): signed calls name it, so a token
        # captured on the way to one tracker is refused by any other.
        self.audience = audience
        self._enrolment_secret = enrolment_secret
        self._own_http = http is None
        self._http = http or httpx.AsyncClient(
            timeout=httpx.Timeout(TRACKER_CALL_TIMEOUT_S, connect=TRACKER_CONNECT_TIMEOUT_S),
            # The tracker URL is operator-configured; never pick up ambient proxy settings for it.
            trust_env=False,
        )

    @property
    def has_enrolment_secret(self) -> bool:
        return bool(self._enrolment_secret)

    async def aclose(self) -> None:
        if self._own_http:
            await self._http.aclose()

    async def info(self) -> TrackerInfo:
        return await self._call("GET", WELL_KNOWN_PATH, None, TrackerInfo, signed=False)

    async def register(self, announcement: NodeAnnouncement) -> RegistrationAck:
        headers = {ENROLMENT_HEADER: self._enrolment_secret} if self._enrolment_secret else {}
        return await self._call("POST", "/v1/nodes/register", announcement, RegistrationAck, headers=headers)

    async def heartbeat(self, state: MeshState, load: NodeLoad, *, timeout_s: float | None = None) -> HeartbeatAck:
        node = self.identity.node_id
        beat = Heartbeat(node_id=node, state=state, load=load)
        return await self._call("POST", f"/v1/nodes/{node}/heartbeat", beat, HeartbeatAck, timeout_s=timeout_s)

    async def deregister(self, reason: str = "shutdown", timeout_s: float = DEREGISTER_TIMEOUT_S) -> None:
        node = self.identity.node_id
        body = Deregistration(node_id=node, reason=reason)
        await self._call("POST", f"/v1/nodes/{node}/deregister", body, None, timeout_s=timeout_s)

    async def send_receipts(self, receipts: list[UsageReceipt]) -> ReceiptAck:
        node = self.identity.node_id
        batch = ReceiptBatch(node_id=node, receipts=receipts)
        return await self._call("POST", f"/v1/nodes/{node}/receipts", batch, ReceiptAck)

    async def _call(
        self,
        method: str,
        path: str,
        body: BaseModel | None,
        answer: type[M] | None,
        *,
        headers: dict[str, str] | None = None,
        signed: bool = True,
        timeout_s: float | None = None,
    ) -> M:
        content = body.model_dump_json().encode() if body is not None else b""
        sent_headers = {"content-type": "application/json", **(headers or {})}
        if signed:
            if self.audience is None:
                raise TrackerUnavailable(f"{method} {path}: the tracker's key is not known yet")
            sent_headers["authorization"] = "Bearer " + self.identity.request_auth(method, path, content, self.audience)
        try:
            response = await self._http.request(
                method,
                self.base_url + path,
                content=content if body is not None else None,
                headers=sent_headers,
                timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.HTTPError as exc:
            raise TrackerUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500 or response.status_code == 429:
            raise TrackerUnavailable(f"{method} {path}: tracker answered {response.status_code}")
        if response.status_code >= 400:
            code, message = _error_of(response)
            cls = NodeUnknown if code == "unknown_node" else TrackerRefused
            raise cls(response.status_code, code, message)
        if answer is None:
            return None  # type: ignore[return-value]
        try:
            return answer.model_validate_json(response.content)
        except ValidationError as exc:
            raise TrackerUnavailable(f"{method} {path}: unexpected answer: {exc.errors()[0]['msg']}") from exc


def is_loopback_url(url: str) -> bool:
    """True for http(s) URLs whose host is a loopback address or `localhost`."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def first_contact_problem(tracker_url: str) -> str | None:
    """Why the node must not learn the tracker's key from the tracker itself at this URL, or None.

    Over plain http to another machine anyone on the path could answer with their own key
    and then sign routes (and receive the node's receipts); https or loopback is safe enough.
    """
    if urlsplit(tracker_url).scheme == "https" or is_loopback_url(tracker_url):
        return None
    return (
        f"the tracker {tracker_url} is plain http on another machine: its key cannot be learnt safely from it. "
        "Pin it: set MESHNET_TRACKER_PUBLIC_KEY (or tracker_public_key) to the key the tracker prints, or use https"
    )


def _error_of(response: httpx.Response) -> tuple[str | None, str]:
    try:
        error = response.json()["error"]
        return error.get("code"), str(error.get("message"))
    except (ValueError, KeyError, TypeError):
        return None, response.text[:200]


class NodePresence:
    """Keeps the node registered and heartbeating for as long as `run()` runs.

    `announcement()` is asked afresh at every (re-)registration and
    `status()` at every state check, so the tracker always hears the current
    state (`joining` while loading, `online` when ready, `draining` on the way out).
    """

    def __init__(
        self,
        client: TrackerClient,
        announcement: Callable[[], NodeAnnouncement],
        status: Callable[[], tuple[MeshState, NodeLoad]],
        *,
        check_ack: Callable[[RegistrationAck], str | None] = lambda ack: None,
        explain_refusal: Callable[[TrackerRefused], Awaitable[str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._announcement = announcement
        self._status = status
        self._check_ack = check_ack
        self._explain_refusal = explain_refusal
        self._clock = clock
        self.registered = False
        self.last_ack: RegistrationAck | None = None
        # Why this node is not online on its tracker (a refused registration, a key that does not
        # match the pin); None when all is well. The node shows it in /health.
        self.problem: str | None = None

    async def run(self) -> None:
        while True:
            ack, announced = await self._register_until_acked()
            await self._heartbeat_until_forgotten(ack, announced)

    async def deregister(self, reason: str = "shutdown") -> bool:
        """One attempt, bounded by DEREGISTER_TIMEOUT_S; the TTL cleans up if it fails."""
        if not self.registered:
            return False
        try:
            await self._client.deregister(reason)
        except TrackerUnavailable as exc:
            log.warning("could not deregister from the tracker (%s); it will drop this node after its TTL", exc)
            return False
        self.registered = False
        return True

    async def _register_until_acked(self) -> tuple[RegistrationAck, MeshState]:
        backoff = Backoff(RETRY_INITIAL_S, RETRY_MAX_S)
        while True:
            announcement = self._announcement().model_copy(update={"state": self._status()[0]})
            try:
                ack = await self._client.register(announcement)
            except TrackerRefused as exc:
                if exc.code == BAD_ENROLMENT_CODE:
                    # Asking again with the same secret gets the same answer: stop, and say what to set.
                    given = (
                        "the enrolment secret this node sent was refused"
                        if self._client.has_enrolment_secret
                        else ("this node sent no enrolment secret")
                    )
                    raise EnrolmentRefused(
                        f"tracker {self._client.base_url} requires its enrolment secret and {given}: set "
                        "MESHNET_ENROLMENT_SECRET (or --enrolment-secret) to the secret the tracker's operator gives "
                        "(`meshnet-gguf dev tracker` prints it)"
                    ) from None
                delay = backoff.next_delay()
                self.problem = await self._explain_refusal(exc) if self._explain_refusal else str(exc)
                # Still retried: the operator may fix the tracker's side (enrolment secret, version).
                log.error("tracker %s refused registration: %s; retrying in %.0f s", self._client.base_url, self.problem, delay)
            except TrackerUnavailable as exc:
                delay = backoff.next_delay()
                log.warning("tracker %s unreachable (%s); serving on, retrying in %.0f s", self._client.base_url, exc, delay)
            else:
                self.registered = True
                self.last_ack = ack
                self.problem = self._check_ack(ack)
                if self.problem:
                    log.error("tracker %s: %s; this node reports itself not online", self._client.base_url, self.problem)
                log.info(
                    "registered with tracker %s as %s (%s, heartbeat every %.0f s)",
                    self._client.base_url,
                    ack.node_id,
                    announcement.state,
                    ack.heartbeat_interval_s,
                )
                return ack, announcement.state
            await anyio.sleep(delay)

    async def _heartbeat_until_forgotten(self, ack: RegistrationAck, announced: MeshState) -> None:
        period = ack.heartbeat_interval_s
        # What the tracker heard last: a state that changed since (e.g. a problem found in the
        # acknowledgement) goes out at the next state check.
        reported_state = announced
        reported_models = self._status()[1].models  # as the registration said them
        last_beat = self._clock()
        while True:
            await anyio.sleep(min(STATE_CHECK_INTERVAL_S, period))
            state, load = self._status()
            # A model loaded or unloaded goes out at the next state check too: the tracker routes by it.
            if state == reported_state and load.models == reported_models and self._clock() - last_beat < period:
                continue
            try:
                # A heartbeat that outlasts its period is late anyway: the next one goes out on a fresh connection.
                # A kept connection a NAT forgot answers nothing, and waiting TRACKER_CALL_TIMEOUT_S on it let a
                # tracker with a short period (its TTL is three of them) drop a node that was there all along.
                await self._client.heartbeat(state, load, timeout_s=min(TRACKER_CALL_TIMEOUT_S, period))
            except NodeUnknown:
                log.warning("tracker %s forgot this node; registering again", self._client.base_url)
                self.registered = False
                return
            except TrackerUnavailable as exc:
                # Keep the fixed period: a heartbeat is tiny and carries the current state, and the
                # first one through after an outage (or its "unknown node" answer) restores the registration.
                log.warning("heartbeat to %s failed: %s", self._client.base_url, exc)
            reported_state, reported_models = state, load.models
            last_beat = self._clock()
