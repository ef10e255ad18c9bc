"""The node measures itself after the warm-up and before `ready` (never while serving), as a client
and the tracker will see it (streamed, each size warmed, the prompt read by its ceiling), in a bounded time."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import anyio
import pytest

from meshnet_gguf.llama.child import ChildSpec
from meshnet_gguf.contract.prompt_ceiling import prompt_ceiling
from meshnet_gguf.llama.speed_probe import RUNS_PER_SIZE, SpeedProbePolicy, measured_rates, probe_request, rates_of
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
    assert warmup["body"]["stream"] is True and len(probes) == 2 * RUNS_PER_SIZE
    # Streamed as clients stream, each size twice (warmed, then timed), every prompt token prefilled and every
    # decode token produced, all before ready.
    assert all(p["body"]["stream"] is True and p["body"]["cache_prompt"] is False and p["body"]["ignore_eos"] is True for p in probes)
    assert [p["body"] for p in probes] == [probe_request(4, 16)] * RUNS_PER_SIZE + [probe_request(40, 16)] * RUNS_PER_SIZE
    assert clock.ready_at is not None and all(e["at"] <= clock.ready_at for e in entries)
    assert capability is not None
    # Read by the prompt's ceiling, as the tracker reads a request (its bound on the prompt's tokens, from its bytes).
    ceilings = [prompt_ceiling(probe_request(words, 16)) for words in (4, 40)]
    assert [p.ctx_tokens for p in capability.prefill_tokens_per_s] == [p.ctx_tokens for p in capability.decode_tokens_per_s] == ceilings
    assert all(p.tokens_per_s > 0 for p in capability.prefill_tokens_per_s)
    # Decode as llama-server timed the stream (the fake says 1,000 tokens/s), not the spacing of its events.
    assert [p.tokens_per_s for p in capability.decode_tokens_per_s] == [1000.0, 1000.0]


def test_a_stream_gives_its_prompt_ceiling_over_its_first_token_time_and_its_decode_rate() -> None:
    measured = measured_rates(ceiling=400, ttft_s=0.1, events=17, decode_s=0.2, words=10)
    assert measured is not None and (measured.prefill, measured.decode) == (4000.0, 80.0)
    # One event alone times no decode, and a stream with none times nothing.
    assert measured_rates(400, 0.1, 1, 0.0, 10) is None and measured_rates(400, 0.0, 0, 0.0, 10) is None
    # llama-server's own decode rate for the stream, where it gave one: events may arrive several to a read.
    timed = measured_rates(ceiling=400, ttft_s=0.1, events=17, decode_s=0.002, words=10, timed_decode=120.0)
    assert timed is not None and timed.decode == 120.0


def test_only_usable_timings_make_a_figure() -> None:
    good = {"prompt_n": 30, "prompt_per_second": 900.5, "predicted_per_second": 40.0}
    assert rates_of(good) == (30, 900.5, 40.0)
    for bad in ({**good, "prompt_per_second": float("nan")}, {**good, "predicted_per_second": 0}, {**good, "prompt_n": 0},
                {**good, "prompt_n": True}, {"predicted_per_second": 1000.0}, None, [1, 2]):  # fmt: skip
        assert rates_of(bad) is None, bad
