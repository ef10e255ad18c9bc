"""Which id a request of the node's OpenAI rows goes by, and how a refusal of one carries it back.

A client may name its request (`x-request-id`); the node answers with the id it went by
(`x-meshnet-request-id`), on its answer and on every refusal, so a client's log and the node's meet.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping

from meshnet_gguf.common.asgi import Send
from meshnet_gguf.contract.error_answer import send_error
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.protocol import REQUEST_ID_HEADER

CLIENT_REQUEST_ID_HEADER = "x-request-id"
# ASGI header names are lower-case bytes.
REQUEST_ID_KEY = REQUEST_ID_HEADER.lower().encode()
# A client-chosen request id is echoed back and logged: keep it short and printable.
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


def client_request_id(headers: Mapping[str, str]) -> str:
    """The client's own id when it is sane, else a fresh one."""
    given = headers.get(CLIENT_REQUEST_ID_HEADER, "")
    return given if _REQUEST_ID_RE.match(given) else f"req-{uuid.uuid4().hex}"


async def send_refusal(send: Send, error: ApiError, request_id: str | None = None) -> None:
    """`error` in OpenAI's error JSON, with the id the request went by."""
    await send_error(send, error, [(REQUEST_ID_KEY, request_id.encode())] if request_id else ())


__all__ = ["CLIENT_REQUEST_ID_HEADER", "REQUEST_ID_KEY", "client_request_id", "send_refusal"]
