"""How the tracker reaches a node: the advertised URL checked against SSRF, resolved once, and pinned.

A volunteer chooses its `advertised_url`, so the tracker treats it as hostile
input: only http(s), no userinfo, query or fragment, and no address the tracker
should never talk to on a stranger's behalf (link-local, cloud metadata,
multicast, unspecified, reserved; loopback and private ranges only when the
operator allows them). The name is resolved once, at registration, and every
later request (control proof, health polls, relayed requests) goes to that very
address with the original `Host` (and TLS server name): DNS cannot rebind the
node to another address between the check and the use.

`NodeTarget.request()` is the one place that turns "this node, this path" into
an HTTP request, and `NodeTarget.send()` the one way a routed request goes out; a
node reached another way (through a relay, `relay_dialer.RelayedNodeTarget`) has
both too.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import anyio
import httpx

from meshnet_gguf.common.http1_client import HttpAnswer
from meshnet_gguf.common.httpx_answer import send_through_httpx
from meshnet_gguf.reference.tracker.node_clients import NODE_PEER, NodeClients

# Cloud metadata services that are not link-local (AWS's IPv6 one sits in a private range).
METADATA_ADDRESSES = frozenset({ipaddress.ip_address("fd00:ec2::254")})
# Resolving a volunteer's host name must not hold a registration for long.
RESOLVE_TIMEOUT_S = 5.0

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class UnsafeNodeURL(ValueError):
    """The advertised URL is malformed or points where the tracker must not send requests."""


@dataclass(frozen=True)
class AddressPolicy:
    """Which non-public addresses the operator lets nodes advertise (a LAN or a one-box mesh)."""

    allow_loopback: bool = False
    allow_private: bool = False


@dataclass(frozen=True)
class NodeTarget:
    """A node's advertised URL with the address it resolved to when it was checked."""

    url: str  # as advertised, without a trailing slash
    scheme: str
    host: str  # the name, for Host and TLS
    port: int
    base_path: str  # path prefix of the advertised URL ("" for none)
    address: IPAddress

    def request(
        self,
        http: httpx.AsyncClient,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        content: bytes | None = None,
    ) -> httpx.Request:
        """The request for `path` on this node, sent to the pinned address only."""
        extensions = {"sni_hostname": self.host} if self.scheme == "https" else {}
        return http.build_request(
            method,
            self.pinned_url(path),
            params=params,
            headers={**(headers or {}), "host": self.host_header},
            content=content,
            extensions=extensions,
        )

    async def send(self, clients: NodeClients, method: str, path: str, headers: dict[str, str], body: bytes) -> HttpAnswer:
        """`path` on this node; its answer's head has arrived, its body is not read. Over plain http with the
        lean client: ~0.1 ms a streamed request to its first chunk against httpx's 0.8-1.0 ms
        (bench/http_client_cost.py); over https through httpx."""
        if self.scheme == "http":
            return await clients.lean.send(method, self.pinned_url(path), {**headers, "host": self.host_header}, body)
        request = self.request(clients.http, method, path, headers=headers, content=body)
        return await send_through_httpx(clients.http, request, peer=NODE_PEER)

    def pinned_url(self, path: str) -> str:
        """`path` on this node at the address it was pinned to (the name goes in `host_header`)."""
        literal = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{self.scheme}://{literal}:{self.port}{self.base_path}{path}"

    @property
    def host_header(self) -> str:
        default_port = {"http": 80, "https": 443}[self.scheme]
        return self.host if self.port == default_port else f"{_bracketed(self.host)}:{self.port}"

    @property
    def endpoint(self) -> tuple[str, int, str]:
        """Where requests really go: two URLs with the same endpoint reach the same server."""
        return (str(self.address), self.port, self.base_path)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def address_problem(address: IPAddress, policy: AddressPolicy) -> str | None:
    """Why the tracker must not send requests to `address`, or None when it may."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address in METADATA_ADDRESSES or address.is_link_local:
        return f"{address} is link-local or a cloud metadata address"
    if address.is_unspecified or address.is_multicast or address.is_reserved:
        return f"{address} is not a unicast host address"
    if address.is_loopback:
        return None if policy.allow_loopback else f"{address} is loopback (this tracker does not allow loopback nodes)"
    if not address.is_global:
        return None if policy.allow_private else f"{address} is a private address (this tracker does not allow private nodes)"
    return None


def parse_node_url(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, base path) of an advertised URL, or `UnsafeNodeURL`."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UnsafeNodeURL(f"advertised_url is not a URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise UnsafeNodeURL("advertised_url must be http:// or https://")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise UnsafeNodeURL("advertised_url must not carry user:password@")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise UnsafeNodeURL("advertised_url must not carry a query or fragment")
    if not parts.hostname:
        raise UnsafeNodeURL("advertised_url has no host")
    return scheme, parts.hostname, port or (443 if scheme == "https" else 80), parts.path.rstrip("/")


async def pin_node_url(url: str, policy: AddressPolicy) -> NodeTarget:
    """Check `url` and resolve it once; every address it resolves to must be allowed."""
    scheme, host, port, base_path = parse_node_url(url)
    try:
        literal: IPAddress | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        addresses: list[IPAddress] = [literal]
    else:
        try:
            with anyio.fail_after(RESOLVE_TIMEOUT_S):
                infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError) as exc:
            raise UnsafeNodeURL(f"advertised host {host!r} does not resolve: {exc}") from None
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
        if not addresses:
            raise UnsafeNodeURL(f"advertised host {host!r} does not resolve")
    for address in addresses:
        problem = address_problem(address, policy)
        if problem:
            raise UnsafeNodeURL(f"advertised_url {url}: {problem}")
    return NodeTarget(url=url.rstrip("/"), scheme=scheme, host=host, port=port, base_path=base_path, address=addresses[0])
