"""The pool wing: the LAN's rpc workers that hold part of the model, watched while the node lives, and the
status tokens (signed with the node's key) every reader of a worker's status port sends: `serve`, the
pool monitor, `doctor` and `models`."""

from __future__ import annotations

from collections.abc import Callable

from meshnet_gguf.contract.protocol import PoolDescription
from meshnet_gguf.llama.pool_monitor import PoolMonitor, WatchedWorker, http_status_reader
from meshnet_gguf.llama.rpc_status import status_token
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.prepare.pipeline import PreparedLaunch
from meshnet_gguf.prepare.pool import shares_line, worker_name


def pool_status_tokens(identity: NodeIdentity) -> Callable[[], str]:
    """A fresh bearer token per call for the workers' status ports, signed by this node's key
    (the key each worker was started with, `meshnet-gguf worker --node-key`)."""
    return lambda: status_token(identity.private_key)


def build_pool(launch: PreparedLaunch, identity: NodeIdentity | None) -> PoolMonitor | None:
    """The watch over the pool the launch checked, or None without one: each worker by name, its
    status read with the node's key. With a pool, llama-server runs only while every worker is up."""
    described = pool_description(launch)
    if described is None or identity is None:
        return None
    settings = launch.settings
    read, close = http_status_reader(pool_status_tokens(identity), settings.pool_status_timeout_s)
    workers = [
        WatchedWorker(worker_name(i), m.spec.endpoint, m.spec.status_url, m.budget_bytes, m.protocol) for i, m in enumerate(launch.pool)
    ]
    return PoolMonitor(
        workers, read, interval_s=settings.pool_poll_interval_s, timeout_s=settings.pool_status_timeout_s,
        total_bytes=described.total_bytes, plan=described.plan, close_reader=close,
    )  # fmt: skip


def pool_description(launch: PreparedLaunch) -> PoolDescription | None:
    """What the network hears of the pool: how many workers, the memory and the plan; no address."""
    if not launch.pool:
        return None
    shares = launch.pool_shares
    return PoolDescription(workers=len(launch.pool), total_bytes=sum(s.budget_bytes for s in shares), plan=shares_line(shares) or None)


__all__ = ["build_pool", "pool_description", "pool_status_tokens"]
