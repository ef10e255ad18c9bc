"""The one way an `ApiError` is sent as an ASGI answer, in OpenAI's error JSON.

It lives in `contract`, not beside `respond` in `common/asgi`, because it renders
`contract/errors.ApiError` and `common` may import nothing else of the package; in `contract` the
node's listener and the reference tracker (which may import only `common` and `contract`) both reach it.
"""

from __future__ import annotations

from collections.abc import Iterable

from meshnet_gguf.common.asgi import CLIENT_CLOSED_STATUS, JSON_HEADER, Send, respond
from meshnet_gguf.contract.errors import ApiError


async def send_error(send: Send, error: ApiError, extra_headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """`error` as OpenAI's error JSON, with its own headers (Retry-After) and `extra_headers`."""
    headers = [JSON_HEADER, *[(k.lower().encode(), v.encode()) for k, v in error.headers.items()], *extra_headers]
    # 499 is log-only (the client is gone anyway); anything sent says 400.
    status = 400 if error.status == CLIENT_CLOSED_STATUS else error.status
    await respond(send, status, error.body(), headers)


__all__ = ["send_error"]
