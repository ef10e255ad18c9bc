"""The node warms llama-server up (a real generation, through the same socket and client as the
proxy) before it says ready, so the first user request is not the one that pays for first use."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import anyio
import pytest

from meshnet_gguf.llama.child import ChildSpec
from meshnet_gguf.llama.supervisor import Supervisor
from meshnet_gguf.llama.warmup import WarmupPolicy
from support.supervisor_policies import QUICK, ReadyClock

pytestmark = pytest.mark.anyio
POLICY = QUICK


async def _run_until_ready(fake_llama, tmp_path: Path, warmup: WarmupPolicy | None) -> tuple[ReadyClock, list[dict]]:  # type: ignore[no-untyped-def]
    log = tmp_path / "warmup.jsonl"
    clock = ReadyClock()
    supervisor = Supervisor(
        ChildSpec(fake_llama, ["--model", "m.gguf"], {"FAKE_LLAMA_WARMUP_LOG": str(log)}),
        dataclasses.replace(POLICY, warmup=warmup),
        state_dir=tmp_path,
        listeners=[clock],
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervisor.run)
        with anyio.fail_after(20):
            while supervisor.state != "ready":
                await anyio.sleep(0.02)
        await supervisor.stop()
    entries = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return clock, entries


async def test_ready_comes_only_after_the_warmup_generations(fake_llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    clock, entries = await _run_until_ready(fake_llama, tmp_path, WarmupPolicy(prompt_words=(50, 3), max_tokens=2))
    assert [e["path"] for e in entries] == ["/v1/chat/completions"] * 2
    assert [e["body"]["max_tokens"] for e in entries] == [2, 2] and entries[0]["body"]["stream"] is True
    assert clock.ready_at is not None and all(e["at"] <= clock.ready_at for e in entries)


async def test_warmup_can_be_turned_off(fake_llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    clock, entries = await _run_until_ready(fake_llama, tmp_path, None)
    assert clock.ready_at is not None and entries == []
