"""Metering: what one request used, read from a copy of llama-server's answer as it passes.

The proxy forwards bytes unchanged; these functions look at the same bytes and
fill a `RequestMeter`, which becomes the request's one `UsageRecord`. The hot
path (`meter_events`, one call per upstream read) builds nothing unless an
event must be added or dropped, and reads the clock once per call.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from meshnet_gguf.protocol import USAGE_COMMENT_PREFIX, FinishReason, UsageRecord
from meshnet_gguf.sse import comment_event

_FINISH_RE = re.compile(rb'"finish_reason":"([a-z_]+)"')


@dataclass
class RequestMeter:
    """What one request used and how it went, filled in as its answer passes through."""

    request_id: str
    path: str
    stream: bool
    client_wants_usage: bool
    started_at: float
    started: float  # perf_counter at admission
    status: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    content_events: int = 0
    finish_reason: FinishReason = "unknown"
    first_token_at: float | None = None
    decode_tokens_per_s: float | None = None
    usage_seen: bool = False
    # Gives the admission slot back; called just before the answer's last bytes so a
    # client that sends its next request the moment this one ends is not refused.
    release: Callable[[], None] = lambda: None

    def note_usage(self, usage: Mapping[str, Any], timings: Mapping[str, Any] | None) -> None:
        self.usage_seen = True
        self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens = int(details.get("cached_tokens") or 0)
        if timings and timings.get("predicted_per_second"):
            self.decode_tokens_per_s = float(timings["predicted_per_second"])

    def usage_comment(self) -> bytes:
        return comment_event(
            USAGE_COMMENT_PREFIX
            + json.dumps(
                {
                    "request_id": self.request_id,
                    "prompt_tokens": self.prompt_tokens,
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
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.tokens_out(),
            finish_reason=self.finish_reason,
            started_at=self.started_at,
            duration_s=now - self.started,
            ttft_s=(self.first_token_at - self.started) if self.first_token_at else None,
            decode_tokens_per_s=self.decode_tokens_per_s,
        )


def meter_events(meter: RequestMeter, events: list[bytes]) -> tuple[list[bytes] | None, bool]:
    """Meter complete SSE events; return (what to forward instead of them, or None when they go
    out unchanged; whether [DONE] passed).

    Hot path (one call per upstream read): the replacement list is only built once an event
    is added or dropped, and the clock is read once per call (the events arrived together).
    """
    out: list[bytes] | None = None
    done = False
    now = 0.0
    for i, event in enumerate(events):
        keep = True
        extra = None
        if event.startswith(b":"):
            pass  # llama-server keep-alive pings pass through
        elif event.startswith(b"data: [DONE]"):
            extra = meter.usage_comment()
            done = True
        elif b'"choices":[]' in event and b'"usage"' in event:
            _meter_usage_event(meter, event)
            keep = meter.client_wants_usage
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
        if out is None and (extra is not None or not keep):
            out = events[:i]
        if out is not None:
            if extra is not None:
                out.append(extra)
            if keep:
                out.append(event)
    return out, done


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
    meter.note_usage(chunk.get("usage") or {}, chunk.get("timings"))


def meter_whole_body(meter: RequestMeter, body: bytes) -> None:
    try:
        answer = json.loads(body)
    except ValueError:
        return
    if not isinstance(answer, dict):
        return
    meter.note_usage(answer.get("usage") or {}, answer.get("timings"))
    choices = answer.get("choices") or []
    if choices and isinstance(choices[0], dict) and choices[0].get("finish_reason"):
        meter.finish_reason = _finish_reason(str(choices[0]["finish_reason"]))
    elif meter.path == "/v1/embeddings":
        meter.finish_reason = "stop"


def _finish_reason(value: str) -> FinishReason:
    return value if value in ("stop", "length", "tool_calls") else "unknown"  # type: ignore[return-value]


__all__ = ["RequestMeter", "meter_events", "meter_whole_body"]
