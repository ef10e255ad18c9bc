"""The tracker's clients while its app runs, as a node's target is handed them.

Plain-http and relayed nodes are reached with the lean client (`common/http1_client`), an https node
(and a relayed one where this Python cannot nest TLS) through httpx (`common/httpx_answer`); either
way the answer is the package's one `HttpAnswer`, with HttpConnectError when the node never saw the
request and HttpClientError for any other failure.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from meshnet_gguf.common.http1_client import Http1Client

# How a node is named in a client's errors.
NODE_PEER = "node"


@dataclass(frozen=True)
class NodeClients:
    """The lean client for plain-http nodes, httpx (its transport the tracker's dialer) for the rest.
    A relayed node's target brings its own lean client."""

    lean: Http1Client
    http: httpx.AsyncClient


__all__ = ["NODE_PEER", "NodeClients"]
