"""The tracker's own count of a request's tokens, taken from the bytes it forwards.

It reads a copy and never changes what is forwarded. Sources, best first: the
`usage` object llama-server produced (the usage chunk of a stream, or the body
of a plain answer), then the node's in-band `: meshnet-usage {...}` comment,
then the node's `X-Meshnet-Usage-*` headers, and last (a stream cut before any of
those passed) the completion tokens it saw go by, one per content event.

A node chooses what it sends, so the copy is bounded: an event longer than
`MAX_METERED_EVENT_BYTES` ends the metering of that stream (the bytes are still
forwarded), and the event search never rescans bytes it has already searched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from meshnet_gguf.contract.protocol import (
    USAGE_COMMENT_PREFIX,
    USAGE_COMPLETION_TOKENS_HEADER,
    USAGE_PROMPT_TOKENS_HEADER,
    UsageCounts,
)
from meshnet_gguf.contract.sse import DONE_DATA, event_data, is_comment

# A plain (non-streamed) answer is parsed for its `usage` only up to this size;
# bigger ones (large embedding batches) are counted from the node's headers.
MAX_METERED_BODY_BYTES = 16 * 1024 * 1024
# One SSE event of llama-server is a token chunk or the usage chunk, well under 4 KiB; a tool
# call's arguments may be longer. A node sending more without a blank line is not metered further.
MAX_METERED_EVENT_BYTES = 256 * 1024
_COMMENT_PREFIX = b": " + USAGE_COMMENT_PREFIX.encode()
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
# The longest event terminator less one: a terminator split across two chunks is still found.
_TERMINATOR_OVERLAP = 3


class BoundedEventSplitter:
    """Complete raw SSE events out of a byte stream, with a bounded buffer and linear work.

    Returns None once the unterminated tail exceeds `max_event_bytes`: the stream is
    then no longer split (the caller stops metering it).
    """

    def __init__(self, max_event_bytes: int = MAX_METERED_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._buffer = bytearray()
        self._searched = 0
        self.overflowed = False

    def feed(self, chunk: bytes) -> list[bytes] | None:
        if self.overflowed:
            return None
        self._buffer += chunk
        events: list[bytes] = []
        start = 0
        search_from = max(0, self._searched - _TERMINATOR_OVERLAP)
        while (match := _EVENT_END.search(self._buffer, search_from)) is not None:
            events.append(bytes(self._buffer[start : match.end()]))
            start = search_from = match.end()
        del self._buffer[:start]
        self._searched = len(self._buffer)
        if len(self._buffer) > self._max:
            self.overflowed = True
            self._buffer.clear()
        return events


class ForwardMeter:
    def __init__(self, event_stream: bool) -> None:
        self.event_stream = event_stream
        self._splitter = BoundedEventSplitter() if event_stream else None
        self._content_events = 0
        self._body = bytearray()
        self._body_too_big = False
        self._usage: UsageCounts | None = None
        self._comment: UsageCounts | None = None
        self.done = False
        self.error = False

    def feed(self, chunk: bytes) -> None:
        if self._splitter is None:
            if len(self._body) + len(chunk) > MAX_METERED_BODY_BYTES:
                self._body_too_big = True
                self._body.clear()
            elif not self._body_too_big:
                self._body += chunk
            return
        for event in self._splitter.feed(chunk) or ():
            self._meter_event(event)

    def counts(self, headers: Mapping[str, str]) -> UsageCounts | None:
        """The best count seen, or None when the forwarded bytes carried none."""
        if self._splitter is None and not self._body_too_big and self._body:
            self._usage = _usage_of(_json(bytes(self._body))) or self._usage
        if self._usage is not None:
            return self._usage
        if self._comment is not None:
            return self._comment
        prompt = headers.get(USAGE_PROMPT_TOKENS_HEADER.lower()) or headers.get(USAGE_PROMPT_TOKENS_HEADER)
        completion = headers.get(USAGE_COMPLETION_TOKENS_HEADER.lower()) or headers.get(USAGE_COMPLETION_TOKENS_HEADER)
        if prompt is not None and completion is not None and prompt.isdigit() and completion.isdigit():
            return UsageCounts(prompt_tokens=int(prompt), completion_tokens=int(completion))
        if self._content_events:
            return UsageCounts(prompt_tokens=None, completion_tokens=self._content_events)
        return None

    def _meter_event(self, event: bytes) -> None:
        if is_comment(event):
            if event.startswith(_COMMENT_PREFIX):
                self._comment = _usage_of(_json(event[len(_COMMENT_PREFIX) :]), nested=False) or self._comment
            return
        data = event_data(event)
        if data is None:
            return
        if data == DONE_DATA:
            self.done = True
            return
        chunk = _json(data)
        if isinstance(chunk, dict):
            if "error" in chunk:
                self.error = True
            self._usage = _usage_of(chunk) or self._usage
            if _carries_a_token(chunk):
                self._content_events += 1


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _carries_a_token(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
            return True
        if choice.get("text"):
            return True
    return False


def _usage_of(obj: Any, nested: bool = True) -> UsageCounts | None:
    usage = obj.get("usage") if nested and isinstance(obj, dict) else obj
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int):
        return None
    # Embeddings answers carry only prompt (and total) tokens.
    return UsageCounts(prompt_tokens=prompt, completion_tokens=completion if isinstance(completion, int) else 0)
