"""The node measures itself: prefill and decode rates at a few prompt sizes, after warm-up and before
`ready`, so never while it serves.

It measures what a client will get, as the tracker will time it (docs/protocol.md, section 8.1): each
prompt size is one streamed chat request through the very llama-server that will serve, with its
settings (a pooled one included: its RPC workers take part as they will for clients), sent twice, the
first to warm that size (a GPU backend builds its kernels for a new batch shape) and the second timed,
on the node's own clock:

- prefill: the prompt's ceiling (`contract.prompt_ceiling`, the tracker's bound on a prompt's tokens
  from its bytes, which it reads claims against) over the time from sending the request to its first
  content event: llama-server's queue, template, tokenizer and prefill, as a client waits for them;
- decode: llama-server's own rate for the stream (`timings.predicted_per_second`), else the content
  events after the first over the time from the first to the last; one stream alone.

llama-server's own `timings` count real tokens and prefill alone, so a claim made of them read 3-6x
below what the tracker then measured (a GPU node claimed 10,207 prefill tokens/s, the tracker saw
61,176 on its prompt bound). Decode is claimed for one stream, not a batch: the tracker measures a
node's sequential streams, and a claim above what those deliver by `CLAIM_FLAG_FACTOR` is flagged.
The figures become the node's `NodeCapability`: what it announces to its tracker and shows on its page.
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

from meshnet_gguf.contract.prompt_ceiling import prompt_ceiling
from meshnet_gguf.contract.protocol import MAX_CAPABILITY_POINTS, NodeCapability, RatePoint
from meshnet_gguf.llama.child_loop import Outcome
from meshnet_gguf.llama.slot_fit import ask_within_a_slot, words_that_fit
from meshnet_gguf.llama.upstream import UpstreamClient, UpstreamError
from meshnet_gguf.llama.warmup import OWN_REQUEST_HEADER, WARMUP_WORD, before_ready

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeedProbePolicy:
    """Two streamed generations per prompt size (one to warm it, one timed), smallest first, while the budget lasts.

    A size whose predicted cost (from the rates measured so far) would overrun `budget_s` is not
    run: on a slow box the probe stays a few seconds and measures fewer sizes."""

    prompt_words: tuple[int, ...] = (16, 128, 512)
    # The warming run's answer: enough tokens for a first decode rate to size the timed run by.
    max_tokens: int = 16
    # The timed run decodes for about this long at the warming run's rate, within [max_tokens,
    # max_decode_tokens] tokens: 16 tokens last ~20 ms on a GPU, too short a stretch to read its
    # steady rate from (an H100 node claimed 367 tokens/s from them and delivered 743), and the
    # clients the tracker times ask for tens to hundreds.
    decode_stretch_s: float = 0.25
    max_decode_tokens: int = 256
    budget_s: float = 4.0
    # One answer that never comes must not hold `ready` back for long.
    timeout_s: float = 30.0


DEFAULT_SPEED_PROBE = SpeedProbePolicy()
# Runs of each prompt size: the first warms it (not kept), the last is timed.
RUNS_PER_SIZE = 2


async def measure_speed(
    proc: asyncio.subprocess.Process,
    http: UpstreamClient,
    base_url: str,
    api_key: str,
    stop_requested: anyio.Event,
    policy: SpeedProbePolicy,
) -> tuple[Outcome, NodeCapability | None]:
    """Measure the loaded llama-server; the outcome as the warm-up's (READY, EXITED, STOPPING), and
    the figures (None when no generation streamed usable content: an embedding model, say)."""
    found: list[_Measured] = []
    started = time.monotonic()

    async def probe() -> None:
        with anyio.move_on_after(policy.timeout_s):
            for words in policy.prompt_words[:MAX_CAPABILITY_POINTS]:
                left_s = policy.budget_s - (time.monotonic() - started)
                if found and _predicted_s(found[-1], words, policy) > left_s:
                    break
                point = await _measure_size(http, base_url, api_key, words, policy)
                if point is None:
                    break  # the next, longer prompt fares no better (no content, an error)
                found.append(point)
                if point.words < words:
                    break  # shrunk to the slot's largest prompt: a longer one fits no better

    outcome = await before_ready(proc, stop_requested, probe)
    spent = time.monotonic() - started
    if not found:
        log.info("llama-server streamed no usable answer to the speed probe; this node announces no speed figures")
        return outcome, None
    capability = NodeCapability(
        prefill_tokens_per_s=[RatePoint(ctx_tokens=m.ceiling, tokens_per_s=m.prefill) for m in found],
        decode_tokens_per_s=[RatePoint(ctx_tokens=m.ceiling, tokens_per_s=m.decode) for m in found],
        measured_in_s=round(spent, 3),
    )
    log.info(
        "measured in %.1f s: prefill %s, decode %s tokens/s (prompt-bound tokens, as the tracker reads them)", spent,
        ", ".join(f"{p.tokens_per_s:.0f} at {p.ctx_tokens}" for p in capability.prefill_tokens_per_s),
        ", ".join(f"{p.tokens_per_s:.1f} at {p.ctx_tokens}" for p in capability.decode_tokens_per_s),
    )  # fmt: skip
    return outcome, capability


@dataclass(frozen=True)
class _Measured:
    ceiling: int  # the request's prompt ceiling
    prefill: float  # ceiling tokens per second of time to the first content event
    decode: float  # content events per second after the first
    words: int


@dataclass(frozen=True)
class _TooLong:
    """llama-server refused the prompt as longer than a slot; `fitted_words` fit."""

    fitted_words: int


async def _measure_size(http: UpstreamClient, base_url: str, api_key: str, words: int, policy: SpeedProbePolicy) -> _Measured | None:
    """One prompt size: a warming run (shrunk to the slot's largest prompt where `words` is too long:
    `slot_fit.ask_within_a_slot`), then the timed run, decoding for about `decode_stretch_s`; None when either is unusable."""
    warm = await ask_within_a_slot(
        words,
        lambda words: _measure_once(http, base_url, api_key, words, policy.max_tokens, policy.max_decode_tokens),
        lambda _, answer: answer.fitted_words if isinstance(answer, _TooLong) else None,
        "speed probe",
    )
    if not isinstance(warm, _Measured):
        return None
    timed = await _measure_once(http, base_url, api_key, warm.words, decode_tokens(warm.decode, policy), policy.max_decode_tokens)
    return timed if isinstance(timed, _Measured) else None


def decode_tokens(rate: float, policy: SpeedProbePolicy) -> int:
    """The timed run's answer length: about `decode_stretch_s` of decode at `rate`, within the policy's bounds."""
    return max(policy.max_tokens, min(policy.max_decode_tokens, math.ceil(rate * policy.decode_stretch_s)))


def _predicted_s(last: _Measured, words: int, policy: SpeedProbePolicy) -> float:
    """What one prompt size with `words` prompt words should cost, at the rates of the last one measured."""
    ceiling = last.ceiling * words / max(last.words, 1)  # a word is a few bytes; the allowances are the same
    answer_tokens = policy.max_tokens + decode_tokens(last.decode, policy)
    return RUNS_PER_SIZE * ceiling / last.prefill + answer_tokens / last.decode


def probe_request(words: int, max_tokens: int) -> dict[str, Any]:
    """The body of one measurement: a chat turn of `words` words, streamed as clients stream."""
    return {
        "messages": [{"role": "user", "content": WARMUP_WORD * words}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        # Every prompt token prefilled (no cache hit), every decode token produced (no early end).
        "cache_prompt": False,
        "ignore_eos": True,
    }


async def _measure_once(
    http: UpstreamClient, base_url: str, api_key: str, words: int, max_tokens: int, room_tokens: int
) -> _Measured | _TooLong | None:
    """One streamed generation, timed from the request to its first and last content event; `_TooLong` when
    the prompt does not fit a slot (with `room_tokens` of answer beside it); None when unusable."""
    fields = probe_request(words, max_tokens)
    headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json", OWN_REQUEST_HEADER: "1"}
    sent = time.perf_counter()
    first = last = 0.0
    events = 0
    timed_decode: float | None = None
    try:
        response = await http.send("POST", f"{base_url}/v1/chat/completions", headers, json.dumps(fields).encode())
        try:
            if response.status != 200:
                fitted = words_that_fit(words, await response.read(), room_tokens) if response.status == 400 else None
                if fitted is not None:
                    return _TooLong(fitted)
                log.info("speed measurement with %d words answered %s; stopping there", words, response.status)
                return None
            buffer = b""
            async for chunk in response.iter_chunks():
                buffer += chunk
                *whole, buffer = buffer.split(b"\n\n")
                for event in whole:
                    if event.startswith(b":"):
                        continue
                    if b'"content":"' in event:
                        last = time.perf_counter()
                        first = first or last
                        events += 1
                    if b'"timings"' in event:
                        timed_decode = _timed_decode(event)
        finally:
            await response.aclose()
    except UpstreamError as exc:
        log.info("speed measurement request failed (%s)", exc)
        return None
    return measured_rates(prompt_ceiling(fields), first - sent if events else 0.0, events, last - first, words, timed_decode)


def measured_rates(
    ceiling: int, ttft_s: float, events: int, decode_s: float, words: int, timed_decode: float | None = None
) -> _Measured | None:
    """The figures of one stream, when all are usable: a first content event, and one more at least after it.

    Decode is llama-server's own rate for the stream where it gave one (`timed_decode`): events that come
    faster than it writes them arrive several to a read, so their spacing overstates the rate (a tiny model
    read 7,286 tokens/s that way where llama-server timed 1,509, and the tracker, further on, 2,002)."""
    if events < 2 or ttft_s <= 0 or decode_s <= 0:
        return None
    prefill, decode = ceiling / ttft_s, timed_decode or (events - 1) / decode_s
    if not (math.isfinite(prefill) and math.isfinite(decode)):
        return None
    return _Measured(ceiling=ceiling, prefill=prefill, decode=decode, words=words)


def _timed_decode(event: bytes) -> float | None:
    """llama-server's `timings.predicted_per_second` in one stream event, when usable."""
    try:
        timings = json.loads(event.partition(b"data:")[2]).get("timings")
    except (ValueError, AttributeError):
        return None
    rate = timings.get("predicted_per_second") if isinstance(timings, Mapping) else None
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not math.isfinite(rate) or rate <= 0:
        return None
    return float(rate)


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


__all__ = [
    "DEFAULT_SPEED_PROBE",
    "RUNS_PER_SIZE",
    "SpeedProbePolicy",
    "decode_tokens",
    "measure_speed",
    "measured_rates",
    "probe_request",
    "rates_of",
]
