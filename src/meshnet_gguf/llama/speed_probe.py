"""The node measures itself: prefill and decode rates at a few prompt sizes, after warm-up and before
`ready`, so never while it serves.

The figures are llama-server's own `timings` (`prompt_per_second`, `predicted_per_second`) of a few
generations through the very llama-server that will serve (a pooled one included: its RPC workers
take part as they will for clients). They become the node's `NodeCapability`: what it announces to
its tracker and shows on its page, a claim the tracker checks against what it forwards.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from meshnet_gguf.contract.protocol import MAX_CAPABILITY_POINTS, NodeCapability, RatePoint
from meshnet_gguf.llama.child_loop import Outcome
from meshnet_gguf.llama.upstream import UpstreamClient, UpstreamError
from meshnet_gguf.llama.warmup import WARMUP_WORD, before_ready, own_chat_completion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeedProbePolicy:
    """One non-streamed generation per prompt size, smallest first, while the budget lasts.

    A size whose predicted cost (from the rates measured so far) would overrun `budget_s` is not
    run: on a slow box the probe stays a few seconds and measures fewer sizes."""

    prompt_words: tuple[int, ...] = (16, 128, 512)
    # Enough tokens that llama-server's decode rate is an average, not one step's time.
    max_tokens: int = 16
    budget_s: float = 4.0
    # One answer that never comes must not hold `ready` back for long.
    timeout_s: float = 30.0


DEFAULT_SPEED_PROBE = SpeedProbePolicy()


async def measure_speed(
    proc: asyncio.subprocess.Process,
    http: UpstreamClient,
    base_url: str,
    api_key: str,
    stop_requested: anyio.Event,
    policy: SpeedProbePolicy,
) -> tuple[Outcome, NodeCapability | None]:
    """Measure the loaded llama-server; the outcome as the warm-up's (READY, EXITED, STOPPING), and
    the figures (None when no generation gave usable timings: an embedding model, an old build)."""
    found: list[_Measured] = []
    started = time.monotonic()

    async def probe() -> None:
        with anyio.move_on_after(policy.timeout_s):
            for words in policy.prompt_words[:MAX_CAPABILITY_POINTS]:
                left_s = policy.budget_s - (time.monotonic() - started)
                if found and _predicted_s(found[-1], words, policy.max_tokens) > left_s:
                    break
                point = await _measure_once(http, base_url, api_key, words, policy.max_tokens)
                if point is None:
                    break  # the next, longer prompt fares no better (too long for a slot, no timings)
                found.append(_Measured(*point, words=words))

    outcome = await before_ready(proc, stop_requested, probe)
    spent = time.monotonic() - started
    if not found:
        log.info("llama-server gave no usable timings; this node announces no speed figures")
        return outcome, None
    capability = NodeCapability(
        prefill_tokens_per_s=[RatePoint(ctx_tokens=m.ctx, tokens_per_s=m.prefill) for m in found],
        decode_tokens_per_s=[RatePoint(ctx_tokens=m.ctx, tokens_per_s=m.decode) for m in found],
        measured_in_s=round(spent, 3),
    )
    log.info(
        "measured in %.1f s: prefill %s, decode %s tokens/s", spent,
        ", ".join(f"{p.tokens_per_s:.0f} at {p.ctx_tokens}" for p in capability.prefill_tokens_per_s),
        ", ".join(f"{p.tokens_per_s:.1f} at {p.ctx_tokens}" for p in capability.decode_tokens_per_s),
    )  # fmt: skip
    return outcome, capability


@dataclass(frozen=True)
class _Measured:
    ctx: int
    prefill: float
    decode: float
    words: int


def _predicted_s(last: _Measured, words: int, max_tokens: int) -> float:
    """What a generation with `words` prompt words should cost, at the rates of the last one measured."""
    tokens = last.ctx * words / max(last.words, 1)  # context tokens scale with the words (plus the template's few)
    return tokens / last.prefill + max_tokens / last.decode


async def _measure_once(http: UpstreamClient, base_url: str, api_key: str, words: int, max_tokens: int) -> tuple[int, float, float] | None:
    """(prompt tokens, prefill tokens/s, decode tokens/s) of one generation, or None."""
    fields = {
        "messages": [{"role": "user", "content": WARMUP_WORD * words}],
        "max_tokens": max_tokens,
        "temperature": 0,
        # Every prompt token prefilled (no cache hit), every decode token produced (no early end).
        "cache_prompt": False,
        "ignore_eos": True,
    }
    try:
        status, answer = await own_chat_completion(http, base_url, api_key, fields)
    except UpstreamError as exc:
        log.info("speed measurement request failed (%s)", exc)
        return None
    if status != 200:
        log.info("speed measurement with %d words answered %s; stopping there", words, status)
        return None
    try:
        timings = json.loads(answer).get("timings")
    except (ValueError, AttributeError):
        return None
    return rates_of(timings)


def rates_of(timings: Any) -> tuple[int, float, float] | None:
    """(prompt tokens, prefill tokens/s, decode tokens/s) from llama-server's `timings`, when all are usable."""
    if not isinstance(timings, Mapping):
        return None
    ctx, prefill, decode = timings.get("prompt_n"), timings.get("prompt_per_second"), timings.get("predicted_per_second")
    if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 1:
        return None
    for rate in (prefill, decode):
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not math.isfinite(rate) or rate <= 0:
            return None
    return ctx, float(prefill), float(decode)


__all__ = ["DEFAULT_SPEED_PROBE", "SpeedProbePolicy", "measure_speed", "rates_of"]
