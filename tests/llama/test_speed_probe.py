"""The node measures itself after the warm-up and before `ready` (never while serving), as a client
and the tracker will see it (streamed, each size warmed, the prompt read by its ceiling), in a bounded time."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import anyio
import pytest
from support.supervisor_policies import QUICK, ReadyClock

from meshnet_gguf.contract.prompt_ceiling import prompt_ceiling
from meshnet_gguf.contract.protocol import NodeCapability
from meshnet_gguf.llama.child import ChildSpec
from meshnet_gguf.llama.slot_fit import SLOT_FIT_MARGIN_TOKENS, words_that_fit
from meshnet_gguf.llama.speed_probe import RUNS_PER_SIZE, SpeedProbePolicy, decode_tokens, measured_rates, probe_request, rates_of
from meshnet_gguf.llama.supervisor import Supervisor
from meshnet_gguf.llama.warmup import WarmupPolicy

pytestmark = pytest.mark.anyio


async def _capability_when_ready(supervisor: Supervisor, within_s: float) -> NodeCapability | None:
    """Run the supervisor until llama-server is ready (warmed and measured), then stop it; the figures it kept."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervisor.run)
        with anyio.fail_after(within_s):
            while supervisor.state != "ready":
                await anyio.sleep(0.02)
        capability = supervisor.capability
        await supervisor.stop()
    return capability


async def test_the_probe_runs_after_the_warmup_and_before_ready_and_its_figures_are_kept(fake_llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "warmup.jsonl"
    clock = ReadyClock()
    policy = dataclasses.replace(
        QUICK, warmup=WarmupPolicy(prompt_words=(3,), max_tokens=2), speed_probe=SpeedProbePolicy(prompt_words=(4, 40))
    )
    supervisor = Supervisor(
        ChildSpec(fake_llama, ["--model", "m.gguf"], {"FAKE_LLAMA_WARMUP_LOG": str(log)}), policy, state_dir=tmp_path, listeners=[clock]
    )
    capability = await _capability_when_ready(supervisor, within_s=20)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    warmup, *probes = entries
    assert warmup["body"]["stream"] is True and len(probes) == 2 * RUNS_PER_SIZE
    # Streamed as clients stream, each size twice (warmed, then timed), every prompt token prefilled and every
    # decode token produced, all before ready.
    assert all(p["body"]["stream"] is True and p["body"]["cache_prompt"] is False and p["body"]["ignore_eos"] is True for p in probes)
    # The timed run decodes for the policy's stretch at the warming run's rate (the fake times 1,000 tokens/s: 250 tokens).
    timed_tokens = decode_tokens(1000.0, SpeedProbePolicy())
    assert timed_tokens == 250
    assert [p["body"] for p in probes] == [
        probe_request(4, 16),
        probe_request(4, timed_tokens),
        probe_request(40, 16),
        probe_request(40, timed_tokens),
    ]
    assert clock.ready_at is not None and all(e["at"] <= clock.ready_at for e in entries)
    assert capability is not None
    # Read by the prompt's ceiling, as the tracker reads a request (its bound on the prompt's tokens, from its bytes).
    ceilings = [prompt_ceiling(probe_request(words, timed_tokens)) for words in (4, 40)]
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


def test_the_timed_run_decodes_for_the_stretch_within_its_bounds() -> None:
    policy = SpeedProbePolicy(max_tokens=16, decode_stretch_s=0.25, max_decode_tokens=256)
    # A GPU's 700 tokens/s: a quarter second is 175 tokens, not 16 (~20 ms, too short a stretch to read a rate from).
    assert decode_tokens(700.0, policy) == 175
    # A slow CPU's 5 tokens/s keeps the warming run's length; a very fast node stops at the bound.
    assert decode_tokens(5.0, policy) == 16 and decode_tokens(50_000.0, policy) == 256


def test_a_refusal_for_a_prompt_longer_than_the_slot_says_how_many_words_fit() -> None:
    refusal = json.dumps(
        {"error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 2450, "n_ctx": 2048}}
    ).encode()  # fmt: skip
    fitted = words_that_fit(600, refusal, answer_tokens=256)
    # Proportional, with the answer and a margin left free: (2048 - 256 - 16) / 2450 of 600 words.
    assert fitted == (2048 - 256 - SLOT_FIT_MARGIN_TOKENS) * 600 // 2450
    # Anything else is no such refusal: another error, a body that is not JSON, numbers that are not counts, no room.
    for other in (b'{"error":{"type":"invalid_request_error","n_prompt_tokens":2450,"n_ctx":2048}}', b"<html>", b"[]",
                  b'{"error":{"type":"exceed_context_size_error","n_prompt_tokens":"2450","n_ctx":2048}}',
                  b'{"error":{"type":"exceed_context_size_error","n_prompt_tokens":true,"n_ctx":2048}}'):  # fmt: skip
        assert words_that_fit(600, other, 256) is None, other
    assert words_that_fit(600, refusal, answer_tokens=2048) is None


@pytest.mark.real_llama
async def test_prompts_too_long_for_a_slot_are_warmed_and_measured_at_the_slots_largest(  # type: ignore[no-untyped-def]
    real_llama, tiny_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The byte-level vocabulary makes a word 4 tokens: 600 words do not fit a 1,024-token slot, 60 do.
    policy = dataclasses.replace(
        QUICK,
        warmup=WarmupPolicy(prompt_words=(600,), max_tokens=4),
        speed_probe=SpeedProbePolicy(prompt_words=(60, 600, 6000), budget_s=60.0),
    )
    args = ["--model", str(tiny_gguf), "--ctx-size", "1024", "--parallel", "1", "--threads", "1"]
    supervisor = Supervisor(ChildSpec(real_llama, args), policy, state_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="meshnet_gguf.llama"):
        capability = await _capability_when_ready(supervisor, within_s=90)
    said = caplog.text
    assert "warm-up prompt of 600 words is too long for a slot" in said and "warm-up answered" not in said
    assert "speed probe prompt of 600 words is too long for a slot" in said
    assert capability is not None
    ceilings = [p.ctx_tokens for p in capability.prefill_tokens_per_s]
    # Two points: 60 words, and 600 shrunk to the slot's largest (the 6,000 after it never asked: it fits no better).
    assert len(ceilings) == 2 and ceilings[1] > ceilings[0]
    fitted_words = int(said.rsplit("too long for a slot; shrunk to ", 1)[1].split()[0])
    assert ceilings[1] == prompt_ceiling(probe_request(fitted_words, 16))
    # The shrunk prompt fills the slot but for the timed answer's room: within a quarter of it.
    room = 1024 - SpeedProbePolicy().max_decode_tokens - SLOT_FIT_MARGIN_TOKENS
    assert 0.75 * room <= 4 * fitted_words <= room
