"""What every tracker endpoint shares: bounded bodies and headers, parsing, and JSON answers.

A body past its limit is a 413, headers past MAX_REQUEST_HEADER_BYTES a 431 (whatever server runs
the app), a body that is no JSON object or not the wire model expected a 400; each refusal is an
`ApiError`, answered as OpenAI spells errors. A client's request body is read by the node's own strict
parser (`contract/strict_json`): a body the node would refuse (a duplicate key, `NaN`) is refused here,
before it is routed, metered or billed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from meshnet_gguf.common.asgi import AsgiApp, Receive, Scope, Send
from meshnet_gguf.contract.error_answer import send_error
from meshnet_gguf.contract.errors import ApiError

# Registration bodies are small; anything bigger is not a node talking.
MAX_CONTROL_BODY_BYTES = 1024 * 1024
# All request headers together (names and values). Clients send well under 8 KiB; a route
# token and an auth header are under 2 KiB each.
MAX_REQUEST_HEADER_BYTES = 32 * 1024


class BoundedHeaders:
    """Refuse requests whose headers together exceed MAX_REQUEST_HEADER_BYTES (431), whatever server runs us."""

    def __init__(self, app: AsgiApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_REQUEST_HEADER_BYTES:
            refusal = ApiError(431, "headers_too_large", f"request headers exceed {MAX_REQUEST_HEADER_BYTES} bytes")
            await send_error(send, refusal)
            return
        await self.app(scope, receive, send)


def error_response(error: ApiError) -> Response:
    """`error` as a Starlette route's answer (an ASGI app answers with `contract/error_answer.send_error`)."""
    return Response(error.body(), error.status, headers=error.headers, media_type="application/json")


def model_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status, media_type="application/json")


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ApiError(400, "malformed", f"{model.__name__}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


async def limited_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "body_too_large", f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def control_body(request: Request) -> bytes:
    return await limited_body(request, MAX_CONTROL_BODY_BYTES)
