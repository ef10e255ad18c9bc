"""Streamed answers through the proxy, in process: bytes pass unchanged and as they arrive, usage is
metered and shown only when asked, a client that hangs up frees everything, a dying upstream ends
the stream with an error event."""

from __future__ import annotations

import json

import anyio
import openai
import pytest

from meshnet_gguf.contract.protocol import USAGE_COMMENT_PREFIX
from support.fake_upstream import ALIAS, CACHED_TOKENS, FakeAnswer, FakeLlamaUpstream, Scripted, llama_answer, stream_events
from support.proxy_harness import BASE_URL, CHAT, CHAT_PROMPT_TOKENS, build_proxy

pytestmark = pytest.mark.anyio

CHAT_PATH = "/v1/chat/completions"
STREAM = {**CHAT, "stream": True}
USAGE_MARK = b": " + USAGE_COMMENT_PREFIX.encode()


def split_usage_comment(body: bytes) -> tuple[bytes, dict, bytes]:
    """(the bytes before the usage comment, the comment's JSON, the bytes after it)."""
    head, found, tail = body.partition(USAGE_MARK)
    assert found, f"no usage comment in {body[-300:]!r}"
    line, _, rest = tail.partition(b"\n\n")
    return head, json.loads(line), rest


def stream_answer(events: list[bytes], **kwargs) -> FakeAnswer:  # type: ignore[no-untyped-def]
    return FakeAnswer(200, events, content_type="text/event-stream", **kwargs)


async def test_stream_bytes_pass_through_unchanged_plus_one_usage_comment() -> None:
    events = stream_events(5, usage=True, ping_every=2, prompt_tokens=CHAT_PROMPT_TOKENS)
    # As a socket delivers them: whole events, several in one read, and events cut mid-way.
    raw = b"".join(events)
    chunks = [events[0], events[1] + events[2], raw[len(b"".join(events[:3])) : -40], raw[-40:-7], raw[-7:]]
    assert b"".join(chunks) == raw
    proxy = build_proxy(upstream=FakeLlamaUpstream(Scripted([stream_answer(chunks)])))
    body = {**STREAM, "stream_options": {"include_usage": True}}
    async with proxy.client() as client:
        via = await client.post(CHAT_PATH, json=body, headers={"x-request-id": "abc-123"})
    assert via.status_code == 200
    assert via.headers["content-type"].startswith("text/event-stream")
    assert via.headers["cache-control"] == "no-cache"
    assert via.headers["x-accel-buffering"] == "no"
    assert "content-encoding" not in via.headers and "content-length" not in via.headers
    assert via.headers["x-meshnet-request-id"] == "abc-123"
    head, usage, rest = split_usage_comment(via.content)
    assert head + rest == raw  # everything else byte-identical, keep-alive pings included
    assert b": ping\n\n" in head
    assert rest == b"data: [DONE]\n\n"
    assert usage == {"request_id": "abc-123", "prompt_tokens": CHAT_PROMPT_TOKENS, "cached_tokens": CACHED_TOKENS,
                     "completion_tokens": 5, "finish_reason": "length"}  # fmt: skip
    (record,) = proxy.sink.records
    assert (record.request_id, record.status, record.stream, record.completion_tokens) == ("abc-123", 200, True, 5)
    assert record.ttft_s is not None and record.decode_tokens_per_s == 1000.0


async def test_each_event_reaches_the_client_while_llama_server_is_still_generating() -> None:
    answer = stream_answer(stream_events(6), hold_before=3)
    proxy = build_proxy(upstream=FakeLlamaUpstream(Scripted([answer])))
    async with proxy.exchange("POST", CHAT_PATH, json_body=STREAM) as exchange:
        with pytest.raises(TimeoutError):
            await exchange.wait_until(lambda: exchange.complete, timeout=0.3)
        assert answer.held.is_set() and not exchange.complete
        # The role delta and two tokens, sent before llama-server paused, are already out.
        assert exchange.status == 200 and exchange.body == b"".join(answer.chunks[:3])
        answer.release()
        body = await exchange.read_to_end()
    assert body.count(b'"content":"x"') == 6


async def test_the_client_gets_the_stream_it_asked_for_and_is_metered_either_way() -> None:
    proxy = build_proxy()
    async with proxy.client() as client:
        sent_plain = json.dumps(STREAM).encode()
        plain = (await client.post(CHAT_PATH, content=sent_plain, headers={"content-type": "application/json"})).content
        sent = json.dumps({**STREAM, "stream_options": {"include_usage": True}}).encode()
        asked = (await client.post(CHAT_PATH, content=sent, headers={"content-type": "application/json"})).content
    first, second = proxy.upstream.forwarded()
    # Forwarded byte for byte: the node adds nothing to the client's request, so llama-server
    # answers exactly what the client would get from it directly (timings included).
    assert first.body == sent_plain and second.body == sent
    assert b'"choices":[]' not in plain
    assert b'"choices":[]' in asked and b'"usage"' in asked
    for body in (plain, asked):
        _, usage, rest = split_usage_comment(body)
        assert usage["completion_tokens"] == 5 and rest == b"data: [DONE]\n\n"
    assert [r.completion_tokens for r in proxy.sink.records] == [5, 5]
    # The prompt is counted by llama-server's own tokenizer before generation, so both bill it.
    assert all(r.prompt_tokens > 0 for r in proxy.sink.records)


async def test_the_openai_sdk_streams_through_the_usage_comment_unaware() -> None:
    proxy = build_proxy()
    async with openai.AsyncOpenAI(base_url=BASE_URL + "/v1", api_key="unused", http_client=proxy.client()) as client:
        stream = await client.chat.completions.create(model=ALIAS, messages=CHAT["messages"], max_tokens=5, stream=True)
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "xxxxx"
        assert all(c.usage is None for c in chunks)
        stream = await client.chat.completions.create(
            model=ALIAS, messages=CHAT["messages"], max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
        with_usage = [chunk async for chunk in stream]
        assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 4
        stream = await client.completions.create(model=ALIAS, prompt="hi", max_tokens=3, stream=True)
        assert "".join([c.choices[0].text async for c in stream if c.choices]) == "xxx"


async def test_a_client_hanging_up_frees_the_slot_and_closes_the_upstream_answer() -> None:
    answer = stream_answer(stream_events(8), hold_before=4)
    proxy = build_proxy(slots=1, upstream=FakeLlamaUpstream(Scripted([answer])))
    async with proxy.exchange("POST", CHAT_PATH, json_body=STREAM) as exchange:
        await exchange.wait_until(lambda: answer.held.is_set() and exchange.body.count(b'"content":"x"') == 3)
        assert proxy.slots.in_flight == 1 and not answer.closed
        exchange.hang_up()
        await exchange.app_done.wait()
    # Closing the upstream answer is what tells llama-server to stop generating.
    assert answer.closed and answer.delivered == 4
    assert proxy.slots.in_flight == 0
    (record,) = proxy.sink.records
    assert record.finish_reason == "cancelled" and record.completion_tokens == 3
    async with proxy.client() as client:
        assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 200


async def test_every_upstream_answer_is_closed_whatever_its_end() -> None:
    proxy = build_proxy()
    async with proxy.client() as client:
        await client.post(CHAT_PATH, json=STREAM)
        await client.post(CHAT_PATH, json=CHAT)
        await client.get("/v1/models")
    assert len(proxy.upstream.forwarded_answers()) == 2 and all(a.closed for a in proxy.upstream.answers)


@pytest.mark.parametrize("ending", ["connection breaks", "stream stops without [DONE]"])
async def test_llama_server_dying_mid_stream_ends_the_client_stream_with_an_error_event(ending: str) -> None:
    events = stream_events(10)
    answer = stream_answer(events[:4], break_after=4) if ending == "connection breaks" else stream_answer(events[:4])
    proxy = build_proxy(upstream=FakeLlamaUpstream(Scripted([answer])))
    async with proxy.client() as client:
        response = await client.post(CHAT_PATH, json=STREAM, headers={"x-request-id": "dies-1"})
    assert response.status_code == 200  # the head went out with the first event
    body = response.content
    assert body.startswith(b"".join(events[:4]))
    tail = [e for e in body[len(b"".join(events[:4])) :].split(b"\n\n") if e]
    assert len(tail) == 3 and tail[-1] == b"data: [DONE]"
    error = json.loads(tail[0].removeprefix(b"data: "))
    assert error["error"]["type"] == "server_error" and "mid-answer" in error["error"]["message"]
    assert tail[1].startswith(USAGE_MARK)
    usage = json.loads(tail[1].removeprefix(USAGE_MARK))
    # The role delta is not a token; three content events are three tokens, counted without a usage chunk.
    assert (usage["request_id"], usage["completion_tokens"], usage["finish_reason"]) == ("dies-1", 3, "error")
    assert proxy.slots.in_flight == 0 and answer.closed
    (record,) = proxy.sink.records
    assert (record.finish_reason, record.completion_tokens) == ("error", 3)


async def test_a_cut_short_stream_counts_only_events_that_carry_a_token() -> None:
    head = b'data: {"choices":[{"index":0,'
    events = [
        head + b'"delta":{"role":"assistant","content":null}}]}\n\n',
        head + b'"delta":{"content":"x"}}]}\n\n',
        head + b'"delta":{"content":""}}]}\n\n',
        head + b'"delta":{"tool_calls":[{"index":0}]}}]}\n\n',
        head + b'"text":"ab","finish_reason":null}]}\n\n',
        head + b'"text":"","finish_reason":null}]}\n\n',
        head + b'"delta":{},"finish_reason":"length"}]}\n\n',
    ]
    proxy = build_proxy(upstream=FakeLlamaUpstream(Scripted([stream_answer(events)])))
    async with proxy.client() as client:
        body = (await client.post(CHAT_PATH, json=STREAM)).content
    _, usage, _ = split_usage_comment(body)
    assert usage["completion_tokens"] == 3  # "x", the tool call, "ab"


async def test_an_error_answer_from_llama_server_passes_through_as_it_is() -> None:
    refusal = {"error": {"code": 400, "message": "the request exceeds the available context size", "type": "exceed_context_size_error"}}
    answer = FakeAnswer(400, [json.dumps(refusal).encode()])
    proxy = build_proxy(upstream=FakeLlamaUpstream(Scripted([answer])))
    async with proxy.client() as client:
        response = await client.post(CHAT_PATH, json=STREAM)
    assert response.status_code == 400 and response.json() == refusal
    assert response.headers["content-type"] == "application/json"
    (record,) = proxy.sink.records
    assert (record.status, record.finish_reason) == (400, "error")


COUNTING_PATHS = {"/apply-template", "/tokenize"}


async def test_a_whole_answer_is_billed_from_llama_servers_own_usage_without_counting_again() -> None:
    proxy = build_proxy()
    async with proxy.client() as client:
        whole = (await client.post(CHAT_PATH, json=CHAT)).json()
    assert [r.path for r in proxy.upstream.requests if r.path in COUNTING_PATHS] == []
    assert whole["usage"]["prompt_tokens"] == CHAT_PROMPT_TOKENS
    assert [r.prompt_tokens for r in proxy.sink.records] == [CHAT_PROMPT_TOKENS]


async def test_a_standalone_node_counts_the_prompt_beside_the_generation_not_before_it() -> None:
    # llama-server's template answer is held: the first token must still reach the client,
    # because a node with no ledger row to fill does not wait for the count to forward.
    # The generation is held after its first token too, so the stream is still going when the count starts.
    counting: list[FakeAnswer] = []
    generating: list[FakeAnswer] = []

    def respond(request):  # type: ignore[no-untyped-def]
        answer = llama_answer(request)
        if request.path == "/apply-template":
            answer.hold_before = 0
            counting.append(answer)
        elif request.path == CHAT_PATH:
            answer.hold_before = 2  # the role delta and the first token go out
            generating.append(answer)
        return answer

    proxy = build_proxy(upstream=FakeLlamaUpstream(respond))
    async with proxy.exchange("POST", CHAT_PATH, json_body=STREAM) as exchange:
        await exchange.wait_until(lambda: b'"content":"x"' in exchange.body)
        # The count starts once the answer's first bytes are out, and is still waiting on llama-server.
        with anyio.fail_after(5):
            while not (counting and counting[0].held.is_set()):
                await anyio.sleep(0.01)
        counting[0].release()
        generating[0].release()
        body = await exchange.read_to_end()
    _, usage, _ = split_usage_comment(body)
    assert usage["completion_tokens"] == 5
    [record] = proxy.sink.records
    assert record.prompt_tokens == CHAT_PROMPT_TOKENS  # billed all the same


async def test_a_stream_cut_short_bills_the_prompt_counted_beside_it() -> None:
    answer = stream_answer(stream_events(8), hold_before=4)
    proxy = build_proxy(upstream=FakeLlamaUpstream(Scripted([answer])))
    async with proxy.exchange("POST", CHAT_PATH, json_body=STREAM) as exchange:
        await exchange.wait_until(lambda: answer.held.is_set() and exchange.body.count(b'"content":"x"') == 3)
        exchange.hang_up()
        await exchange.app_done.wait()
    assert [r.path for r in proxy.upstream.requests if r.path in COUNTING_PATHS] == ["/apply-template", "/tokenize"]
    [record] = proxy.sink.records
    assert record.finish_reason == "cancelled" and record.prompt_tokens == CHAT_PROMPT_TOKENS


async def test_a_chat_llama_servers_template_cannot_read_is_a_400_not_its_500() -> None:
    # Counted once the generation answered 500, the template's 400 says why: the client
    # hears its own mistake, as it would from a node that counts first.
    def respond(request):  # type: ignore[no-untyped-def]
        if request.path == "/apply-template":
            return FakeAnswer(400, [b'{"error":{"code":400,"message":"unsupported tool shape"}}'])
        if request.path == CHAT_PATH:
            return FakeAnswer(500, [b'{"error":{"code":500,"message":"chat parser threw"}}'])
        return llama_answer(request)

    proxy = build_proxy(upstream=FakeLlamaUpstream(respond))
    async with proxy.client() as client:
        answer = await client.post(CHAT_PATH, json={**CHAT, "stream": False})
    assert answer.status_code == 400
    assert "unsupported tool shape" in answer.json()["error"]["message"]
    [record] = proxy.sink.records
    assert record.prompt_tokens == 0 and record.finish_reason == "error"
