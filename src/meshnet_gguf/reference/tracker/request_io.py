"""What every tracker endpoint shares: bounded bodies and headers, parsing, and JSON answers.

A body past its limit is a 413, headers past MAX_REQUEST_HEADER_BYTES a 431 (whatever server runs
the app), a body that is no JSON object or not the wire model expected a 400; each refusal is an
`ApiError`, answered as OpenAI spells errors.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from meshnet_gguf.contract.errors import ApiError

# Registration bodies are small; anything bigger is not a node talking.
MAX_CONTROL_BODY_BYTES = 1024 * 1024
# All request headers together (names and values). Clients send well under 8 KiB; a route
# token and an auth header are under 2 KiB each.
MAX_REQUEST_HEADER_BYTES = 32 * 1024


class BoundedHeaders:
    """Refuse requests whose headers together exceed MAX_REQUEST_HEADER_BYTES (431), whatever server runs us."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_REQUEST_HEADER_BYTES:
            refusal = ApiError(431, "headers_too_large", f"request headers exceed {MAX_REQUEST_HEADER_BYTES} bytes")
            await error_response(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def error_response(error: ApiError) -> Response:
    return Response(error.body(), error.status, headers=error.headers, media_type="application/json")


def model_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status, media_type="application/json")


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ApiError(400, "malformed", f"{model.__name__}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def json_object(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except ValueError as exc:
        raise ApiError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "invalid_json", "request body is nested too deeply") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "invalid_json", "request body must be a JSON object")
    return payload


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
