"""The pool worker's status endpoint: what the node checks before it launches llama-server with
`--rpc` (reachable, same RPC protocol, free memory), on a port of its own because probing the
RPC port itself disturbs ggml-rpc-server (one client at a time; a client that dies can kill it).

Only the node may read it: each request carries a short-lived EdDSA token signed by the node's
key (`status_token`), checked against the public key the worker was started with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jwt
import psutil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from meshnet_gguf import __version__
from meshnet_gguf.contract.bearer import bearer_token
from meshnet_gguf.contract.signing import decode_token, encode_token
from meshnet_gguf.llama.rpc_worker import RpcWorker, cache_bytes

STATUS_PATH = "/status"
STATUS_AUDIENCE = "meshnet-pool-worker-status"
# A token lives this long: long enough for one check, short enough that a copied one soon goes stale.
STATUS_TOKEN_TTL_S = 60
# Clocks of two boxes on one desk may disagree this much.
STATUS_CLOCK_LEEWAY_S = 30
# A token claiming a longer life than this is refused, whatever its signature.
STATUS_TOKEN_MAX_LIFE_S = 300


def status_token(key: Ed25519PrivateKey, now: float | None = None) -> str:
    """The bearer token the node sends to a worker's status endpoint."""
    issued = int(time.time() if now is None else now)
    return encode_token({"aud": STATUS_AUDIENCE, "iat": issued, "exp": issued + STATUS_TOKEN_TTL_S}, key)


def check_status_token(token: str, node_key: Ed25519PublicKey) -> None:
    """Raises `jwt.InvalidTokenError` unless the node's key signed this fresh, short-lived status token."""
    claims = decode_token(token, node_key, required=["aud", "iat", "exp"], audience=STATUS_AUDIENCE, leeway=STATUS_CLOCK_LEEWAY_S)
    if int(claims["exp"]) - int(claims["iat"]) > STATUS_TOKEN_MAX_LIFE_S:
        raise jwt.InvalidTokenError(f"a status token may live at most {STATUS_TOKEN_MAX_LIFE_S} s")
    if int(claims["iat"]) > time.time() + STATUS_CLOCK_LEEWAY_S:
        raise jwt.ImmatureSignatureError("status token issued in the future")


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


def status_app(
    worker: RpcWorker, node_key: Ed25519PublicKey, *, status: Callable[[RpcWorker], dict[str, Any]] = worker_status
) -> Starlette:
    async def read_status(request: Request) -> JSONResponse:
        token = bearer_token(request.headers.get("authorization", ""))
        if token is None:
            return JSONResponse({"error": "a status token signed by the node's key is required"}, status_code=401)
        try:
            check_status_token(token, node_key)
        except jwt.InvalidTokenError as exc:
            return JSONResponse({"error": f"status token refused: {exc}"}, status_code=401)
        return JSONResponse(status(worker))

    return Starlette(routes=[Route(STATUS_PATH, read_status, methods=["GET"])])
