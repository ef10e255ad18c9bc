"""The warm-up: a few generations after load and before `ready`, so the first real request
does not pay for first-use work (GPU kernels built per shape, the chat template's first
rendering, model pages read in from the mmap)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from meshnet_gguf.llama.child_loop import Outcome, OutcomeRace
from meshnet_gguf.llama.slot_fit import ask_within_a_slot, words_that_fit
from meshnet_gguf.llama.upstream import UpstreamClient, UpstreamError

log = logging.getLogger(__name__)

# The warm-up's prompt is this word repeated: about one token per word with a subword
# vocabulary (a byte-level toy vocabulary makes it a few tokens per word).
WARMUP_WORD = " the"
# Marks every request the node makes of its own llama-server (the warm-up's, the speed probe's), so llama-server's
# log (and a test's fake) can tell them from clients'. The header's name is older than the speed probe.
OWN_REQUEST_HEADER = "x-meshnet-warmup"


@dataclass(frozen=True)
class WarmupPolicy:
    """One streamed chat completion per prompt length, each `max_tokens` long, all within `timeout_s`."""

    prompt_words: tuple[int, ...] = (16,)
    max_tokens: int = 4
    timeout_s: float = 180.0


# On a GPU each prompt size picks other kernels (vector kernels for a few tokens; small,
# medium and large matrix tiles above, each aligned or not): one prompt per size class.
# Measured on an H200 (Vulkan): ~10 s the first time on a machine, while the driver builds
# its pipelines; ~0.2 s once its on-disk pipeline cache holds them. Largest first: the slot
# keeps the last prompt, and llama-server copies a slot's old prompt out to its RAM cache
# before reusing the slot, so a large last prompt cost the first user request ~40 ms.
GPU_WARMUP = WarmupPolicy(prompt_words=(600, 150, 40, 12, 2), max_tokens=8)
CPU_WARMUP = WarmupPolicy()


def warmup_for(cpu_only: bool) -> WarmupPolicy:
    """A GPU builds kernels per shape on first use: warm each size class there; a CPU only pages in."""
    return CPU_WARMUP if cpu_only else GPU_WARMUP


async def warm_up(
    proc: asyncio.subprocess.Process,
    http: UpstreamClient,
    base_url: str,
    api_key: str,
    stop_requested: anyio.Event,
    policy: WarmupPolicy,
) -> Outcome:
    """Run the warm-up generations; READY when done (or when they cannot run), else why not
    (EXITED: the child died; STOPPING: a stop was asked for)."""

    async def generate() -> None:
        with anyio.move_on_after(policy.timeout_s) as deadline:
            for words in policy.prompt_words:
                await _warmup_request(http, base_url, api_key, words, policy.max_tokens)
        if deadline.cancelled_caught:
            log.warning("llama-server warm-up took over %.0f s; reporting ready without it", policy.timeout_s)

    return await before_ready(proc, stop_requested, generate)


async def before_ready(proc: asyncio.subprocess.Process, stop_requested: anyio.Event, work: Callable[[], Awaitable[None]]) -> Outcome:
    """Run `work` against a loaded llama-server before it is reported ready: READY when it is done,
    EXITED when the child dies first, STOPPING when a stop is asked for first."""
    async with anyio.create_task_group() as tg:
        # Whichever ends first ends the work: the child exiting, a stop, or the work itself.
        race = OutcomeRace(tg, Outcome.READY)

        async def run() -> None:
            await work()
            race.end()

        race.end_when(proc.wait, Outcome.EXITED)
        race.end_when(stop_requested.wait, Outcome.STOPPING)
        tg.start_soon(run)
    return race.outcome


async def own_chat_completion(http: UpstreamClient, base_url: str, api_key: str, fields: dict[str, object]) -> tuple[int, bytes]:
    """One chat completion the node asks of its own llama-server (the warm-up, the speed probe), marked as the
    node's own (`OWN_REQUEST_HEADER`); its status and whole answer. Raises UpstreamError."""
    headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json", OWN_REQUEST_HEADER: "1"}
    response = await http.send("POST", f"{base_url}/v1/chat/completions", headers, json.dumps(fields).encode())
    try:
        return response.status, await response.read()
    finally:
        await response.aclose()


async def _warmup_request(http: UpstreamClient, base_url: str, api_key: str, words: int, max_tokens: int) -> None:
    def fields(words: int) -> dict[str, object]:
        return {
            "messages": [{"role": "user", "content": WARMUP_WORD * words}],
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0,
            # The warm-up must not leave its prompt behind as a cache hit for a real request.
            "cache_prompt": False,
        }

    def fitting(words: int, answered: tuple[int, bytes]) -> int | None:
        # Too long for a slot: the longest prompt that fits is the largest shape a client can send.
        status, answer = answered
        return words_that_fit(words, answer, max_tokens) if status == 400 else None

    try:
        status, answer = await ask_within_a_slot(
            words, lambda words: own_chat_completion(http, base_url, api_key, fields(words)), fitting, "warm-up"
        )
    except UpstreamError as exc:
        log.info("llama-server warm-up request failed (%s); going on", exc)
        return
    if status != 200:
        # An embedding-only model, say: nothing to warm through this route.
        log.info("llama-server warm-up answered %s (%s); going on", status, answer[:200])
