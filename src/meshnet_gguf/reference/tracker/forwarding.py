"""Forwarding: an OpenAI request routed to one ready whole-model node, its answer passed on unbuffered.

The endpoint picks the node expected to give this prompt its first token soonest (`registry.pick`),
signs the route, hands the request's row to the ledger (synced on its thread while the node works; the
client's first byte waits for it, protocol §6, rule 5), and sends it with one call on the node's target
(`send`: lean client, relay tunnel or httpx, the target knows). A node that refuses the connection never
saw the request, so one more node may be tried. The answer is metered on a copy as it passes
(`metering.ForwardMeter`); a client that leaves, a node that breaks off or a forward past its total
time ends it, and the ledger settles what went by. A stream that completes is timed for the node's
speed estimate (`StreamTiming` -> `node_speed`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio
from starlette.requests import Request

from meshnet_gguf.common.asgi import Receive, Scope, Send, send_body, start_answer
from meshnet_gguf.common.http1_client import HttpAnswer, HttpClientError, HttpConnectError
from meshnet_gguf.contract.error_answer import send_error
from meshnet_gguf.contract.errors import ApiError, openai_error_body
from meshnet_gguf.contract.protocol import REQUEST_ID_HEADER, ROUTE_HEADER, USAGE_COMPLETION_TOKENS_HEADER, USAGE_PROMPT_TOKENS_HEADER
from meshnet_gguf.contract.strict_json import parse_json_object
from meshnet_gguf.reference.tracker.answer_evidence import LogprobStripper, evidence_body
from meshnet_gguf.reference.tracker.audits import AnswerCapture, Auditor
from meshnet_gguf.reference.tracker.config import TrackerConfig
from meshnet_gguf.reference.tracker.ledger import Outcome, TrackerLedger
from meshnet_gguf.reference.tracker.metering import ForwardMeter, prompt_ceiling, requested_choices
from meshnet_gguf.reference.tracker.node_models import ModelOnNode
from meshnet_gguf.reference.tracker.node_speed import StreamSample
from meshnet_gguf.reference.tracker.reach import NodeReach
from meshnet_gguf.reference.tracker.registry import NodeEntry, NodeRegistry
from meshnet_gguf.reference.tracker.request_io import limited_body
from meshnet_gguf.reference.tracker.routing import RouteSigner

log = logging.getLogger(__name__)

# A node that refuses the connection never saw the request, so one more node may be tried.
MAX_ROUTE_ATTEMPTS = 2
# Retry-After when the ledger could not record a request: a disk problem outlasts a heartbeat or two.
LEDGER_RETRY_AFTER_S = 5
# The only node response headers a client sees: the answer's type and the Meshnet accounting.
FORWARDED_RESPONSE_HEADERS = frozenset(
    {
        "content-type",
        "cache-control",
        "x-accel-buffering",
        "retry-after",
        "x-request-id",
        REQUEST_ID_HEADER.lower(),
        USAGE_PROMPT_TOKENS_HEADER.lower(),
        USAGE_COMPLETION_TOKENS_HEADER.lower(),
    }
)


class ForwardEndpoint:
    """Pure ASGI for the inference routes: full control of streaming, disconnects and clean-up.

    `poll_soon` asks the node watch for a health poll now; `flag_mismatch` settles a request's receipt check."""

    def __init__(
        self, config: TrackerConfig, registry: NodeRegistry, ledger: TrackerLedger, routes: RouteSigner, reach: NodeReach,
        poll_soon: Callable[[], None], flag_mismatch: Callable[[str], Awaitable[None]], auditor: Auditor | None = None,
    ) -> None:  # fmt: skip
        self.config, self.registry, self.ledger, self.routes, self.reach = config, registry, ledger, routes, reach
        self.poll_soon, self.flag_mismatch = poll_soon, flag_mismatch
        self.auditor = auditor  # proof of model; None when no verifier is named

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One of `contract/openai_paths.INFERENCE_PATHS`, forwarded to a node."""
        request = Request(scope, receive)
        try:
            body = await limited_body(request, self.config.max_body_bytes)
            payload = parse_json_object(body)  # the node's parser: what it would refuse is refused here
            model = payload.get("model")
            if not isinstance(model, str) or not model:
                raise ApiError(400, "missing_model", "'model' is required")
            # One deadline for the whole forward, first byte to last: a node that trickles forever
            # does not hold the tracker (and a client) for longer than this.
            deadline = anyio.current_time() + self.config.forward_total_timeout_s
            prompt_tokens = prompt_ceiling(payload)
            with anyio.move_on_at(deadline) as opening:
                upstream, node, request_id, timing, written, sent = await self._open(scope["path"], model, payload, body, prompt_tokens)
            if opening.cancelled_caught:
                raise ApiError(504, "node_timeout", "no node answered in time")
        except ApiError as refusal:
            await send_error(send, refusal)
            return
        # The forwarded row was synced while the node worked; the client's first byte waits for it.
        if (unrecorded := await _unrecorded(written, request_id)) is not None:
            node.ended(timing.model)
            with anyio.CancelScope(shield=True):
                await upstream.aclose()  # the node's receipt for it, if any, names a request never routed here
            await send_error(send, unrecorded)
            return
        content_type = next((value for name, value in upstream.headers if name.lower() == "content-type"), "")
        meter = ForwardMeter(content_type.startswith("text/event-stream"), payload)
        # Drawn here, on the tracker, so the node cannot tell an audited answer from another. Only the node's first
        # model is audited (an audited model is routed nowhere else: `registry.NodeRegistry.audited_models`).
        audited = self.auditor is not None and timing.model is node.primary()
        capture = self.auditor.draw(node, scope["path"], payload, meter.event_stream, sent is not body) if audited else None  # type: ignore[union-attr]
        # The log-probabilities the tracker asked for (answer_evidence) are the audit's, not the client's.
        stripper = LogprobStripper(meter.event_stream) if sent is not body and upstream.status == 200 else None
        route_ceiling = (self.routes.route_max_tokens(scope["path"], payload) or 0) * requested_choices(payload)
        outcome: Outcome = "cancelled"
        delivery = _Delivery()
        try:
            headers = forwarded_headers(upstream.headers)
            await start_answer(send, upstream.status, headers)
            with anyio.CancelScope() as forward:

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    forward.cancel()

                # A bare asyncio task rather than an anyio task group, as in the node's proxy: the
                # group cost ~50 µs of CPU a request (bench/RESULTS.md, "Round 4").
                watcher = asyncio.get_running_loop().create_task(watch_disconnect())
                try:
                    with anyio.move_on_at(deadline) as forwarding:
                        outcome = await self._pump(upstream, meter, send, timing, delivery, capture, stripper)
                    if forwarding.cancelled_caught:
                        outcome = "timed_out"
                        log.warning("request %s to %s ran past %.0f s; cut", request_id, node.node_id, self.config.forward_total_timeout_s)
                        await send_body(send, b"", more=False)
                finally:
                    watcher.cancel()
        except OSError:
            outcome = "cancelled"  # the client went away while we were sending
        finally:
            node.ended(timing.model)
            if outcome == "cancelled" and delivery.terminal_sent:
                # The client left after the stream's [DONE] reached it (the openai SDK closes on it) while
                # the node's stream was still closing: it had the whole answer, whichever came first.
                outcome = "upstream_error" if meter.error else "complete"
            # A stream that started its model's load times no first token (the load is in it), only its decode;
            # its first token says what the load took.
            if outcome == "complete" and upstream.status < 400 and (sample := timing.sample()) is not None:
                timing.speed.record(sample, first_token=not timing.cold)
                if timing.cold:
                    timing.model.load_seen(sample.ttft_s, timing.speed.ttft_s(sample.prompt_tokens))
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
                if upstream.status >= 400:
                    outcome = "refused"
                # Only what went by counts: the node's own usage figures are its receipt's business.
                counts = meter.counted()
                completion_ceiling = 0 if outcome == "refused" else meter.completion_ceiling(route_ceiling)
                await self.ledger.finish_request(request_id, upstream.status, outcome, counts, completion_ceiling=completion_ceiling)
                log.info(
                    "request %s -> %s: %s %s, %s content events, completion ceiling %d", request_id, node.node_id,
                    upstream.status, outcome, counts.completion_tokens, completion_ceiling,
                )  # fmt: skip
                await self.flag_mismatch(request_id)
                if capture is not None and outcome == "complete" and upstream.status == 200:
                    self.auditor.settled(node, scope["path"], sent, payload, capture)  # type: ignore[union-attr]

    async def _open(
        self, path: str, model: str, payload: dict[str, Any], body: bytes, prompt_tokens: int
    ) -> tuple[HttpAnswer, NodeEntry, str, StreamTiming, asyncio.Future[int], bytes]:
        """The node's answer, the node, the request's id, its timing, its forwarded row, and the body as routed: `body`
        itself, or one that asks for the audit's evidence (`answer_evidence`) where the node's model is audited."""
        if not self.registry.serves(model):
            raise ApiError(404, "model_not_found", f"no node serves {model!r}; GET /v1/models lists what is served")
        stream = payload.get("stream") is True
        max_tokens = self.routes.route_max_tokens(path, payload)
        tried: set[str] = set()
        for _ in range(MAX_ROUTE_ATTEMPTS):
            node = self.registry.pick(model, exclude=tried, prompt_tokens=prompt_tokens)
            served = None if node is None else node.model_for(model)
            if node is None or served is None:
                break
            tried.add(node.node_id)
            request_id = f"req-{uuid.uuid4().hex}"
            audited = self.auditor is not None and served is node.primary() and self.auditor.verifier_for(node) is not None
            sent = (evidence_body(path, payload) if audited else None) or body
            token = self.routes.sign_route(node, request_id, path, model, sent, max_tokens)
            # Synced on the ledger's thread while the node works on the request (protocol §6, rule 5).
            written = self.ledger.open_request_soon(
                request_id, node.node_id, served.model_id, path, stream,  # billed as the node serves it
                max_tokens=max_tokens, choices=requested_choices(payload), body_bytes=len(body), prompt_ceiling=prompt_tokens,
            )  # fmt: skip
            headers = {
                "content-type": "application/json",
                "accept-encoding": "identity",  # forward bytes as the node wrote them
                ROUTE_HEADER: token,
                REQUEST_ID_HEADER: request_id,
                "x-request-id": request_id,
            }
            timing = StreamTiming(node, prompt_tokens, served)
            node.started(served)
            timing.cold = self.registry.routed_to(node, served)
            try:
                upstream = await node.target.send(self.reach.clients, "POST", path, headers, sent)
            except HttpConnectError as exc:  # the node never saw the request
                node.ended(served)
                node.healthy = False  # until the next health poll says otherwise
                self.poll_soon()
                log.warning("node %s unreachable (%s); trying another", node.node_id, exc)
                await _unrecorded(written, request_id)
                await self.ledger.finish_request(request_id, None, "refused", None)
                continue
            except HttpClientError as exc:
                node.ended(served)
                await _unrecorded(written, request_id)
                await self.ledger.finish_request(request_id, None, "upstream_error", None)
                raise ApiError(502, "node_failed", f"node {node.node_id} failed: {exc}") from None
            return upstream, node, request_id, timing, written, sent
        raise ApiError(
            503,
            "no_node_available",
            f"no ready node for {model!r} right now; retry shortly",
            headers={"retry-after": str(max(1, int(self.config.heartbeat_interval_s)))},
        )

    async def _pump(
        self, upstream: HttpAnswer, meter: ForwardMeter, send: Send, timing: StreamTiming, delivery: _Delivery,
        capture: AnswerCapture | None = None, stripper: LogprobStripper | None = None,
    ) -> Outcome:  # fmt: skip
        try:
            async for chunk in upstream.iter_chunks():
                events = meter.content_events
                meter.feed(chunk)
                if capture is not None:
                    capture.feed(chunk)
                if meter.content_events != events:
                    timing.tokens(meter.content_events)
                if stripper is not None:
                    chunk = stripper.feed(chunk)
                if chunk:
                    await send_body(send, chunk, more=True)
                delivery.terminal_sent = meter.done
        except HttpClientError as exc:
            log.warning("forward from node broke: %s", exc)
            # A stream cut short ends with an OpenAI-style error event, so SDK clients raise instead of hanging.
            tail = _stream_error_event(f"the node's answer broke off: {exc}") if meter.event_stream else b""
            await send_body(send, (stripper.end() if stripper is not None and meter.event_stream else b"") + tail, more=False)
            return "upstream_error"
        await send_body(send, stripper.end() if stripper is not None else b"", more=False)
        if meter.error or (meter.event_stream and not meter.done):
            return "upstream_error"
        return "complete"


class StreamTiming:
    """Times one forward for the node's speed estimate: sent, first and last content event, and the
    node's load meanwhile. Kept with the `NodeSpeed` of the model and the registration it was sent under,
    so a stream that ends after its node registered again does not feed the new estimate. `cold`: it
    started its model's load (its first token waited for it: not a speed to learn)."""

    def __init__(self, node: NodeEntry, prompt_tokens: int, model: ModelOnNode | None = None) -> None:
        self.model = model or node.primary()
        self.node, self.speed, self.prompt_tokens = node, self.model.speed, prompt_tokens
        self.cold = False
        self.busy_before = node.busy()
        self.sent = time.monotonic()
        self.first: float | None = None
        self.last = 0.0
        self.events = 0
        self._concurrency_sum = 0
        self._concurrency_n = 0

    def tokens(self, events: int) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
        self.last, self.events = now, events
        # The node's requests in flight while this one decodes, this one included.
        self._concurrency_sum += self.node.in_flight
        self._concurrency_n += 1

    def sample(self) -> StreamSample | None:
        if self.first is None:
            return None  # not a stream, or nothing generated: no first token to time
        return StreamSample(
            prompt_tokens=self.prompt_tokens,
            ttft_s=self.first - self.sent,
            busy_before=self.busy_before,
            decode_tokens=self.events - 1,
            decode_s=self.last - self.first,
            concurrency=self._concurrency_sum / max(self._concurrency_n, 1),
        )


class _Delivery:
    """What reached the client of one forward: `terminal_sent` once the chunk holding the stream's
    `data: [DONE]` was handed to the server, so the outcome does not hang on what closes first."""

    __slots__ = ("terminal_sent",)

    def __init__(self) -> None:
        self.terminal_sent = False


async def _unrecorded(written: asyncio.Future[int], request_id: str) -> ApiError | None:
    """Wait for a forwarded row to be synced; the refusal to answer with when it never will be."""
    try:
        # Shielded: a forward cut short while waiting leaves the row to finish, and then be settled.
        await asyncio.shield(written)
    except Exception as exc:  # a full or broken disk: deliver nothing that cannot be billed
        log.error("request %s: could not write its forwarded row, its answer withheld: %s", request_id, exc)
        return ApiError(503, "ledger_unavailable", "this tracker cannot record requests right now; retry shortly",
                        headers={"retry-after": str(LEDGER_RETRY_AFTER_S)})  # fmt: skip
    return None


def forwarded_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """The node's headers a client sees (FORWARDED_RESPONSE_HEADERS), names in lower case, a repeated
    one joined with ", " where it first stood."""
    kept: dict[str, str] = {}
    for name, value in headers:
        key = name.lower()
        if key in FORWARDED_RESPONSE_HEADERS:
            kept[key] = f"{kept[key]}, {value}" if key in kept else value
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in kept.items()]


def _stream_error_event(message: str) -> bytes:
    return b"data: " + openai_error_body(message, "server_error", "upstream_broken") + b"\n\n"
