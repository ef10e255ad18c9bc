"""The tracker's own count of a request's tokens, from what it forwarded and the request it received.

Nothing the node says about its usage counts here: not the `usage` object, not
the `: meshnet-usage` comment, not the `X-Meshnet-Usage-*` headers. A node that
lies there would otherwise be compared with itself. Instead (docs/protocol.md,
section 11, T13):

- completion tokens are bounded by what went by: one per content event of a
  stream (llama-server sends one token per event), or one per byte of generated
  text in a whole answer, plus `COMPLETION_SLACK_TOKENS`, and never more than
  the route allowed;
- prompt tokens are bounded by the request: `PROMPT_BASE_ALLOWANCE_TOKENS`, plus
  `PROMPT_PER_MESSAGE_ALLOWANCE_TOKENS` per message (or input), plus one per
  byte of the request's text (a token id in a pre-tokenized prompt counts one).

These are ceilings: the bill is the node's signed receipt, capped by them.

A node chooses what it sends, so the copy is bounded: an event longer than
`MAX_METERED_EVENT_BYTES` ends the metering of that stream (the bytes are still
forwarded, and the completion ceiling falls back to the route's), and the
event search never rescans bytes it has already searched.
"""

from __future__ import annotations

import json
import re
from typing import Any

from meshnet_gguf.contract.protocol import UsageCounts
from meshnet_gguf.contract.sse import DONE_DATA, event_data, is_comment

# One SSE event of llama-server is a token chunk or the usage chunk, well under 4 KiB; a tool
# call's arguments may be longer. A node sending more without a blank line is not metered further.
MAX_METERED_EVENT_BYTES = 256 * 1024
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


# A whole answer is read for its generated text only up to this size; past it, the route's cap bounds it.
MAX_METERED_BODY_BYTES = 16 * 1024 * 1024
# What a chat template adds around a prompt: BOS, a default system prompt, the generation prompt.
PROMPT_BASE_ALLOWANCE_TOKENS = 128
# Role markers and separators a template puts around each message (or each embeddings input).
PROMPT_PER_MESSAGE_ALLOWANCE_TOKENS = 16
# Tokens an honest node may count beyond the content events the tracker saw (a stop token, a token held
# back as an incomplete UTF-8 sequence). A node that lies is billed at most this much above the truth.
COMPLETION_SLACK_TOKENS = 2
# The request fields a prompt is made of; every string leaf counts its bytes, every number one token.
_PROMPT_FIELDS = ("messages", "prompt", "input", "tools", "functions", "system")
# Bounds the walk over a request's JSON (it is already depth-limited by the parser).
_MAX_WALK_ITEMS = 1_000_000


def prompt_ceiling(payload: dict[str, Any]) -> int:
    """The most prompt tokens the request can hold, whatever the tokenizer."""
    pieces = 0
    for field in ("messages", "input", "prompt"):
        value = payload.get(field)
        if isinstance(value, list):
            pieces += len(value)
        elif value is not None:
            pieces += 1
    return PROMPT_BASE_ALLOWANCE_TOKENS + PROMPT_PER_MESSAGE_ALLOWANCE_TOKENS * pieces + sum(
        _text_size(payload[f]) for f in _PROMPT_FIELDS if f in payload
    )


def _text_size(value: Any) -> int:
    size, stack, seen = 0, [value], 0
    while stack and seen < _MAX_WALK_ITEMS:
        item = stack.pop()
        seen += 1
        if isinstance(item, str):
            size += len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, (int, float)):
            size += 1
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return size


class ForwardMeter:
    """Counts what the tracker forwards: content events of a stream, or the generated text of a whole answer."""

    def __init__(self, event_stream: bool) -> None:
        self.event_stream = event_stream
        self._splitter = BoundedEventSplitter() if event_stream else None
        self.content_events = 0
        self._body = bytearray()
        self._body_too_big = False
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

    def completion_ceiling(self, route_ceiling: int) -> int:
        """The most completion tokens what went by can hold, within the route's own ceiling."""
        if self._splitter is not None:
            if self._splitter.overflowed:
                return route_ceiling
            seen = self.content_events
        else:
            if self._body_too_big:
                return route_ceiling
            seen = _generated_text_bytes(_json(bytes(self._body)))
        return min(route_ceiling, seen + COMPLETION_SLACK_TOKENS)

    def counted(self) -> UsageCounts:
        """What the tracker itself counted: content events of a stream; it counts no prompt tokens."""
        return UsageCounts(prompt_tokens=None, completion_tokens=self.content_events if self.event_stream else None)

    def _meter_event(self, event: bytes) -> None:
        if is_comment(event):
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
            if _carries_a_token(chunk):
                self.content_events += 1


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _generated_text_bytes(answer: Any) -> int:
    """Bytes of the text a whole answer generated: message content, reasoning, tool calls, completion text."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        return 0
    total = 0
    for choice in answer["choices"]:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        if isinstance(message, dict):
            total += _text_size([message.get("content"), message.get("reasoning_content"), message.get("tool_calls")])
        total += _text_size(choice.get("text"))
    return total


def _carries_a_token(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")):
            return True
        if choice.get("text"):
            return True
    return False
