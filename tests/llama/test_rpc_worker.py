"""The pool worker: where it may listen, what it reads from ggml-rpc-server, its tensor cache bound,
its restarts, and a status endpoint only the node's key can read."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.common.units import parse_bytes
from meshnet_gguf.contract.signing import encode_token
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.rpc_status import STATUS_AUDIENCE, STATUS_PATH, status_token
from meshnet_gguf.llama.rpc_worker import (
    RpcWorker,
    UnsafeBindAddress,
    WorkerConfig,
    check_bind_address,
    find_rpc_server,
    parse_banner,
    prune_cache,
)
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.node import pool_status_tokens
from meshnet_gguf.serving.worker_status import status_table
from support.loopback import serve_asgi

BANNER = """ggml_vulkan: No devices found.
Starting RPC server v5.0.0
  endpoint       : 127.0.0.1:50999
  local cache    : /srv/cache/rpc/
Devices:
  Vulkan0: Radeon 8060S Graphics (RADV GFX1151) (98304 MiB, 97000 MiB free)
  CPU: AMD RYZEN AI MAX+ 395 (24105 MiB, 24000 MiB free)
  transport      : TCP
Accepted client connection
"""


# ggml-rpc-server prints its banner within a second of starting.
BANNER_WITHIN_S = 15.0


def protocol_spoken_by(rpc_server: BinaryInfo) -> str:
    """Ask the binary itself which RPC protocol it speaks (5.0.0 in the bundled b10434, 7.0.0 in a b11434 build)."""
    stdbuf = shutil.which("stdbuf")
    argv = [*([stdbuf, "-oL"] if stdbuf else []), str(rpc_server.path), "-H", "127.0.0.1", "-p", str(free_local_port()), "-d", "CPU"]
    proc = subprocess.Popen(argv, env=rpc_server.environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    # A server that prints no banner is killed by its PID, which ends the read below.
    give_up = threading.Timer(BANNER_WITHIN_S, lambda: os.kill(proc.pid, signal.SIGKILL))
    give_up.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if match := re.search(r"Starting RPC server v(\d+\.\d+\.\d+)", line):
                return match[1]
        raise AssertionError(f"{rpc_server.path} printed no protocol version within {BANNER_WITHIN_S:.0f} s")
    finally:
        give_up.cancel()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


# The IPv4 wildcard and a public address spelt as IPv4-mapped IPv6, every way ipaddress reads as the same address.
MAPPED = ["::ffff:0.0.0.0", "0:0:0:0:0:ffff:0:0", "::ffff:0:0", "[::FFFF:0000:0000]", "0000::ffff:0.0.0.0", "::ffff:8.8.8.8"]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "8.8.8.8", "2001:4860:4860::8888", *MAPPED])
def test_a_wildcard_or_public_address_is_refused_unless_forced_and_the_warning_says_why(host: str) -> None:
    with pytest.raises(UnsafeBindAddress, match="no authentication"):
        check_bind_address(host, force=False)
    warning = check_bind_address(host, force=True)
    assert warning is not None and "no authentication" in warning and host in warning


@pytest.mark.parametrize("host", ["127.0.0.1", "192.168.1.20", "10.8.0.2", "100.64.0.7", "fd00::2", "fe80::1", "::ffff:192.168.1.20"])
def test_a_named_lan_wireguard_or_loopback_address_is_fine(host: str) -> None:
    assert check_bind_address(host, force=False) is None


def test_a_host_name_is_refused_because_it_may_resolve_anywhere() -> None:
    with pytest.raises(UnsafeBindAddress, match="not an IP address"):
        check_bind_address("helper.local", force=True)


def test_the_banner_gives_protocol_endpoint_cache_and_each_devices_memory() -> None:
    banner = parse_banner(BANNER.splitlines())
    assert banner.protocol == "5.0.0" and banner.endpoint == "127.0.0.1:50999" and banner.cache == "/srv/cache/rpc/"
    assert [(d.name, d.total_bytes // 2**20, d.free_bytes // 2**20) for d in banner.devices] == [
        ("Vulkan0", 98304, 97000),
        ("CPU", 24105, 24000),
    ]


def test_the_tensor_cache_loses_its_oldest_files_first_down_to_its_bound(tmp_path: Path) -> None:
    for age, name in enumerate(["newest", "middle", "oldest"]):
        path = tmp_path / "rpc" / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x" * 1000)
        os.utime(path, (time.time() - age * 100, time.time() - age * 100))
    assert prune_cache(tmp_path, 2000) == 1000
    assert sorted(p.name for p in (tmp_path / "rpc").iterdir()) == ["middle", "newest"]
    assert prune_cache(tmp_path, 2000) == 0


def test_sizes_read_as_operators_write_them() -> None:
    assert parse_bytes("60G") == parse_bytes("60 GB") == 60 * 10**9
    assert parse_bytes("58GiB") == 58 * 2**30 and parse_bytes("1500") == 1500
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


@pytest.mark.anyio
@pytest.mark.real_llama
async def test_the_worker_serves_restarts_and_shows_its_status_only_to_the_node(real_llama: BinaryInfo, tmp_path: Path) -> None:
    node_key, stranger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    # The node's tokens as serve, doctor and models issue them.
    node_token = pool_status_tokens(NodeIdentity.from_private_key(node_key))
    config = WorkerConfig(
        binary=find_rpc_server(real_llama), host="127.0.0.1", port=free_local_port(), devices=("CPU",),
        cache_dir=tmp_path / "cache", cache_limit_bytes=10**9,
    )  # fmt: skip
    worker = RpcWorker(config)
    status_port = free_local_port()
    url = f"http://127.0.0.1:{status_port}{STATUS_PATH}"
    async with anyio.create_task_group() as tg, serve_asgi(status_table(worker, node_key.public_key()), status_port):
        tg.start_soon(worker.run)
        async with httpx.AsyncClient(timeout=5) as http:
            with anyio.fail_after(15):
                while not worker.banner.devices:
                    await anyio.sleep(0.05)

            def bearer(token: str) -> dict[str, str]:
                return {"authorization": f"Bearer {token}"}

            # The attacker's tries: no token, another key's token, and the node's key on a token that lives too long.
            assert (await http.get(url)).status_code == 401
            assert (await http.get(url, headers=bearer(status_token(stranger)))).status_code == 401
            now = int(time.time())
            long_lived = encode_token({"aud": STATUS_AUDIENCE, "iat": now, "exp": now + 86400}, node_key)
            assert (await http.get(url, headers=bearer(long_lived))).status_code == 401
            answer = await http.get(url, headers=bearer(node_token()))
            assert answer.status_code == 200, answer.text
            status = answer.json()
            # What this machine's binary speaks, asked of it apart from the worker: the status reports it as read.
            assert status["protocol"] == protocol_spoken_by(config.binary) and status["state"] == "running"
            assert [d["name"] for d in status["devices"]] == ["CPU"] and status["free_bytes"] > 0
            assert status["cache"]["folder"] == str(tmp_path / "cache") and status["cache"]["limit_bytes"] == 10**9
            assert status["endpoint"] == f"127.0.0.1:{config.port}"

            # Killed: the worker starts it again after its backoff.
            first = worker.pid
            assert first is not None
            os.kill(first, signal.SIGKILL)
            with anyio.fail_after(15):
                while worker.restarts < 1 or worker.pid in (None, first) or not worker.banner.devices:
                    await anyio.sleep(0.05)
            status = (await http.get(url, headers=bearer(node_token()))).json()
            assert status["restarts"] == 1 and status["state"] == "running"
        await worker.close()
    assert worker.pid is None and worker.state == "stopped"
