"""Metering: what one request used, read from a copy of llama-server's answer as it passes.

The proxy forwards bytes unchanged; these functions look at the same bytes and
fill a `RequestMeter`, which becomes the request's one `UsageRecord`.

A streamed answer goes through `StreamMeter.feed`, one call per upstream read.
Nearly every read holds only content deltas; for those it does a few byte scans
of the whole read (C speed, no per-event Python work) and forwards the complete
events as they came. Only a read that may hold something the meter must act on
(usage, a finish reason, an error, [DONE], tool calls) is split into events and
goes through `meter_events`.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from meshnet_gguf.contract.openai_paths import EMBEDDINGS_PATH
from meshnet_gguf.contract.protocol import USAGE_COMMENT_PREFIX, FinishReason, UsageRecord
from meshnet_gguf.contract.sse import SSESplitter, comment_event

_FINISH_RE = re.compile(rb'"finish_reason":"([a-z_]+)"')


@dataclass
class RequestMeter:
    """What one request used and how it went, filled in as its answer passes through."""

    request_id: str
    path: str
    stream: bool
    started_at: float
    started: float  # perf_counter at admission
    # The prompt's size as llama-server tokenized it before generation: billed whatever happens next.
    prompt_counted: int = 0
    status: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    content_events: int = 0
    finish_reason: FinishReason = "unknown"
    first_token_at: float | None = None
    decode_tokens_per_s: float | None = None
    usage_seen: bool = False
    # llama-server answered with an error status: it refused the request, nothing ran.
    refused_upstream: bool = False
    # The whole answer is being handed to the client: a disconnect from now on is the
    # client closing after it, not a cancellation.
    answered: bool = False
    # Gives the request's slot back; called just before the answer's last bytes so a
    # client that sends its next request the moment this one ends is not refused.
    release: Callable[[], None] = lambda: None

    def note_usage(self, usage: Mapping[str, Any] | None, timings: Mapping[str, Any] | None) -> None:
        """llama-server's own counts: `usage` when it sent one, else its `timings`
        (a stream without include_usage carries only those, in its last chunk)."""
        if isinstance(usage, Mapping) and usage:
            self.usage_seen = True
            self.prompt_tokens = _count(usage.get("prompt_tokens"))
            self.completion_tokens = _count(usage.get("completion_tokens"))
            details = usage.get("prompt_tokens_details")
            self.cached_tokens = _count(details.get("cached_tokens")) if isinstance(details, Mapping) else 0
        elif isinstance(timings, Mapping) and "predicted_n" in timings:
            self.usage_seen = True
            self.cached_tokens = _count(timings.get("cache_n"))
            self.prompt_tokens = _count(timings.get("prompt_n")) + self.cached_tokens
            self.completion_tokens = _count(timings.get("predicted_n"))
        if isinstance(timings, Mapping) and (rate := _finite_rate(timings.get("predicted_per_second"))) is not None:
            self.decode_tokens_per_s = rate

    def prompt_billed(self) -> int:
        if self.usage_seen:
            return self.prompt_tokens
        return 0 if self.refused_upstream else self.prompt_counted

    def usage_comment(self) -> bytes:
        return comment_event(
            USAGE_COMMENT_PREFIX
            + json.dumps(
                {
                    "request_id": self.request_id,
                    "prompt_tokens": self.prompt_billed(),
                    "cached_tokens": self.cached_tokens,
                    "completion_tokens": self.tokens_out(),
                    "finish_reason": self.finish_reason,
                },
                separators=(",", ":"),
            )
        )

    def tokens_out(self) -> int:
        # Without llama-server's usage chunk (cut short), each content event is one token.
        return self.completion_tokens if self.usage_seen else self.content_events

    def usage_record(self, model: str) -> UsageRecord:
        """The request's one usage record, as the sinks get it."""
        now = time.perf_counter()
        return UsageRecord(
            request_id=self.request_id,
            route=self.path,
            model=model,
            status=self.status,
            stream=self.stream,
            prompt_tokens=self.prompt_billed(),
            cached_tokens=self.cached_tokens,
            completion_tokens=self.tokens_out(),
            finish_reason=self.finish_reason,
            started_at=self.started_at,
            duration_s=now - self.started,
            ttft_s=(self.first_token_at - self.started) if self.first_token_at else None,
            decode_tokens_per_s=self.decode_tokens_per_s,
        )


def _finite_rate(value: Any) -> float | None:
    """A decode speed as a finite float, else None: Python's json reads `NaN` and `1e999`, and the
    usage record refuses a non-finite figure (it goes on the wire, `protocol.WireModel`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        rate = float(value)
    except OverflowError:  # an int past a float's range
        return None
    return rate if math.isfinite(rate) and rate >= 0 else None


def meter_events(meter: RequestMeter, events: list[bytes]) -> tuple[list[bytes] | None, bool]:
    """Meter complete SSE events; return (what to forward instead of them, or None when they go
    out unchanged; whether [DONE] passed).

    Every event llama-server sent is forwarded; the only addition is the `: meshnet-usage`
    comment just before `[DONE]`. Hot path (one call per upstream read): the replacement
    list is only built when that comment goes in, and the clock is read once per call.
    """
    out: list[bytes] | None = None
    done = False
    now = 0.0
    for i, event in enumerate(events):
        if event.startswith(b":"):
            pass  # llama-server keep-alive pings pass through
        elif event.startswith(b"data: [DONE]"):
            if out is None:
                out = events[:i]
            out.append(meter.usage_comment())
            done = True
        elif event.startswith(b"error") or event.startswith(b'data: {"error"'):
            meter.finish_reason = "error"
        else:
            if _carries_a_token(event):
                if not now:
                    now = time.perf_counter()
                meter.content_events += 1
                if meter.first_token_at is None:
                    meter.first_token_at = now
            finish = _FINISH_RE.search(event)
            if finish:
                meter.finish_reason = _finish_reason(finish.group(1).decode())
            # Chat streams send usage in a `"choices":[]` chunk (when asked), completion
            # streams in their last content chunk, and both send `timings` at the end.
            if b'"usage"' in event or b'"timings"' in event:
                _meter_usage_event(meter, event)
        if out is not None:
            out.append(event)
    return out, done


# Any of these in a read sends it down the per-event path (usage or timings are what the
# meter reads its counts from). A finish reason counts only
# as a string (`"finish_reason":null` rides on every delta); "error" catches both an
# `error` event and a `{"error"...}` data event.
_SLOW_PATH_MARKERS = (b'"usage"', b'"timings"', b'"finish_reason":"', b"[DONE]", b"error", b'"tool_calls"', b"\r")


def _needs_events(data: bytes) -> bool:
    """Whether `data` holds any of _SLOW_PATH_MARKERS. Spelled out: `any()` over a generator cost
    2.1 µs a token-sized read, this 1.2 (the generator's frames, not the scans)."""
    return (
        b'"usage"' in data
        or b'"timings"' in data
        or b'"finish_reason":"' in data
        or b"[DONE]" in data
        or b"error" in data
        or b'"tool_calls"' in data
        or b"\r" in data
    )


class StreamMeter:
    """Meters a streamed answer read by read and says what to forward; keeps an event split
    across reads until its end arrives, so only whole events go out."""

    __slots__ = ("meter", "_pending", "_splitter")

    def __init__(self, meter: RequestMeter) -> None:
        self.meter = meter
        self._pending = b""
        self._splitter = SSESplitter()

    def feed(self, chunk: bytes) -> tuple[bytes, bool]:
        """(bytes to forward now, whether [DONE] passed)."""
        data = self._pending + chunk if self._pending else chunk
        if _needs_events(data):
            return self._feed_events(data)
        end = data.rfind(b"\n\n") + 2
        if end < 2:
            self._pending = data
            return b"", False
        complete = data if end == len(data) else data[:end]
        self._pending = data[end:]
        tokens = (
            complete.count(b'"content":"') - complete.count(b'"content":""') + complete.count(b'"text":"') - complete.count(b'"text":""')
        )
        if tokens > 0:
            meter = self.meter
            meter.content_events += tokens
            if meter.first_token_at is None:
                meter.first_token_at = time.perf_counter()
        return complete, False

    def _feed_events(self, data: bytes) -> tuple[bytes, bool]:
        events = self._splitter.feed(data)
        self._pending = b""
        pending = self._splitter.pending
        if pending:
            # The splitter keeps the tail; hand it back to the fast path's buffer instead.
            self._splitter = SSESplitter()
            self._pending = pending
        if not events:
            return b"", False
        replaced, done = meter_events(self.meter, events)
        if replaced is None:
            # Without a tail, the events are `data` itself: forward it as it came.
            return (b"".join(events) if pending else data), done
        return b"".join(replaced), done


def _carries_a_token(event: bytes) -> bool:
    """A generated piece: non-empty content or text, or a tool call. The opening
    `{"role":"assistant","content":null}` delta and the empty closing chunk are not tokens."""
    if b'"content":"' in event:
        return b'"content":""' not in event
    if b'"text":"' in event:
        return b'"text":""' not in event
    return b'"tool_calls"' in event


def _meter_usage_event(meter: RequestMeter, event: bytes) -> None:
    try:
        chunk = json.loads(event[event.index(b"{") :])
    except ValueError:
        return
    if isinstance(chunk, dict):
        meter.note_usage(chunk.get("usage"), chunk.get("timings"))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def meter_whole_body(meter: RequestMeter, body: bytes) -> None:
    try:
        answer = json.loads(body)
    except ValueError:
        return
    if not isinstance(answer, dict):
        return
    meter.note_usage(answer.get("usage"), answer.get("timings"))
    choices = answer.get("choices") or []
    if choices and isinstance(choices[0], dict) and choices[0].get("finish_reason"):
        meter.finish_reason = _finish_reason(str(choices[0]["finish_reason"]))
    elif meter.path == EMBEDDINGS_PATH:
        meter.finish_reason = "stop"


def _finish_reason(value: str) -> FinishReason:
    return value if value in ("stop", "length", "tool_calls") else "unknown"  # type: ignore[return-value]


__all__ = ["RequestMeter", "StreamMeter", "meter_events", "meter_whole_body"]
