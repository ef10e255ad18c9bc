"""The node's inference forwarding: OpenAI's inference routes answered by llama-server, behind the node's admission.

The listener's table (`serving/node_surface`) hands it the requests of its inference rows (the listing
rows are `model_listing`'s). It admits a request (through its admission mode: standalone or meshed;
size and JSON checks; one of its slots per request), forwards it to llama-server with the internal
key, streams the answer back byte for byte as it arrives, meters a copy, and hands one `UsageRecord`
per request to the usage sinks. It knows nothing about the child process: it is
given a callable that says where llama-server is right now, or that it is not.

Admission policy: no queue. When every llama-server slot is busy the proxy
answers 503 with `Retry-After` at once, so the tracker (which routes to the
least busy node) or the client can go elsewhere instead of waiting blind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import anyio

from meshnet_gguf.common.asgi import CLIENT_CLOSED_STATUS, Receive, Send, forwardable, respond
from meshnet_gguf.common.logs import request_id_var
from meshnet_gguf.contract.errors import ApiError, openai_error_body
from meshnet_gguf.contract.openai_paths import GENERATING_PATHS as STREAMING_ROUTES  # the node's name: they may stream
from meshnet_gguf.contract.openai_paths import INFERENCE_PATHS as INFERENCE_ROUTES
from meshnet_gguf.contract.protocol import (
    USAGE_COMPLETION_TOKENS_HEADER,
    USAGE_PROMPT_TOKENS_HEADER,
    HealthReport,
    UsageRecord,
)
from meshnet_gguf.contract.sse import DONE_DATA, data_event
from meshnet_gguf.contract.strict_json import parse_json_object
from meshnet_gguf.llama.model_children import ModelChildren, ModelFailed, ModelUnavailable
from meshnet_gguf.llama.upstream import UpstreamClient, UpstreamError, UpstreamResponse
from meshnet_gguf.serving.slots import Slots
from meshnet_gguf.serving.admission_modes import AdmissionMode, Recording, RouteGrant, unavailable
from meshnet_gguf.serving.meter import RequestMeter, StreamMeter, meter_whole_body
from meshnet_gguf.serving.model_listing import ModelListing, ServedName
from meshnet_gguf.serving.prompt_count import PromptCount, PromptCounter
from meshnet_gguf.serving.request_ids import REQUEST_ID_KEY, client_request_id, send_refusal
from meshnet_gguf.serving.request_validation import rewrite_top_level, validate_request
from meshnet_gguf.serving.routes import Request
from meshnet_gguf.serving.upstream_hints import node_hint
from meshnet_gguf.serving.upstream_target import UpstreamTarget, upstream_headers

log = logging.getLogger(__name__)

# ASGI header names are lower-case bytes.
_PROMPT_TOKENS_KEY = USAGE_PROMPT_TOKENS_HEADER.lower().encode()
_COMPLETION_TOKENS_KEY = USAGE_COMPLETION_TOKENS_HEADER.lower().encode()

_STREAM_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class UsageSink(Protocol):
    async def record(self, usage: UsageRecord) -> None: ...


@dataclass(frozen=True)
class ProxyLimits:
    max_body_bytes: int
    retry_after_s: int
    # The operator's ceiling on completion tokens per request; a route's cap can only lower it.
    max_tokens_cap: int | None = None


class ProxyApp:
    """The inference rows' handler (`serve_inference`). Everything a request goes through is given here, once, at construction."""

    def __init__(
        self,
        *,
        upstream: Callable[[], UpstreamTarget | None],
        client: UpstreamClient,
        slots: Slots,
        prompt_counter: PromptCounter,
        limits: ProxyLimits,
        model_name: str,
        health: Callable[[], HealthReport],
        model_aliases: Sequence[str] = (),
        mode: AdmissionMode,
        usage_sinks: Sequence[UsageSink] = (),
        on_rejected: Callable[[str, int], None] | None = None,
        others: ModelChildren | None = None,
    ) -> None:
        self._upstream = upstream
        self._client = client
        self.slots = slots
        self.limits = limits
        # The models served beside the first (one llama-server each, loaded on demand), by the request's `model`.
        self.others = others
        # Beside the node's slots, each model's own: a model's requests in flight never outnumber its llama-server's
        # slots (no queue, per model as per node); the first model's are the node's less the others'.
        self._model_slots = (
            {model_name: Slots(total=max(1, slots.total - sum(m.slots for m in others.models)))}
            | {m.alias: Slots(total=m.slots) for m in others.models}
            if others is not None
            else {}
        )
        self.served = ServedName(model_name, tuple(model_aliases), tuple(others.models.aliases) if others else ())
        self.model_name = model_name
        self._health = health
        self._usage_sinks = tuple(usage_sinks)
        self._mode = mode
        self._counter = prompt_counter
        # Told (path, status) of each request refused before reaching llama-server: such
        # requests yield no usage record (nothing was used, and nothing is billed).
        self._on_rejected = on_rejected
        # The listing rows (`GET /v1/models`, `/v1/models/{id}`), behind the same mode and readiness.
        self.listing = ModelListing(self.served, self._ready_target, client, mode, limits.retry_after_s, others)

    # --- inference --------------------------------------------------------
    async def serve_inference(self, request: Request, path: str) -> None:
        """`path` (one of `INFERENCE_ROUTES`) forwarded to llama-server, once admitted."""
        if self.others is None:  # one model: nothing to hold loaded
            await self._serve_inference(request, path, None)
            return
        # A model beside the first is held loaded from its admission until its answer is recorded (`_target_for`).
        async with contextlib.AsyncExitStack() as model_held:
            await self._serve_inference(request, path, model_held)

    async def _serve_inference(self, request: Request, path: str, model_held: contextlib.AsyncExitStack | None) -> None:
        headers, receive, send = request.headers, request.receive, request.send
        request_id = client_request_id(headers)
        # Each request runs in its own task, so the id stays with this request's log lines.
        request_id_var.set(request_id)
        release: Callable[[], None] | None = None
        try:
            if self.slots.draining:
                raise self._unavailable("This node is draining for shutdown; retry on another node")
            # Who may send a body is settled before a byte of it is read.
            grant = self._mode.admit(headers, path)
            if grant.request_id is not None:  # a route names the id the request is billed under
                request_id = grant.request_id
                request_id_var.set(request_id)
            body = await request.body()
            self._mode.check_body(grant, body)
            payload = parse_json_object(body)
            required = INFERENCE_ROUTES[path]
            if required not in payload:
                raise ApiError(400, "missing_field", f"'{required}' is required for {path}")
            validate_request(path, payload)
            model_name, target = await self._target_for(payload.get("model"), model_held)
            release = self._take_slot(model_name)
            meter = RequestMeter(
                request_id=request_id,
                path=path,
                stream=path in STREAMING_ROUTES and payload.get("stream") is True,
                started_at=time.time(),
                started=time.perf_counter(),
            )
            # From here the request is going to run: the mode uses up its grant (in memory) before
            # llama-server sees it, and starts recording it (a meshed node's synced ledger row) while
            # the request is forwarded; the answer's first byte waits for that record (`_HeldSend`).
            recording = self._mode.commit(grant, partial(meter.usage_record, model_name), body)
        except ApiError as exc:
            if release is not None:
                release()
            if self._on_rejected is not None:
                self._on_rejected(path, exc.status)
            await send_refusal(send, exc, request_id)
            return

        meter.release = release
        count = PromptCount(
            partial(self._counter.count, target, path, payload, body), on_counted=partial(self._mode.prompt_counted, request_id)
        )
        if not self._mode.keeps_request_body:  # else counted from the kept body, only if the answer does not say
            count.count_beside()  # nothing could count this prompt after llama-server is gone
        held = _HeldSend(send, recording)
        try:
            upstream_body = _prepare_upstream_body(payload, body, self._token_cap(path, grant))
            await self._forward(meter, target, upstream_body, receive, held, count)
        except _NotRecorded:
            pass  # nothing reached the client; said below
        finally:
            release()
            with anyio.CancelScope(shield=True):
                # Billing needs the record durable first; a request whose record never got there was
                # answered to nobody and is billed nothing (its usage goes to no sink).
                refusal = await held.refusal()
                if refusal is not None:
                    count.drop()
                    if self._on_rejected is not None:
                        self._on_rejected(path, refusal.status)
                    await send_refusal(send, refusal, request_id)
                else:
                    if meter.usage_seen or meter.refused_upstream:
                        count.drop()
                    else:
                        meter.prompt_counted = await count.settled()
                    await self._record(meter, model_name)

    async def _forward(
        self,
        meter: RequestMeter,
        target: UpstreamTarget,
        body: bytes,
        receive: Receive,
        send: Send,
        count: PromptCount,
    ) -> None:
        disconnected = False
        with anyio.CancelScope() as exchange:

            async def watch_disconnect() -> None:
                nonlocal disconnected
                while (await receive())["type"] != "http.disconnect":
                    pass
                if meter.answered:
                    return  # the client closed after its answer, as a client may
                disconnected = True
                if meter.stream:
                    # Closing the stream is what stops llama-server's generation.
                    exchange.cancel()
                # A whole answer is read to its end all the same: llama-server does not notice
                # the client left and generates it in full, so it is billed in full.

            # A bare asyncio task (the node's loop is asyncio's), not an anyio task group: with
            # the group, watching cost each request ~50 µs of CPU; the task and the scope cost ~8
            # (bench/request_cost.py; bench/RESULTS.md, "Round 4").
            watcher = asyncio.get_running_loop().create_task(watch_disconnect())
            try:
                await self._exchange(meter, target, body, send, count)
            finally:
                watcher.cancel()
        # `disconnected` is only set for a client that left before its answer was handed over.
        cut_short = meter.finish_reason == "unknown" or not meter.stream
        if disconnected and cut_short and meter.finish_reason != "error":
            meter.finish_reason = "cancelled"
            meter.status = CLIENT_CLOSED_STATUS

    async def _exchange(self, meter: RequestMeter, target: UpstreamTarget, body: bytes, send: Send, count: PromptCount) -> None:
        url = target.base_url + meter.path
        try:
            response = await self._client.send("POST", url, upstream_headers(target, stream=meter.stream), body)
        except UpstreamError as exc:
            meter.finish_reason = "error"
            meter.status = 503
            await send_refusal(send, self._unavailable(f"llama-server is not answering: {exc}"), meter.request_id)
            return
        try:
            if meter.stream and response.status == 200:
                await self._forward_stream(meter, response, send, count)
            else:
                await self._forward_whole(meter, response, send, count)
        finally:
            # Shielded: on client disconnect this runs inside a cancelled scope, and
            # closing is what tells llama-server to free the slot.
            with anyio.CancelScope(shield=True):
                await response.aclose()

    async def _forward_whole(self, meter: RequestMeter, response: UpstreamResponse, send: Send, count: PromptCount) -> None:
        try:
            body = await response.read()
        except UpstreamError as exc:
            meter.finish_reason = "error"
            meter.status = 502
            await send_refusal(send, ApiError(502, "upstream_failed", f"llama-server failed mid-answer: {exc}"), meter.request_id)
            return
        if response.status >= 500 and (refusal := await count.refusal()) is not None:
            # llama-server's template could not read this chat (its counting answered 400 and
            # its generation a 500): the client's error, said as one, like a counted-first request.
            meter.finish_reason, meter.status, meter.refused_upstream = "error", refusal.status, True
            meter.release()
            meter.answered = True
            await send_refusal(send, refusal, meter.request_id)
            return
        meter.status = response.status
        meter.first_token_at = time.perf_counter()
        if response.status == 200:
            meter_whole_body(meter, body)
        else:
            meter.finish_reason = "error"
            meter.refused_upstream = True
            body = node_hint(meter.path, response.status, body) or body
        headers = forwardable(response.headers)
        headers += [
            (REQUEST_ID_KEY, meter.request_id.encode()),
            (_PROMPT_TOKENS_KEY, str(meter.prompt_tokens).encode()),
            (_COMPLETION_TOKENS_KEY, str(meter.completion_tokens).encode()),
        ]
        meter.release()
        meter.answered = True
        await respond(send, response.status, body, headers)

    async def _forward_stream(self, meter: RequestMeter, response: UpstreamResponse, send: Send, count: PromptCount) -> None:
        meter.status = 200
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*_STREAM_HEADERS, (REQUEST_ID_KEY, meter.request_id.encode())],
            }
        )
        relay = StreamMeter(meter)
        done_sent = False
        try:
            async for chunk in response.iter_chunks():
                body, done = relay.feed(chunk)
                done_sent = done_sent or done
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    count.begin()
        except UpstreamError as exc:
            log.warning("request %s: llama-server stream broke: %s", meter.request_id, exc)
            meter.finish_reason = "error"
        if not done_sent:
            if meter.finish_reason != "error":
                # The stream ended without [DONE]: llama-server went away between events.
                meter.finish_reason = "error"
            error = openai_error_body("llama-server stopped mid-answer", "server_error", 502, with_param=False)
            meter.prompt_counted = await count.settled()  # the usage comment below bills it
            await send(
                {
                    "type": "http.response.body",
                    "body": data_event(error) + meter.usage_comment() + data_event(DONE_DATA),
                    "more_body": True,
                }
            )
        meter.release()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # --- admission helpers --------------------------------------------------
    def _token_cap(self, path: str, grant: RouteGrant) -> int | None:
        """The most completion tokens this request may produce: the smallest of the route's and the operator's caps
        (the client's own `max_tokens` is kept when smaller)."""
        caps = [grant.max_tokens]
        if path in STREAMING_ROUTES:
            caps.append(self.limits.max_tokens_cap)
        given = [cap for cap in caps if cap is not None]
        return min(given) if given else None

    def _take_slot(self, model_name: str) -> Callable[[], None]:
        """One of the node's slots and, on a node of several models, one of the model's; its release gives both back."""
        release = self.slots.try_acquire(1)
        if release is None:
            raise self._unavailable(f"All {self.slots.total} slots of this node are busy; retry shortly")
        own = self._model_slots.get(model_name)
        if own is None:
            return release
        model_release = own.try_acquire(1)
        if model_release is None:
            release()
            raise self._unavailable(f"All {own.total} slots of model {model_name} are busy; retry shortly")

        def release_both() -> None:
            release()
            model_release()

        return release_both

    async def _target_for(self, requested: object, model_held: contextlib.AsyncExitStack | None) -> tuple[str, UpstreamTarget]:
        """The model a request names (its id, as usage records name it) and where its llama-server is: the first
        model's, or a model beside it, loaded first if need be and held loaded for the request (`model_held`)."""
        other = self.others.models.get(requested) if self.others is not None and isinstance(requested, str) else None
        if other is None:
            self.served.check(requested)
            return self.model_name, self._ready_target()
        assert self.others is not None and model_held is not None
        try:
            llama = await model_held.enter_async_context(self.others.using(other.alias))
        except ModelFailed as exc:
            # Not a moment's wait: the model stays failed until the operator loads it again; the others serve.
            raise ApiError(503, "model_unavailable", f"{exc}; the node's other models still serve") from None
        except ModelUnavailable as exc:
            raise self._unavailable(str(exc)) from None
        if llama.base_url is None:  # unloaded between its load and this line: said as any model not ready is
            raise self._unavailable(f"model {other.alias} is not ready; retry shortly")
        return other.alias, UpstreamTarget(base_url=llama.base_url, api_key=llama.api_key)

    def _ready_target(self) -> UpstreamTarget:
        target = self._upstream()
        if target is None:
            state = self._health().state
            raise self._unavailable(f"llama-server is not ready (state: {state}); retry shortly")
        return target

    def _unavailable(self, message: str) -> ApiError:
        return unavailable(message, self.limits.retry_after_s)

    async def _record(self, meter: RequestMeter, model_name: str) -> None:
        record = meter.usage_record(model_name)
        for sink in self._usage_sinks:
            try:
                await sink.record(record)
            except Exception:  # one broken sink must not take the others (or the request) down
                log.exception("usage sink %r failed for request %s", sink, meter.request_id)


# --- the first byte waits for the record -------------------------------------
class _NotRecorded(Exception):
    """Raised out of the forward when its request's record will never be durable: nothing is sent."""


class _HeldSend:
    """The client's `send` for a forwarded request, holding its first message until the request's
    record is durable (protocol §6, rule 1): no byte of an answer, nor an error about it, reaches a
    client for a request that could not be billed. Later messages pass straight through."""

    __slots__ = ("_send", "_recording", "_refusal", "_checked")

    def __init__(self, send: Send, recording: Recording) -> None:
        self._send, self._recording = send, recording
        self._refusal: ApiError | None = None
        self._checked = False

    async def __call__(self, message: dict[str, Any]) -> None:
        if not self._checked:
            await self._check()
            if self._refusal is not None:
                raise _NotRecorded
        await self._send(message)

    async def refusal(self) -> ApiError | None:
        """Why the record will never be durable (None once it is); waits for it when nothing was sent yet."""
        if not self._checked:
            await self._check()
        return self._refusal

    async def _check(self) -> None:
        try:
            await self._recording.durable()
        except ApiError as exc:
            self._refusal = exc
        self._checked = True


# --- request shaping --------------------------------------------------------
def _prepare_upstream_body(payload: dict[str, Any], body: bytes, max_tokens: int | None) -> bytes:
    """The body llama-server gets: the client's own bytes, with the route's token cap when it has one.

    Streams are not asked for `include_usage`: llama-server's last chunk already carries
    `timings` (prompt and predicted counts), and the client then gets the very stream it
    asked for. The cap rewrites only the keys it sets, so every other value reaches
    llama-server as the client wrote it.
    """
    if max_tokens is None:
        return body
    changes: dict[str, Any] = {}
    for key in ("max_tokens", "max_completion_tokens", "n_predict"):
        asked = payload.get(key)
        if key == "max_tokens" or asked is not None:
            if not isinstance(asked, int) or asked <= 0 or asked > max_tokens:
                changes[key] = max_tokens
    return rewrite_top_level(body, changes) if changes else body


__all__ = ["ProxyApp", "ProxyLimits", "UsageSink"]
