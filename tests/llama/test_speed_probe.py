"""The node measures itself after the warm-up and before `ready` (never while serving), from
llama-server's own timings, in a bounded time."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import anyio
import pytest

from meshnet_gguf.llama.child import ChildSpec
from meshnet_gguf.llama.speed_probe import SpeedProbePolicy, rates_of
from meshnet_gguf.llama.supervisor import Supervisor
from meshnet_gguf.llama.warmup import WarmupPolicy
from support.supervisor_policies import QUICK, ReadyClock

pytestmark = pytest.mark.anyio


async def test_the_probe_runs_after_the_warmup_and_before_ready_and_its_figures_are_kept(fake_llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "warmup.jsonl"
    clock = ReadyClock()
    policy = dataclasses.replace(
        QUICK, warmup=WarmupPolicy(prompt_words=(3,), max_tokens=2), speed_probe=SpeedProbePolicy(prompt_words=(4, 40))
    )
    supervisor = Supervisor(
        ChildSpec(fake_llama, ["--model", "m.gguf"], {"FAKE_LLAMA_WARMUP_LOG": str(log)}), policy, state_dir=tmp_path, listeners=[clock]
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervisor.run)
        with anyio.fail_after(20):
            while supervisor.state != "ready":
                await anyio.sleep(0.02)
        capability = supervisor.capability
        await supervisor.stop()
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    warmup, *probes = entries
    assert warmup["body"]["stream"] is True and len(probes) == 2
    # Non-streamed, every prompt token prefilled and every decode token produced, all before ready.
    assert all(p["body"]["cache_prompt"] is False and p["body"]["ignore_eos"] is True and not p["body"].get("stream") for p in probes)
    assert clock.ready_at is not None and all(e["at"] <= clock.ready_at for e in entries)
    assert capability is not None
    assert [(p.ctx_tokens, p.tokens_per_s) for p in capability.prefill_tokens_per_s] == [(7, 5000.0), (7, 5000.0)]
    assert [p.tokens_per_s for p in capability.decode_tokens_per_s] == [1000.0, 1000.0]


def test_only_usable_timings_make_a_figure() -> None:
    good = {"prompt_n": 30, "prompt_per_second": 900.5, "predicted_per_second": 40.0}
    assert rates_of(good) == (30, 900.5, 40.0)
    for bad in ({**good, "prompt_per_second": float("nan")}, {**good, "predicted_per_second": 0}, {**good, "prompt_n": 0},
                {**good, "prompt_n": True}, {"predicted_per_second": 1000.0}, None, [1, 2]):  # fmt: skip
        assert rates_of(bad) is None, bad
