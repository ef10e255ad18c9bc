"""Billing nobody can dodge: the prompt is counted by llama-server before the first output token and
billed on every outcome, usage is found wherever llama-server puts it, and a crash of llama-server
leaves records with the real prompt and the partial completion. Real llama-server, tiny F16 model,
the node's real front (proxy + listener) in process."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
from support.billing_harness import LLAMA_KEY, LlamaChild, serve_front, wait_records

pytestmark = [pytest.mark.anyio, pytest.mark.real_llama]
JSON = {"content-type": "application/json"}
# The tiny model's vocabulary is ASCII bytes: one character, one token (plus the template).
LONG_PROMPT = "klmnopqrst" * 150
# How many llama-server kills the mid-stream fault test runs (bench: FAULT_KILLS=20).
KILLS = int(os.environ.get("FAULT_KILLS", "3"))
ERROR_EVENT_WITHIN_S = 1.0
# Ready again after a llama-server crash within its own load time plus this: the restart's backoff (a first crash
# waits `restart_backoff_initial_s`) and 2 s for the new child's warm-up and the health poll on a 2-core box the rest
# of the suite loads (measured 0.3-1.3 s past the backoff there; 2 s in all once missed by 0.21 s beside the chaos soak).
READY_AGAIN_MARGIN_S = NodeSettings.model_fields["restart_backoff_initial_s"].default + 2.0
# A stream the tests leave or kill must still be generating then, on any CPU: the tiny model writes several
# thousand tokens a second on a fast one, so a 400-token answer (or the 548 a 2,048-token slot leaves after the
# prompt) could end before the client left or the node's prompt counts landed. 6,000 tokens take seconds anywhere.
LONG_ANSWER_TOKENS = 6000
LONG_SLOT_TOKENS = 8192


@pytest.fixture(scope="module")
def long_context_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with room for a long answer: llama-server caps a slot at the model's trained context."""
    return write_tiny_model(tmp_path_factory.mktemp("long-context") / "tiny.gguf", TinyModelSpec(context_length=LONG_SLOT_TOKENS))


@pytest.fixture(scope="module")
def llama(real_llama: BinaryInfo, long_context_gguf: Path):  # type: ignore[no-untyped-def]
    child = LlamaChild(real_llama, long_context_gguf, slots=2, ctx_size=2 * LONG_SLOT_TOKENS)
    yield child
    child.close()


def tokenize(llama: LlamaChild, text: str) -> int:
    answer = httpx.post(llama.url + "/tokenize", json={"content": text, "add_special": True, "parse_special": True},
                        headers={"authorization": "Bearer internal-test-key"})  # fmt: skip
    return len(answer.json()["tokens"])


def events_of(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


async def test_streamed_completions_bill_their_prompt(llama: LlamaChild) -> None:
    async with serve_front(llama.url) as front, httpx.AsyncClient(base_url=front.url, timeout=30) as client:
        body = {"prompt": "Hello there", "max_tokens": 4, "stream": True, "ignore_eos": True}
        raw = (await client.post("/v1/completions", json=body)).content
        [record] = await wait_records(front.sink, 1)
    assert (record.prompt_tokens, record.completion_tokens, record.finish_reason) == (tokenize(llama, "Hello there"), 4, "length")
    usage_comment = [e for e in events_of(raw) if e.startswith(b": meshnet-usage ")]
    assert json.loads(usage_comment[0][len(b": meshnet-usage ") :])["prompt_tokens"] == record.prompt_tokens > 0


async def test_chat_streams_keep_llama_timings_and_are_billed_from_them(llama: LlamaChild) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    async with serve_front(llama.url) as front, httpx.AsyncClient(base_url=front.url, timeout=30) as client:
        whole = (await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "ignore_eos": True})).json()
        raw = (
            await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "stream": True, "ignore_eos": True})
        ).content
        records = await wait_records(front.sink, 2)
    events = events_of(raw)
    # What llama-server sends for this request: no usage-only chunk, timings in the finish chunk.
    assert not [e for e in events if b'"choices":[]' in e]
    finish = [json.loads(e[len(b"data: ") :]) for e in events if e.startswith(b"data: {") and b'"finish_reason":"length"' in e]
    assert finish and finish[0]["timings"]["predicted_n"] == 5
    assert events[-2].startswith(b": meshnet-usage ") and events[-1] == b"data: [DONE]"
    prompt = whole["usage"]["prompt_tokens"]
    assert [(r.prompt_tokens, r.completion_tokens) for r in records] == [(prompt, 3), (prompt, 5)]


async def test_a_client_that_leaves_after_three_events_pays_for_its_prompt(llama: LlamaChild) -> None:
    body = {"prompt": LONG_PROMPT, "max_tokens": LONG_ANSWER_TOKENS, "stream": True, "ignore_eos": True}
    async with serve_front(llama.url) as front:
        async with httpx.AsyncClient(base_url=front.url, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                seen = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                    if seen == 3:
                        break  # and close the connection
        [record] = await wait_records(front.sink, 1)
    assert record.prompt_tokens == tokenize(llama, LONG_PROMPT) >= 1500
    assert record.completion_tokens >= 3 and record.finish_reason == "cancelled" and record.status == 499


async def test_a_cancelled_whole_answer_is_billed_for_what_llama_server_generated(llama: LlamaChild) -> None:
    # The client leaves once llama-server is working on the answer (asked of llama-server, not guessed from a
    # clock: a fast CPU writes a short answer before any fixed timeout fires). The answer is long enough to be
    # still in the making then on any machine, and fits one slot's context (500 + 1,500 of 4,096 / 2).
    prompt, max_tokens = LONG_PROMPT[:500], 1500
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    async with serve_front(llama.url) as front:
        async with httpx.AsyncClient(base_url=front.url, timeout=30) as client, anyio.create_task_group() as tg:
            answered: list[httpx.Response] = []

            async def ask() -> None:
                answered.append(await client.post("/v1/completions", json=body))

            tg.start_soon(ask)
            await wait_until_generating(llama)
            tg.cancel_scope.cancel()  # and so the connection closes, mid-answer
        assert not answered, "the answer came before the client left: it was not cancelled"
        [record] = await wait_records(front.sink, 1, timeout=60)
    # llama-server does not stop a whole answer when its client leaves; every token it made is billed.
    assert (record.prompt_tokens, record.completion_tokens) == (tokenize(llama, prompt), max_tokens)
    assert (record.status, record.finish_reason) == (499, "cancelled")


async def wait_until_generating(llama: LlamaChild, within_s: float = 30.0) -> None:
    """Until one of llama-server's slots has a task (its /slots)."""
    async with httpx.AsyncClient(base_url=llama.url, headers={"authorization": f"Bearer {LLAMA_KEY}"}, timeout=5) as http:
        with anyio.fail_after(within_s):
            while True:
                slots = (await http.get("/slots")).json()
                if any(slot.get("is_processing") for slot in slots):
                    return
                await anyio.sleep(0.005)


async def test_chat_prompt_count_matches_llama_servers_usage(llama: LlamaChild) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    cases = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi " * 40}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}]},
        {"messages": [{"role": "user", "content": "call f"}], "tools": tools},
    ]
    async with serve_front(llama.url) as front, httpx.AsyncClient(base_url=front.url, timeout=30) as client:
        for i, case in enumerate(cases):
            answer = await client.post("/v1/chat/completions", json={**case, "max_tokens": 2}, headers={"x-request-id": f"case-{i}"})
            assert answer.status_code == 200, answer.text
            usage = answer.json()["usage"]
            # The count the node made before forwarding is the one llama-server reports after.
            counted = await front.app._counter._count_prompt(front.target(), "/v1/chat/completions", case, json.dumps(case).encode())  # type: ignore[arg-type]
            assert counted == usage["prompt_tokens"], case


def counts_landing(app: Any, expected: int) -> anyio.Event:
    """Set once the proxy's prompt counter has answered `expected` counts (it is wrapped to tell)."""
    landed = anyio.Event()
    answered = 0
    count = app._counter.count

    async def counting(*args: Any) -> int:
        nonlocal answered
        tokens = await count(*args)
        answered += 1
        if answered >= expected:
            landed.set()
        return tokens

    app._counter.count = counting
    return landed


async def test_llama_server_killed_mid_stream_ends_every_stream_with_an_error_and_bills_it(
    real_llama: BinaryInfo, long_context_gguf: Path, tmp_path: Path
) -> None:
    """kill -9 of llama-server under two streams, KILLS times: each stream ends with an error event
    within a second, and each record carries the real prompt and the partial completion."""
    figures: list[float] = []
    for round_ in range(KILLS):
        child = LlamaChild(real_llama, long_context_gguf, slots=2, ctx_size=2 * LONG_SLOT_TOKENS)
        try:
            async with serve_front(child.url) as front, httpx.AsyncClient(base_url=front.url, timeout=30) as client:
                body = {"prompt": LONG_PROMPT, "max_tokens": LONG_ANSWER_TOKENS, "stream": True, "ignore_eos": True}
                ends: list[tuple[float, bytes]] = []
                going = [anyio.Event(), anyio.Event()]
                counted = counts_landing(front.app, 2)

                async def stream(k: int) -> None:
                    tail = b""
                    seen = 0
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        async for chunk in response.aiter_bytes():
                            tail = (tail + chunk)[-4096:]
                            seen += chunk.count(b'"text":')
                            if seen >= 10:
                                going[k].set()
                    ends.append((time.monotonic(), tail))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream, 0)
                    tg.start_soon(stream, 1)
                    with anyio.fail_after(30):
                        for event in going:
                            await event.wait()  # both streams are generating
                        # ...and the node has its prompts' counts, asked beside the streams once their first
                        # bytes were out. On a loaded machine llama-server can stream ten tokens before it
                        # answers a count; a kill before that would leave nothing that could count them.
                        await counted.wait()
                    killed_at = time.monotonic()
                    child.kill()
                records = await wait_records(front.sink, 2)
            assert len(ends) == 2
            for ended_at, tail in ends:
                figures.append(ended_at - killed_at)
                assert ended_at - killed_at <= ERROR_EVENT_WITHIN_S
                assert b'"llama-server stopped mid-answer"' in tail and tail.endswith(b"data: [DONE]\n\n")
            for record in records:
                assert record.finish_reason == "error" and record.prompt_tokens >= 1500
                assert 0 < record.completion_tokens < LONG_ANSWER_TOKENS
        finally:
            child.close()
    print(f"llama-server kill -9 x{KILLS}: error event after {max(figures) * 1000:.0f} ms at most")


@pytest.mark.slow
def test_a_node_whose_llama_server_is_killed_mid_stream_errors_at_once_and_is_ready_again_soon(  # type: ignore[no-untyped-def]
    real_llama, tiny_gguf, start_node, tmp_path
) -> None:
    """The whole node (supervisor included): kill -9 of its llama-server, KILLS times. Each stream
    ends with an error event within a second and the node is ready again within load time + 2 s."""
    import signal
    import threading

    # Each kill here is a first crash: after half a second up, llama-server counts as stable again
    # (the default 120 s would make kills in a row back off 1, 2, 4... s, the crash-loop guard).
    # DEBUG: llama-server's `model loaded` line (its own load time) is routine, logged at DEBUG.
    env = {"MESHNET_RESTART_STABLE_AFTER_S": "0.5", "MESHNET_MAX_QUICK_CRASHES": "100", "MESHNET_LOG_LEVEL": "DEBUG"}
    node = start_node("--gguf", str(tiny_gguf), "--parallel", "2", "--ctx-size", "4096", env=env)
    node.wait_ready()
    body = {"prompt": LONG_PROMPT[:500], "max_tokens": 1500, "stream": True, "ignore_eos": True}
    error_after: list[float] = []
    ready_after: list[float] = []
    load_s: list[float] = []
    for _ in range(KILLS):
        time.sleep(0.5)
        pid = node.llama_pid()
        assert pid is not None
        ends: list[tuple[float, bytes]] = []
        going = threading.Event()

        def stream() -> None:
            tail = b""
            with httpx.stream("POST", node.url + "/v1/completions", json=body, timeout=30) as response:
                for chunk in response.iter_bytes():
                    tail = (tail + chunk)[-4096:]
                    if tail.count(b'"text":') >= 5:
                        going.set()
            ends.append((time.monotonic(), tail))

        thread = threading.Thread(target=stream)
        thread.start()
        assert going.wait(20)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        thread.join(20)
        [(ended, tail)] = ends
        error_after.append(ended - killed)
        assert b"llama-server stopped mid-answer" in tail and tail.endswith(b"data: [DONE]\n\n")
        # Ready again: a new llama-server pid, healthy. Its own load time comes from its log.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            health = node.health()
            if health is not None and health.status_code == 200 and node.llama_pid() not in (None, pid):
                break
            time.sleep(0.02)
        ready_after.append(time.monotonic() - killed)
        load_s.append(_last_load_seconds(node.log_text()))
    worst = max(error_after)
    print(f"node llama-server kill -9 x{KILLS}: error event <= {worst * 1000:.0f} ms; ready again after "
          f"{min(ready_after):.2f}-{max(ready_after):.2f} s; minus load time: {max(r - l for r, l in zip(ready_after, load_s)):.2f} s at most")  # fmt: skip
    assert worst <= ERROR_EVENT_WITHIN_S
    for ready, load in zip(ready_after, load_s):
        assert ready <= load + READY_AGAIN_MARGIN_S, (ready, load)


def _last_load_seconds(log: str) -> float:
    """llama-server's own clock at `model loaded` (its lines start with minutes.seconds.millis.micros since start)."""
    import re

    stamps = re.findall(r"(\d+)\.(\d+)\.(\d+)\.(\d+) I srv  llama_server: model loaded", log)
    minutes, seconds, millis, _ = stamps[-1]
    return int(minutes) * 60 + int(seconds) + int(millis) / 1000
