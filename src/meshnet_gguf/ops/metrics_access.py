"""Who may read the node's `/metrics`: a scrape from this machine, or a caller with the operator's key.

The counters say how busy the node is and what it served; a stranger who reaches
the node (directly, or through its relay, whose connections arrive on loopback)
must not read them (docs/protocol.md, 9.5: through the relay a client without a
route reaches only `/health` and `/v1/models`). A relayed connection is told
apart from a local scrape by its loopback source port, which the relay link
records for every connection it opens to the node's listener.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Callable
from typing import Any

# The answer a refused caller gets: the same as for a path the node does not serve, so nothing is learnt.
_NOT_FOUND = json.dumps(
    {"error": {"message": "No route GET /metrics on this node", "type": "invalid_request_error", "param": None, "code": "not_found"}}
).encode()


class MetricsAccess:
    """ASGI wrapper: `GET <path>` passes only for loopback callers that are not relayed, or with the key."""

    def __init__(
        self, app: Any, path: str, *, is_relayed: Callable[[tuple[str, int]], bool] = lambda peer: False, operator_key: str | None = None
    ) -> None:
        self.app, self.path, self.is_relayed, self.operator_key = app, path, is_relayed, operator_key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == self.path and not self._allowed(scope):
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": _NOT_FOUND})
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: dict[str, Any]) -> bool:
        if self.operator_key:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if hmac.compare_digest(given, f"Bearer {self.operator_key}".encode()):
                return True
        client = scope.get("client")
        if not client:
            return False
        host, port = client[0], client[1]
        try:
            loopback = ipaddress.ip_address(host.split("%")[0]).is_loopback
        except ValueError:
            return False
        return loopback and not self.is_relayed((host, port))


__all__ = ["MetricsAccess"]
