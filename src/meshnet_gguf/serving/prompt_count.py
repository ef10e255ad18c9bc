"""Counting a prompt's tokens with llama-server's own template and tokenizer.

The count bills the prompt of a request cut short at any moment. `PromptCounter`
asks llama-server (`/apply-template` for a chat, then `/tokenize`); `PromptCount`
decides when: never before forwarding, and on a node that keeps the request body
durably, only for an answer that does not carry llama-server's own count.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.openai_paths import CHAT_COMPLETIONS_PATH
from meshnet_gguf.contract.strict_json import parse_json_object
from meshnet_gguf.llama.upstream import UpstreamClient, UpstreamError
from meshnet_gguf.serving.admission_modes import unavailable
from meshnet_gguf.serving.request_validation import single_prompt
from meshnet_gguf.serving.upstream_target import UpstreamTarget, upstream_headers

log = logging.getLogger(__name__)

# llama-server's template and tokenizer answer in milliseconds, so a count this late
# means it is wedged: bill 0 then.
PROMPT_COUNT_TIMEOUT_S = 10.0
# How often a count of a stored request body looks whether llama-server is ready yet.
UPSTREAM_READY_POLL_S = 0.5


class _NoCounter(Exception):
    """llama-server answered 404 for the endpoint the prompt count needs."""


class PromptCounter:
    """Asks llama-server how many tokens a request's prompt is."""

    def __init__(self, client: UpstreamClient, retry_after_s: int) -> None:
        self._client = client
        self._retry_after_s = retry_after_s

    async def count(self, target: UpstreamTarget, path: str, payload: dict[str, Any], body: bytes) -> int:
        """The count, or 0 from a llama-server build without the counting endpoints."""
        try:
            return await self._count_prompt(target, path, payload, body)
        except _NoCounter as missing:
            # A llama-server build without the endpoint: the prompt is billed from its usage only.
            log.warning("llama-server has no %s; prompts are counted only when an answer completes", missing)
            return 0

    async def _count_prompt(self, target: UpstreamTarget, path: str, payload: dict[str, Any], body: bytes) -> int:
        """llama-server answering 4xx/5xx here means it cannot parse this body (the chat
        parser throws on shapes the node does not check, such as a tool list it cannot
        read); nothing ran, so the client gets a 400 with llama-server's reason.
        """
        if path == CHAT_COMPLETIONS_PATH:
            rendered = await self._ask_upstream(target, "/apply-template", body)
            prompt: Any = rendered.get("prompt")
            if not isinstance(prompt, str):
                raise ApiError(400, "invalid_request", "llama-server could not render this chat with its template")
        else:
            prompt = single_prompt(path, payload)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if isinstance(prompt, list):  # several embedding inputs: each is tokenized on its own
            counts = [await self._count_text(target, p) for p in prompt]
            return sum(counts)
        return await self._count_text(target, prompt)

    async def _count_text(self, target: UpstreamTarget, prompt: Any) -> int:
        if isinstance(prompt, list):
            return len(prompt)
        request = json.dumps({"content": prompt, "add_special": True, "parse_special": True}).encode()
        tokens = (await self._ask_upstream(target, "/tokenize", request)).get("tokens")
        if not isinstance(tokens, list):
            raise ApiError(400, "invalid_request", "llama-server could not tokenize this prompt")
        return len(tokens)

    async def _ask_upstream(self, target: UpstreamTarget, path: str, body: bytes) -> dict[str, Any]:
        try:
            response = await self._client.send("POST", target.base_url + path, upstream_headers(target), body)
            try:
                raw = await response.read()
            finally:
                await response.aclose()
        except UpstreamError as exc:
            raise unavailable(f"llama-server is not answering: {exc}", self._retry_after_s) from None
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if response.status == 404:
            raise _NoCounter(path)
        if response.status >= 400 or not isinstance(answer, dict):
            reason = _upstream_error_message(answer) or f"status {response.status}"
            if response.status in (401, 403) or response.status >= 502:
                raise unavailable(f"llama-server did not prepare the request ({reason}); retry shortly", self._retry_after_s)
            raise ApiError(400, "invalid_request", f"llama-server cannot read this request: {reason}")
        return answer


def stored_prompt_counter(upstream: Callable[[], UpstreamTarget | None], counter: PromptCounter) -> Callable[[str, bytes], Awaitable[int]]:
    """`count(path, body)` for a request body kept on disk (a restart bills a prompt its node
    died before counting): waits until llama-server is ready, then counts as for a live request."""

    async def count(path: str, body: bytes) -> int:
        while (target := upstream()) is None:
            await anyio.sleep(UPSTREAM_READY_POLL_S)
        return await counter.count(target, path, parse_json_object(body), body)

    return count


class PromptCount:
    """A request's prompt, counted when the answer does not say how long it was.

    A completed answer carries llama-server's own count (`usage`, or a stream's last
    `timings`), and that is what is billed; counting again would cost two round trips to
    llama-server beside the generation. So a node that keeps the request body where its
    prompt can still be counted later (a meshed node's ledger row) counts only on need
    (`settled()`): an answer cut short, broken off or refused. A node that keeps nothing
    counts a stream beside it (`begin()`, once its first bytes are out, so the count never
    delays them), while llama-server is surely there to answer.

    `on_counted` is told only a count llama-server gave (or its refusal to read the prompt,
    as 0): when it went away or was wedged, the record keeps what it needs to count later.
    """

    def __init__(self, counting: Callable[[], Awaitable[int]], *, on_counted: Callable[[int], Awaitable[None]] | None = None) -> None:
        self._counting = counting
        self._on_counted = on_counted
        self._beside = False
        self._running: asyncio.Task[None] | None = None
        self._tokens: int | None = None
        self._refusal: ApiError | None = None

    def count_beside(self) -> None:
        """`begin()` will count beside the answer, in a task of its own."""
        self._beside = True

    def begin(self) -> None:
        """The answer's first bytes are out: start counting beside it, if `count_beside` asked for it."""
        if self._beside and self._running is None and self._tokens is None:
            # A bare asyncio task rather than one in an anyio task group: the group cost a
            # standalone stream ~45 µs of CPU more (bench/request_cost.py).
            self._running = asyncio.get_running_loop().create_task(self._count_beside())

    async def settled(self) -> int:
        """The count, asked of llama-server once (0 when it could not give it in time)."""
        if self._running is not None:
            # Shielded: a caller cancelled meanwhile leaves the count running for the request's end.
            await asyncio.shield(self._running)
        if self._tokens is None:
            self._tokens = await self._count()
        return self._tokens

    def drop(self) -> None:
        """The answer carried llama-server's own count (or the request is being cancelled): a count
        still running beside it is not needed."""
        if self._running is not None and not self._running.done():
            self._running.cancel()

    async def refusal(self) -> ApiError | None:
        """llama-server's 400 for a prompt it cannot read, if that is what counting it got."""
        await self.settled()
        return self._refusal

    async def _count_beside(self) -> None:
        self._tokens = await self._count()

    async def _count(self) -> int:
        tokens, landed = 0, False
        try:
            with anyio.move_on_after(PROMPT_COUNT_TIMEOUT_S):
                tokens = await self._counting()
                landed = True
        except ApiError as exc:
            if exc.status == 400:
                self._refusal = exc
                landed = True
        if self._on_counted is not None and landed:
            with anyio.CancelScope(shield=True), anyio.move_on_after(PROMPT_COUNT_TIMEOUT_S):
                try:
                    await self._on_counted(tokens)
                except Exception:  # the record keeps what it needs to count the prompt later
                    log.exception("could not record a prompt count of %d tokens", tokens)
        return tokens


def _upstream_error_message(answer: Any) -> str | None:
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        message = answer["error"].get("message")
        return str(message) if message else None
    return None


__all__ = ["PROMPT_COUNT_TIMEOUT_S", "PromptCount", "PromptCounter", "stored_prompt_counter"]
