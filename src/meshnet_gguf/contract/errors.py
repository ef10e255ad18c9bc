"""Errors a client can meet, rendered in OpenAI's error JSON so SDKs surface the message."""

from __future__ import annotations

import json


class ApiError(Exception):
    """An answer that ends a request early: status, a stable machine code and a human message."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.error_type = error_type or _default_type(status)
        self.headers = headers or {}

    def body(self) -> bytes:
        return openai_error_body(self.message, self.error_type, self.code)


def _default_type(status: int) -> str:
    if status in (401, 403):
        return "authentication_error" if status == 401 else "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 429 or status == 503:
        return "server_overloaded" if status == 503 else "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def openai_error_body(message: str, error_type: str, code: str | int | None, *, with_param: bool = True) -> bytes:
    """OpenAI's error JSON, the one spelling the node, the tracker and the relay send.

    `with_param=False` leaves out `param`: the node's error event in a stream that broke
    (`serving/proxy`) has always been sent without it, and clients may match those bytes.
    """
    error: dict[str, object] = {"message": message, "type": error_type, "param": None, "code": code}
    if not with_param:
        del error["param"]
    return json.dumps({"error": error}).encode()
