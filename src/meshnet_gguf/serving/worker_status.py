"""The pool worker's status port as a table of one row: `GET /status`, for the node's status token only.

The worker listens on the node's guarded listener (`http_server`) and answers as every door of the
node does: a path or a method it does not serve, and a missing or refused token, in OpenAI's error
JSON (`serving/routes`). The token and what the status says are the worker's own (`llama/rpc_status`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from meshnet_gguf.common.asgi import JSON_HEADER, respond
from meshnet_gguf.contract.bearer import bearer_token
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.signing import TokenRefused
from meshnet_gguf.llama.rpc_status import STATUS_PATH, check_status_token, worker_status
from meshnet_gguf.llama.rpc_worker import RpcWorker
from meshnet_gguf.serving.routes import Request, Route, RouteTable


class NodeTokenOnly:
    """Guard: a bearer token the node's key signed under the pool status policy, else 401."""

    def __init__(self, node_key: Ed25519PublicKey) -> None:
        self._node_key = node_key

    def __call__(self, request: Request) -> None:
        token = bearer_token(request.headers.get("authorization", ""))
        if token is None:
            raise ApiError(401, "invalid_status_token", "a status token signed by the node's key is required")
        try:
            check_status_token(token, self._node_key)
        except TokenRefused as exc:
            raise ApiError(401, "invalid_status_token", f"status token refused: {exc}") from None


def status_table(
    worker: RpcWorker, node_key: Ed25519PublicKey, *, status: Callable[[RpcWorker], dict[str, Any]] = worker_status
) -> RouteTable:
    """The status port's app: its one row."""

    async def read_status(request: Request) -> None:
        await respond(request.send, 200, json.dumps(status(worker)).encode(), [JSON_HEADER])

    return RouteTable([Route("GET", STATUS_PATH, NodeTokenOnly(node_key), read_status)])


__all__ = ["NodeTokenOnly", "status_table"]
