"""The progress watchdog: a pool worker stopped mid-generation (SIGSTOP, or a cut link) leaves
llama-server's /health at 200 while nothing moves; the supervisor ends it within its bound."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import anyio
import pytest

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.child import ChildSpec
from meshnet_gguf.llama.rpc_worker import RpcWorker, WorkerConfig, find_rpc_server
from meshnet_gguf.llama.supervisor import Supervisor
from meshnet_gguf.llama.upstream.raw import RawUpstream
from support.supervisor_policies import QUICK

pytestmark = [pytest.mark.anyio, pytest.mark.real_llama]
BOUND_S = 2.0
POLICY = dataclasses.replace(QUICK, warmup=None, liveness_interval_s=0.5, busy_stall_timeout_s=BOUND_S, max_quick_crashes=5)


async def test_a_stopped_worker_mid_stream_gets_llama_server_ended_within_the_bound(
    real_llama: BinaryInfo, tiny_gguf: Path, tmp_path: Path
) -> None:
    rpc = find_rpc_server(real_llama)
    workers = [RpcWorker(WorkerConfig(rpc, "127.0.0.1", free_local_port(), devices=("CPU",))) for _ in range(2)]
    endpoints = ",".join(f"127.0.0.1:{w.config.port}" for w in workers)
    args = ["--model", str(tiny_gguf), "--rpc", endpoints, "--device", "RPC0,RPC1", "-ngl", "999", "--cache-ram", "0",
            "--parallel", "1", "--ctx-size", "4096"]  # fmt: skip
    supervisor = Supervisor(ChildSpec(real_llama, args), POLICY, state_dir=tmp_path)
    stopped: int | None = None
    http = RawUpstream(max_connections=2)
    try:
        async with anyio.create_task_group() as tg:
            for worker in workers:
                tg.start_soon(worker.run)
            with anyio.fail_after(20):
                while not all(w.banner.devices for w in workers):
                    await anyio.sleep(0.05)
            tg.start_soon(supervisor.run)
            with anyio.fail_after(60):
                while supervisor.state != "ready":
                    await anyio.sleep(0.05)
            first_pid = supervisor.pid
            body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 1800, "stream": True, "ignore_eos": True}
            response = await http.send(
                "POST", f"{supervisor.base_url}/v1/chat/completions",
                {"authorization": f"Bearer {supervisor.api_key}", "content-type": "application/json"}, json.dumps(body).encode(),
            )  # fmt: skip
            chunks = response.iter_chunks()
            await chunks.__anext__()  # generating
            stopped = workers[0].pid
            assert stopped is not None
            os.kill(stopped, signal.SIGSTOP)
            started = time.monotonic()
            with anyio.fail_after(BOUND_S + POLICY.liveness_interval_s + POLICY.stop_timeout_s + 10):
                while supervisor.pid == first_pid and supervisor.state == "ready":
                    await anyio.sleep(0.05)
            ended_after = time.monotonic() - started
            assert supervisor.state != "ready" and "made no progress" in (supervisor.detail or ""), supervisor.detail
            assert ended_after < BOUND_S + POLICY.liveness_interval_s + POLICY.stop_timeout_s + 5
            await response.aclose()
            os.kill(stopped, signal.SIGCONT)
            stopped = None
            await supervisor.stop()
            for worker in workers:
                await worker.close()
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        await http.aclose()
