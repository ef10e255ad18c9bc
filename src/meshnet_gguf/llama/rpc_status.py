"""The pool worker's status endpoint: what the node checks before it launches llama-server with
`--rpc` (reachable, same RPC protocol, free memory), on a port of its own because probing the
RPC port itself disturbs ggml-rpc-server (one client at a time; a client that dies can kill it).

Only the node may read it: each request carries a short-lived EdDSA token signed by the node's
key (`status_token`), checked against the public key the worker was started with by the pool
status policy (`contract.token_policies.POOL_STATUS_TOKEN`). Its HTTP side (the listener's table,
one row) is `serving/worker_status`.
"""

from __future__ import annotations

import time
from typing import Any

import psutil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshnet_gguf import __version__
from meshnet_gguf.contract.protocol import STATUS_AUDIENCE
from meshnet_gguf.contract.signing import issue, verify
from meshnet_gguf.contract.token_policies import POOL_STATUS_TOKEN
from meshnet_gguf.llama.rpc_worker import RpcWorker, cache_bytes

STATUS_PATH = "/status"
__all__ = ["STATUS_AUDIENCE", "STATUS_PATH", "check_status_token", "status_token", "worker_status"]


def status_token(key: Ed25519PrivateKey, now: float | None = None) -> str:
    """The bearer token the node sends to a worker's status endpoint (the policy's longest life)."""
    return issue(POOL_STATUS_TOKEN, key, now=now)


def check_status_token(token: str, node_key: Ed25519PublicKey) -> None:
    """Raises `TokenRefused` unless the node's key signed this fresh, short-lived status token."""
    verify(token, node_key, POOL_STATUS_TOKEN)


def worker_status(worker: RpcWorker) -> dict[str, Any]:
    cache = worker.config.cache_dir
    devices = []
    for device in worker.banner.devices:
        free = device.free_bytes
        if device.name.upper() == "CPU":
            # The banner's figure is from start-up; host memory changes, so read it now.
            free = min(device.total_bytes, psutil.virtual_memory().available)
        devices.append({"name": device.name, "description": device.description, "total_bytes": device.total_bytes, "free_bytes": free})
    return {
        "meshnet_gguf_version": __version__,
        "rpc_server": worker.config.binary.describe(),
        "protocol": worker.banner.protocol,
        "state": worker.state,
        "restarts": worker.restarts,
        "endpoint": f"{worker.config.host}:{worker.config.port}",
        "devices": devices,
        "free_bytes": sum(d["free_bytes"] for d in devices),
        "cache": None
        if cache is None
        else {"folder": str(cache), "bytes": cache_bytes(cache), "limit_bytes": worker.config.cache_limit_bytes},
        "uptime_s": round(time.time() - worker.started_at, 1),
    }
