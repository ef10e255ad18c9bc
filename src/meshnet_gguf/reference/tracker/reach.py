"""How the tracker reaches its nodes while its app runs: the dialer, httpx and the lean client.

httpx, with the dialer (`relay_dialer.NodeDialer`) as its transport, reaches every node for
control proofs and health polls, and https nodes for routed requests too; the lean client
(`common/http1_client`) carries routed requests to plain-http nodes, and a relayed node's target
brings its own. A node's uvicorn keeps a streamed answer's connection alive, so the lean client
keeps those connections too.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx

from meshnet_gguf.common.http1_client import Http1Client
from meshnet_gguf.reference.tracker.node_address import NodeTarget
from meshnet_gguf.reference.tracker.node_clients import NodeClients
from meshnet_gguf.reference.tracker.registry import NodeEntry
from meshnet_gguf.reference.tracker.relay_dialer import STANDBY_VISIT_INTERVAL_S, ConnectSigner, NodeDialer

FORWARD_CONNECT_TIMEOUT_S = 5.0
# Between two chunks of an answer: a 100 GB model may prefill a long prompt for minutes.
FORWARD_READ_TIMEOUT_S = 600.0
# Shorter than a node's idle keep-alive (uvicorn closes after 5 s): httpcore skips connections
# it sees closed, but a close racing the reuse still fails the POST, which cannot be retried.
FORWARD_KEEPALIVE_EXPIRY_S = 2.0
# Connections httpx keeps alive across all nodes.
FORWARD_KEPT_CONNECTIONS = 64
# Connections kept to plain-http nodes by the lean forwarding client (beyond them, new ones open).
DIRECT_FORWARD_CONNECTIONS = 64
_NOT_RUNNING = "tracker app is not running (lifespan not started)"


class NodeReach:
    def __init__(self, sign_connect: ConnectSigner, relay_tls: ssl.SSLContext | None) -> None:
        self._sign_connect = sign_connect
        self._relay_tls = relay_tls
        self._dialer: NodeDialer | None = None
        self._clients: NodeClients | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        timeout = httpx.Timeout(FORWARD_READ_TIMEOUT_S, connect=FORWARD_CONNECT_TIMEOUT_S, pool=None)
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=FORWARD_KEPT_CONNECTIONS, keepalive_expiry=FORWARD_KEEPALIVE_EXPIRY_S
        )
        # The dialer is the client's transport: direct to most nodes, through its relay to a relayed one.
        self._dialer = NodeDialer(limits, self._sign_connect, relay_tls=self._relay_tls)
        async with httpx.AsyncClient(timeout=timeout, transport=self._dialer, trust_env=False) as http:
            lean = Http1Client(
                DIRECT_FORWARD_CONNECTIONS, peer="node", read_idle_timeout_s=FORWARD_READ_TIMEOUT_S,
                connect_timeout_s=FORWARD_CONNECT_TIMEOUT_S, keep_streamed=True, idle_ttl_s=FORWARD_KEEPALIVE_EXPIRY_S,
            )  # fmt: skip
            self._clients = NodeClients(lean=lean, http=http)
            try:
                async with anyio.create_task_group() as background:
                    background.start_soon(self._visit_standby_relays, self._dialer)
                    yield
                    background.cancel_scope.cancel()
            finally:
                await lean.aclose()
                self._clients = None

    @staticmethod
    async def _visit_standby_relays(dialer: NodeDialer) -> None:
        """Nodes with two relays: the one not in use is kept admitted and checked (relay_dialer says why)."""
        while True:
            await anyio.sleep(STANDBY_VISIT_INTERVAL_S)
            await dialer.visit_standby_relays()

    @property
    def clients(self) -> NodeClients:
        if self._clients is None:
            raise RuntimeError(_NOT_RUNNING)
        return self._clients

    @property
    def http(self) -> httpx.AsyncClient:
        return self.clients.http

    @property
    def dialer(self) -> NodeDialer:
        if self._dialer is None:
            raise RuntimeError(_NOT_RUNNING)
        return self._dialer

    def request(self, node: NodeEntry | NodeTarget, method: str, path: str, **kw: Any) -> httpx.Request:
        """A control or health request to a node, through httpx: its target says how it is reached."""
        target = node.target if isinstance(node, NodeEntry) else node
        return target.request(self.http, method, path, **kw)
