"""Who may call the node over HTTP: the rules, each once, and the guards built from them.

- the bearer key (`check_api_key`; the header itself is read by `contract/bearer`);
- this machine and not the relay (`local_and_not_relayed`): a relayed stream arrives on
  loopback too, so the relay link names the client addresses that are its own;
- the Host header (`check_host`): a web page in the operator's browser reaches loopback
  through a DNS name rebound to this machine, and then the Host header carries that name;
- `PageAccess`, who may read `/status.json` and the chat's `props`;
- the guards of the listener's rows (`serving/routes`): `PageAccess`, `LocalOrKey` (`/metrics`) and
  `NotRelayed` (the audit path).

The proxy's standalone admission (`serving/admission_modes`), the meshed one
(`mesh/meshed_mode`) and the listener's table (`serving/node_surface`) use these; `tests/serving/test_access.py`
plays the attacker against each rule.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from meshnet_gguf.common.asgi import Scope
from meshnet_gguf.contract.bearer import bearer_matches
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.serving.routes import Request, no_route

# Host names the node always answers to; any IP literal is accepted too (DNS rebinding
# needs a name that resolves to this machine, and a literal is not one).
LOOPBACK_HOST_NAMES = frozenset({"localhost", "localhost.localdomain"})

# Told a client's (host, port): True when the connection is one the relay link opened.
Relayed = Callable[[tuple[str, int]], bool]


def check_api_key(headers: Mapping[str, str], api_key: str | None) -> None:
    """Refuses (401) a request without `Authorization: Bearer <api_key>`, when a key is set."""
    if api_key is None:
        return
    if not bearer_matches(headers.get("authorization", "").encode("latin-1"), api_key):
        raise ApiError(401, "invalid_api_key", "Missing or wrong API key (Authorization: Bearer ...)")


def answered_hosts(names: Iterable[str]) -> frozenset[str]:
    """The Host names a node answers to: loopback's and the ones it listens under."""
    return LOOPBACK_HOST_NAMES | {name.lower() for name in names}


def open_to_the_network(host: str, api_key: str | None, *, meshed: bool) -> str | None:
    """The warning a standalone node without a key deserves when it listens beyond this machine, else None.

    A meshed node admits only the tracker's signed routes, so it needs no key to be safe.
    """
    if meshed or api_key or host.lower() in LOOPBACK_HOST_NAMES or is_loopback(host):
        return None
    return (
        f"listening on {host} without an API key: anyone who can reach this port can use the model. "
        "Set --api-key (or MESHNET_API_KEY), or listen on 127.0.0.1"
    )


def check_host(headers: Mapping[str, str], allowed: frozenset[str]) -> None:
    """Refuses (403) a request whose Host header names another site."""
    if not host_allowed(headers.get("host", ""), allowed):
        raise ApiError(403, "host_not_allowed", "Host header names neither this machine's loopback nor a configured name")


def host_allowed(host: str, allowed: frozenset[str] | set[str]) -> bool:
    name = host.strip().lower()
    if name.startswith("["):  # [v6]:port
        name = name[1 : name.find("]")] if "]" in name else ""
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    if not name:
        return False
    if name in allowed or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def client_address(scope: Scope) -> tuple[str, int] | None:
    client = scope.get("client")
    return (str(client[0]), int(client[1])) if client else None


def is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback  # "::1%lo": the zone is no part of it
    except ValueError:
        return False


def local_and_not_relayed(address: tuple[str, int] | None, relayed: Relayed | None) -> bool:
    """True for a caller on this machine whose connection the relay link did not open."""
    if address is None or not is_loopback(address[0]):
        return False
    return relayed is None or not relayed(address)


@dataclass(frozen=True)
class PageAccess:
    """Who may read /status.json: the node's own rules for its API, applied to its pages.

    - standalone: whoever may call the API (the bearer key when one is set);
    - meshed: loopback only, unless the operator opted in (`remote`);
    - never through the relay tunnel.
    The Host header is checked either way, so a page on another site cannot read it
    through a DNS name rebound to this machine.
    """

    api_key: str | None
    meshed: bool
    remote: bool = False
    host_names: tuple[str, ...] = ()  # besides loopback's: the names the node listens under
    relayed: Relayed | None = None

    def __call__(self, request: Request) -> None:
        """The guard of the rows this rule keeps (`/status.json`, the chat's `props`)."""
        self.check(request.scope, request.headers)

    def check(self, scope: Scope, headers: Mapping[str, str]) -> None:
        address = client_address(scope)
        if address is not None and self.relayed is not None and self.relayed(address):
            raise ApiError(404, "not_found", "The status page is not served through the relay")
        if self.meshed and not self.remote and not is_loopback(address[0] if address else None):
            raise ApiError(403, "loopback_only", "A meshed node shows its status on this machine only (status_page_remote opts in)")
        check_host(headers, answered_hosts(self.host_names))
        check_api_key(headers, self.api_key)


@dataclass(frozen=True)
class LocalOrKey:
    """Guard: callers on this machine that are not relayed pass, and anyone with the operator's key.

    For `/metrics`: the counters say how busy the node is and what it served; a stranger who reaches
    the node (directly, or through its relay) must not read them (docs/protocol.md, 9.5: through the
    relay a client without a route reaches only `/health` and `/v1/models`). A refused caller meets
    the answer of a path the node does not serve, so nothing is learnt.
    """

    relayed: Relayed | None = None
    operator_key: str | None = None

    def __call__(self, request: Request) -> None:
        if self.operator_key and bearer_matches(request.headers.get("authorization", "").encode("latin-1"), self.operator_key):
            return
        if not local_and_not_relayed(request.client, self.relayed):
            raise no_route(request.method, request.path)


@dataclass(frozen=True)
class NotRelayed:
    """Guard: refuses a caller whose connection the relay link opened, as if the path were not served
    (the audit path is for the tracker, which reaches a node at its own address)."""

    relayed: Relayed | None = None

    def __call__(self, request: Request) -> None:
        address = request.client
        if self.relayed is not None and address is not None and self.relayed(address):
            raise no_route(request.method, request.path)


__all__ = [
    "LOOPBACK_HOST_NAMES",
    "LocalOrKey",
    "NotRelayed",
    "PageAccess",
    "Relayed",
    "answered_hosts",
    "check_api_key",
    "check_host",
    "client_address",
    "host_allowed",
    "is_loopback",
    "local_and_not_relayed",
    "open_to_the_network",
]
