"""An in-process llama-server for the proxy's tests: an `UpstreamClient` that answers like llama-server.

The proxy is pure ASGI and reaches llama-server only through the small
`UpstreamClient` interface, so its tests hand it this fake instead of a child
process. Every request it was sent is kept (`requests`), every answer it gave
too (`answers`), and a test can script an answer: its status, the chunks as a
socket would deliver them, a pause before a chunk (`hold_before`, released with
`release()`), or a connection that breaks after some chunks (`break_after`).
The answers mimic llama-server's: an opening role delta, one event per token,
a closing chunk with `finish_reason`, then the usage chunk when asked, `[DONE]`;
`/apply-template` and `/tokenize` answer as llama-server's do, and the prompt
counts in usage come from that same tokenizer (one token per character).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anyio

from meshnet_gguf.llama.upstream import UpstreamError

ALIAS = "tiny"
INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
# Tokens per answer unless the request's max_tokens asks for fewer (as the fake process does).
DEFAULT_TOKENS = 8
CACHED_TOKENS = 2
DECODE_TOKENS_PER_S = 1000.0
# Longest a held answer waits to be released: a test that forgets to release fails, not hangs.
HOLD_TIMEOUT_S = 10.0


@dataclass
class SentRequest:
    method: str
    url: str
    headers: dict[str, str]
    body: bytes | None

    @property
    def path(self) -> str:
        return urlsplit(self.url).path

    def json(self) -> Any:
        return json.loads(self.body or b"null")


class FakeAnswer:
    """One upstream answer (implements `UpstreamResponse`), delivered chunk by chunk as scripted."""

    def __init__(
        self,
        status: int = 200,
        chunks: Sequence[bytes] = (),
        *,
        content_type: str = "application/json",
        break_after: int | None = None,
        hold_before: int | None = None,
    ) -> None:
        self.status = status
        self.headers: list[tuple[str, str]] = [
            ("Content-Type", content_type),
            ("Server", "llama.cpp"),
            ("Access-Control-Allow-Origin", ""),
            ("Keep-Alive", "timeout=5, max=100"),
        ]
        self.chunks = list(chunks)
        self.break_after = break_after
        self.hold_before = hold_before
        self.delivered = 0
        self.closed = False
        self.held = anyio.Event()  # set once delivery paused at `hold_before`
        self._release = anyio.Event()

    def release(self) -> None:
        self._release.set()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(self.chunks):
            if i == self.break_after:
                raise UpstreamError("llama-server connection broke: fake connection reset")
            if i == self.hold_before:
                self.held.set()
                with anyio.fail_after(HOLD_TIMEOUT_S):
                    await self._release.wait()
            if self.closed:
                raise UpstreamError("read after close")
            self.delivered += 1
            yield chunk
        if self.break_after is not None and self.break_after >= len(self.chunks):
            raise UpstreamError("llama-server connection broke: fake connection reset")

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_chunks()])

    async def aclose(self) -> None:
        self.closed = True


Responder = Callable[[SentRequest], FakeAnswer]


class FakeLlamaUpstream:
    """The fake client (implements `UpstreamClient`). `respond` decides each answer; `unreachable` refuses all."""

    def __init__(self, respond: Responder | None = None) -> None:
        self.respond: Responder = respond or llama_answer
        self.requests: list[SentRequest] = []  # everything llama-server was asked
        self.answers: list[FakeAnswer] = []
        self.unreachable = False
        self.closed = False

    async def send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> FakeAnswer:
        if self.unreachable:
            raise UpstreamError("llama-server unreachable: fake connection refused")
        request = SentRequest(method, url, dict(headers), body)
        self.requests.append(request)
        answer = self.respond(request)
        self.answers.append(answer)
        return answer

    async def aclose(self) -> None:
        self.closed = True

    def forwarded(self) -> list[SentRequest]:
        """The requests forwarded to an inference route (not the proxy's own questions)."""
        return [r for r in self.requests if r.path in INFERENCE_PATHS]

    def forwarded_answers(self) -> list[FakeAnswer]:
        return [a for r, a in zip(self.requests, self.answers) if r.path in INFERENCE_PATHS]


# --- llama-server-like answers ------------------------------------------------------
def llama_answer(request: SentRequest, **stream_options: Any) -> FakeAnswer:
    """What llama-server answers to `request`; `stream_options` go to `stream_answer` for streams."""
    path = request.path
    if path == "/v1/models":
        return json_answer({"object": "list", "data": [{"id": ALIAS, "object": "model", "owned_by": "llamacpp"}]})
    if path not in INFERENCE_PATHS | {"/apply-template", "/tokenize"} or request.method != "POST":
        return json_answer({"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}, 404)
    payload = request.json()
    if path == "/apply-template":
        return json_answer({"prompt": render_chat(payload.get("messages") or [])})
    if path == "/tokenize":
        return json_answer({"tokens": tokenize(payload.get("content"))})
    prompt_tokens = prompt_tokens_of(path, payload)
    if path == "/v1/embeddings":
        return json_answer(
            {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                "model": ALIAS,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            }
        )
    n = min(DEFAULT_TOKENS, int(payload.get("max_tokens") or DEFAULT_TOKENS))
    chat = path == "/v1/chat/completions"
    if payload.get("stream"):
        usage = bool((payload.get("stream_options") or {}).get("include_usage"))
        events = stream_events(n, chat=chat, usage=usage, prompt_tokens=prompt_tokens)
        return FakeAnswer(200, events, content_type="text/event-stream", **stream_options)
    text = "x" * n
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return json_answer(
        {
            "id": "fake-1",
            "object": "chat.completion" if chat else "text_completion",
            "created": 0,
            "model": ALIAS,
            "choices": [choice],
            "usage": _usage(prompt_tokens, n),
            "timings": {"predicted_per_second": DECODE_TOKENS_PER_S},
        }
    )


def json_answer(payload: object, status: int = 200) -> FakeAnswer:
    return FakeAnswer(status, [json.dumps(payload).encode()])


def stream_events(
    n: int, *, chat: bool = True, usage: bool = True, done: bool = True, ping_every: int = 0, prompt_tokens: int = 0
) -> list[bytes]:
    """The SSE events of a streamed answer of `n` tokens, one event per list item."""
    head = b'data: {"id":"fake-1","object":"chat.completion.chunk","model":"' + ALIAS.encode() + b'","choices":[{"index":0,'
    events = [head + b'"delta":{"role":"assistant","content":null},"finish_reason":null}]}\n\n'] if chat else []
    for i in range(n):
        events.append(
            head + (b'"delta":{"content":"x"},"finish_reason":null}]}\n\n' if chat else b'"text":"x","finish_reason":null}]}\n\n')
        )
        if ping_every and (i + 1) % ping_every == 0:
            events.append(b": ping\n\n")
    last = head + (b'"delta":{},"finish_reason":"length"}]' if chat else b'"text":"","finish_reason":"length"}]')
    if not usage and prompt_tokens:
        # As llama-server does: the last chunk carries its timings whether or not usage was asked for.
        timings = {"cache_n": CACHED_TOKENS, "prompt_n": prompt_tokens - CACHED_TOKENS, "predicted_n": n,
                   "predicted_per_second": DECODE_TOKENS_PER_S}  # fmt: skip
        last += b',"timings":' + json.dumps(timings, separators=(",", ":")).encode()
    events.append(last + b"}\n\n")
    if usage:
        chunk = {"id": "fake-1", "object": "chat.completion.chunk", "choices": [], "usage": _usage(prompt_tokens, n),
                 "timings": {"predicted_per_second": DECODE_TOKENS_PER_S}}  # fmt: skip
        events.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    if done:
        events.append(b"data: [DONE]\n\n")
    return events


def render_chat(messages: list[Any]) -> str:
    """The chat as the fake's template renders it."""
    return "".join(f"<{m.get('role')}>{m.get('content')}" for m in messages if isinstance(m, dict))


def tokenize(content: Any) -> list[int]:
    """The fake's tokenizer: one token per character; a list of token ids is already tokens."""
    return content if isinstance(content, list) else [ord(c) for c in str(content)]


def prompt_tokens_of(path: str, payload: dict[str, Any]) -> int:
    """How many prompt tokens llama-server (this fake) reports for a request."""
    if path == "/v1/chat/completions":
        return len(tokenize(render_chat(payload.get("messages") or [])))
    return len(tokenize(payload.get("prompt" if path == "/v1/completions" else "input")))


def _usage(prompt_tokens: int, n: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n,
        "total_tokens": prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
    }


@dataclass
class Scripted:
    """A responder that gives the scripted answers in order, then llama-server's usual ones."""

    queue: list[FakeAnswer] = field(default_factory=list)

    def __call__(self, request: SentRequest) -> FakeAnswer:
        return self.queue.pop(0) if self.queue and request.path in INFERENCE_PATHS else llama_answer(request)
