"""How the tracker reaches a node: directly at its advertised URL, or through its relay.

A node that announced a relay (`NodeAnnouncement.relay`) is reached at
`https://<node_id>` through the relay used as an HTTP CONNECT proxy, with TLS
1.3 that trusts only the certificate the node registered, after checking that
certificate carries the node's registered key. The relay therefore splices
bytes it cannot read; a relay that alters them breaks the TLS record MACs and
the request fails.

One httpx client per relayed node (its own pinned TLS context); the direct
client is shared. A node that re-registers with another relay or certificate
gets a fresh client.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx

from meshnet_gguf.node_tls import NodeCertificateError, certificate_from_text, pinned_client_context
from meshnet_gguf.protocol import NodeAnnouncement
from meshnet_gguf.signing import KeyFormatError, parse_public_key

log = logging.getLogger(__name__)


class NodeUnreachable(httpx.ConnectError):
    """No trustworthy way to this node (its relay certificate does not bind its key): treated like a refused connection."""


@dataclass(frozen=True)
class _RelayedClient:
    relay_url: str
    certificate: str
    client: httpx.AsyncClient


class NodeDialer:
    def __init__(self, direct: httpx.AsyncClient, *, timeout: httpx.Timeout, limits: httpx.Limits) -> None:
        self.direct = direct
        self._timeout = timeout
        self._limits = limits
        self._relayed: dict[str, _RelayedClient] = {}
        self._retired: list[httpx.AsyncClient] = []

    def endpoint(self, announcement: NodeAnnouncement) -> tuple[httpx.AsyncClient, str]:
        """The client to use and the base URL of the node's API."""
        relay = announcement.relay
        if relay is None:
            return self.direct, announcement.advertised_url.rstrip("/")
        known = self._relayed.get(announcement.node_id)
        if known is None or (known.relay_url, known.certificate) != (relay.url, relay.tls_certificate):
            if known is not None:
                self._retired.append(known.client)  # requests in flight on it finish; closed with the dialer
            try:
                context = pinned_client_context(
                    certificate_from_text(relay.tls_certificate), parse_public_key(announcement.public_key)
                )
            except (NodeCertificateError, KeyFormatError) as exc:
                raise NodeUnreachable(f"node {announcement.node_id}: {exc}") from None
            client = httpx.AsyncClient(
                proxy=relay.url, verify=context, timeout=self._timeout, limits=self._limits, trust_env=False
            )
            known = _RelayedClient(relay.url, relay.tls_certificate, client)
            self._relayed[announcement.node_id] = known
        return known.client, f"https://{announcement.node_id}"

    def forget(self, node_id: str) -> None:
        known = self._relayed.pop(node_id, None)
        if known is not None:
            self._retired.append(known.client)

    async def aclose(self) -> None:
        for client in [*(k.client for k in self._relayed.values()), *self._retired]:
            await client.aclose()
        self._relayed.clear()
        self._retired.clear()


__all__ = ["NodeDialer", "NodeUnreachable"]
