"""The relay's framing, spelt once for the relay, the node and the tracker (docs/protocol.md, "Relay").

Around a tunnel, HTTP/1.1 heads: the node's `GET /v1/relay/tunnel` upgrade and the relay's 101, the
tracker's `CONNECT <node_id>:443` and the relay's bare 200, and the relay's JSON error answers. Inside
a tunnel, before any raw bytes, control messages: each one pydantic model as a JSON object on one
line, at most MAX_RELAY_MESSAGE_BYTES with its newline. A line that is longer, or that is none of the
messages expected, is a `RelayFramingError`, whose `code` is what a relay refuses it with
(`RelayRefused.code`) and whose message is the refusal's text.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar, overload

import anyio
from anyio.abc import ByteSendStream
from anyio.streams.buffered import BufferedByteReceiveStream
from pydantic import BaseModel, ValidationError

from meshnet_gguf.contract.errors import openai_error_body
from meshnet_gguf.contract.relay_wire import (
    MAX_RELAY_MESSAGE_BYTES,
    RELAY_CONNECT_AUTH_SCHEME,
    RELAY_CONNECT_PORT,
    RELAY_TUNNEL_PATH,
    RELAY_UPGRADE_PROTOCOL,
)

First = TypeVar("First", bound=BaseModel)
Second = TypeVar("Second", bound=BaseModel)

MESSAGE_END = b"\n"
HEAD_END = b"\r\n\r\n"
# The relay's answer to a node's upgrade, and to a tracker's authorised CONNECT: nothing follows
# the head but the tunnel's own bytes.
UPGRADED = f"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {RELAY_UPGRADE_PROTOCOL}\r\n\r\n".encode("latin-1")
CONNECT_ESTABLISHED = b"HTTP/1.1 200 Connection Established\r\n\r\n"
_REASONS = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 407: "Proxy Authentication Required", 426: "Upgrade Required",
    431: "Request Header Fields Too Large", 503: "Service Unavailable",
}  # fmt: skip


class RelayFramingError(Exception):
    """A control line too long, or none of the messages expected."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


# --- control messages, one JSON line each ---------------------------------------------
def message_line(message: BaseModel) -> bytes:
    return message.model_dump_json().encode() + MESSAGE_END


async def send_message(stream: ByteSendStream, message: BaseModel) -> None:
    await stream.send(message_line(message))


async def receive_line(buffered: BufferedByteReceiveStream) -> bytes:
    """The next control line (anyio streams), its newline left out."""
    try:
        return await buffered.receive_until(MESSAGE_END, MAX_RELAY_MESSAGE_BYTES)
    except anyio.DelimiterNotFound:
        raise _too_large() from None


async def read_line(reader: asyncio.StreamReader) -> bytes:
    """The next control line (asyncio streams, made with `limit=MAX_RELAY_MESSAGE_BYTES`), newline included."""
    try:
        return await reader.readuntil(MESSAGE_END)
    except asyncio.LimitOverrunError:
        raise _too_large() from None


@overload
def parse_message(line: bytes, model: type[First], /) -> First: ...
@overload
def parse_message(line: bytes, model: type[First], other: type[Second], /) -> First | Second: ...
def parse_message(line: bytes, *models: type[BaseModel]) -> BaseModel:
    """The line as the first of `models` it is; the error names them all and says what the first found wrong."""
    first_problem = ""
    for model in models:
        try:
            return model.model_validate_json(line)
        except ValidationError as exc:
            first_problem = first_problem or exc.errors()[0]["msg"]
    names = " or ".join(m.__name__ for m in models)
    raise RelayFramingError("bad_message", f"expected {names}: {first_problem}")


def _too_large() -> RelayFramingError:
    return RelayFramingError("message_too_large", f"messages are at most {MAX_RELAY_MESSAGE_BYTES} bytes")


# --- the HTTP heads around a tunnel ---------------------------------------------------
def upgrade_request(host: str, port: int) -> bytes:
    """The node's request for a tunnel connection."""
    return (
        f"GET {RELAY_TUNNEL_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: Upgrade\r\nUpgrade: {RELAY_UPGRADE_PROTOCOL}\r\n\r\n"
    ).encode("latin-1")


def upgrade_refusal(answer: bytes) -> str | None:
    """Why the relay's answer to an upgrade is not the 101 a tunnel needs, or None when it is."""
    status_line = answer.split(b"\r\n", 1)[0].decode("latin-1", "replace")
    return None if status_line.startswith("HTTP/1.1 101") else f"relay did not upgrade the tunnel: {status_line!r}"


def connect_request(node_id: str, token: str) -> bytes:
    """The tracker's CONNECT to one node, with its token for this one connection."""
    target = f"{node_id}:{RELAY_CONNECT_PORT}"
    return f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: {RELAY_CONNECT_AUTH_SCHEME} {token}\r\n\r\n".encode(
        "latin-1"
    )


def connect_refusal(answer: bytes) -> str | None:
    """Why the relay's answer to CONNECT does not open the tunnel, or None when it does: a 200 whose head is
    all there is (the node's TLS server speaks only after the tracker's hello, so a byte past the head is the
    relay's own and would be taken for the node's)."""
    status_line = answer.split(b"\r\n", 1)[0].decode("latin-1", "replace")
    if status_line.split(" ")[1:2] != ["200"]:
        return f"the relay answered CONNECT with {status_line!r}"
    if not answer.endswith(HEAD_END):
        return "the relay sent bytes after its answer to CONNECT"
    return None


def http_response(status: int, body: bytes, *, extra: str = "") -> bytes:
    """A whole JSON answer on a connection the relay then closes; `extra` is more header lines, each ending CRLF."""
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    )
    return head.encode("latin-1") + body


def http_error(status: int, code: str, message: str, *, extra: str = "") -> bytes:
    return http_response(status, openai_error_body(message, "relay_error", code), extra=extra)


__all__ = [
    "CONNECT_ESTABLISHED",
    "HEAD_END",
    "UPGRADED",
    "RelayFramingError",
    "connect_refusal",
    "connect_request",
    "http_error",
    "http_response",
    "message_line",
    "parse_message",
    "read_line",
    "receive_line",
    "send_message",
    "upgrade_refusal",
    "upgrade_request",
]
