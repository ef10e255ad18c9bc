"""Incremental Server-Sent-Events splitter over raw bytes.

It finds event boundaries in a byte stream so a copy can be metered and the
forwarded bytes stay exactly what the upstream sent. It never re-frames: each
event comes back as the raw slice it was, terminator included.
"""

from __future__ import annotations

import re

# A blank line ends an event. llama-server writes "\n"; CRLF and CR are the
# other line ends the SSE spec allows. (A mixed "\r\n\n" ending is not handled:
# no server we speak to writes one.)
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE_SPLIT = re.compile(rb"\r\n|\n|\r")
DONE_DATA = b"[DONE]"


class SSESplitter:
    """Feed raw chunks, get back complete raw events; the incomplete tail waits for more bytes."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buffer = self._pending + chunk if self._pending else chunk
        events: list[bytes] = []
        start = 0
        if b"\r" not in buffer:
            # Fast path for llama-server's "\n\n" framing: plain find() beats the regex.
            while (end := buffer.find(b"\n\n", start)) != -1:
                events.append(buffer[start : end + 2])
                start = end + 2
        else:
            for match in _EVENT_END.finditer(buffer):
                events.append(buffer[start : match.end()])
                start = match.end()
        self._pending = buffer[start:]
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet terminated."""
        return self._pending


def event_data(raw_event: bytes) -> bytes | None:
    """The event's `data` field (lines joined by "\\n"), or None when it has none (comments, pings)."""
    data_lines = []
    for line in _LINE_SPLIT.split(raw_event):
        if line.startswith(b"data:"):
            value = line[5:]
            data_lines.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(data_lines) if data_lines else None


def is_comment(raw_event: bytes) -> bool:
    return raw_event.startswith(b":")


def comment_event(text: str) -> bytes:
    """An SSE comment event; standard clients (the openai SDK too) ignore these."""
    return b": " + text.replace("\n", " ").encode() + b"\n\n"


def data_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
