"""How the tracker reaches a node through its relay.

A node that announced a relay (`NodeAnnouncement.relay`) is reached at
`https://<node_id>` through the relay used as an HTTP CONNECT proxy, with TLS
1.3 that trusts only the certificate the node registered, after checking that
certificate carries the node's registered key. The relay therefore splices
bytes it cannot read; a relay that alters them breaks the TLS record MACs and
the request fails.

`NodeDialer` is the tracker's HTTP transport: a request for a relayed node's id
goes through that node's own transport (its relay, its pinned certificate);
every other request goes out directly. `RelayedNodeTarget` is what the registry
keeps for such a node in place of its advertised URL, with the same shape, so
the tracker builds its requests the same way for both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx

from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.node_tls import NodeCertificateError, certificate_from_text, pinned_client_context
from meshnet_gguf.contract.protocol import NodeAnnouncement
from meshnet_gguf.contract.signing import KeyFormatError, parse_public_key
from meshnet_gguf.reference.node_address import AddressPolicy, NodeTarget, UnsafeNodeURL, pin_node_url

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RelayedNodeTarget:
    """A node reached through a relay: same interface as `NodeTarget` (url, endpoint, request)."""

    node_id: str
    relay: NodeTarget  # the relay's URL, checked against the address policy and pinned like a node's

    @property
    def url(self) -> str:
        return f"https://{self.node_id} through {self.relay.url}"

    @property
    def endpoint(self) -> tuple[str, int, str]:
        # Many nodes share one relay: each is its own endpoint there.
        return (str(self.relay.address), self.relay.port, f"relay:{self.node_id}")

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
        return http.build_request(method, f"https://{self.node_id}{path}", params=params, headers=headers, content=content)


@dataclass(frozen=True)
class _Relayed:
    proxy: str
    certificate: str
    transport: httpx.AsyncHTTPTransport


class NodeDialer(httpx.AsyncBaseTransport):
    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        self.direct = httpx.AsyncHTTPTransport(limits=limits)
        self._relayed: dict[str, _Relayed] = {}
        self._retired: list[httpx.AsyncHTTPTransport] = []

    async def through_relay(self, announcement: NodeAnnouncement, policy: AddressPolicy) -> RelayedNodeTarget:
        """Check a relayed node's announcement and make it reachable; refusals are the registration's answer."""
        relay = announcement.relay
        assert relay is not None
        try:
            relay_target = await pin_node_url(relay.url, policy)
        except UnsafeNodeURL as exc:
            raise ApiError(422, "unsafe_relay_url", str(exc)) from None
        try:
            context = pinned_client_context(certificate_from_text(relay.tls_certificate), parse_public_key(announcement.public_key))
        except (NodeCertificateError, KeyFormatError) as exc:
            raise ApiError(422, "bad_relay_certificate", f"relay.tls_certificate: {exc}") from None
        address = relay_target.address
        literal = f"[{address}]" if address.version == 6 else str(address)
        proxy = f"{relay_target.scheme}://{literal}:{relay_target.port}"  # the pinned address, as for a node
        known = self._relayed.get(announcement.node_id)
        if known is None or (known.proxy, known.certificate) != (proxy, relay.tls_certificate):
            if known is not None:
                self._retired.append(known.transport)  # requests in flight on it finish; closed with the dialer
            transport = httpx.AsyncHTTPTransport(proxy=httpx.Proxy(proxy), verify=context, limits=self._limits)
            self._relayed[announcement.node_id] = _Relayed(proxy, relay.tls_certificate, transport)
        return RelayedNodeTarget(announcement.node_id, relay_target)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        relayed = self._relayed.get(request.url.host) if request.url.scheme == "https" else None
        if relayed is not None:
            return await relayed.transport.handle_async_request(request)
        return await self.direct.handle_async_request(request)

    async def aclose(self) -> None:
        for transport in [self.direct, *(r.transport for r in self._relayed.values()), *self._retired]:
            await transport.aclose()
        self._relayed.clear()
        self._retired.clear()


__all__ = ["NodeDialer", "RelayedNodeTarget"]
