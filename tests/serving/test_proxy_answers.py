"""Whole (non-streamed) answers through the proxy, in process: usage in headers, request ids,
llama-server's hop headers left behind, the other routes, and the official SDK unmodified."""

from __future__ import annotations

import openai
import pytest

from meshnet_gguf.contract.protocol import UsageRecord
from support.fake_upstream import ALIAS, CACHED_TOKENS, FakeAnswer, FakeLlamaUpstream, Scripted
from support.proxy_harness import BASE_URL, CHAT, CHAT_PROMPT_TOKENS, INTERNAL_KEY, MAX_BODY_BYTES, UPSTREAM_URL, build_proxy

pytestmark = pytest.mark.anyio

CHAT_PATH = "/v1/chat/completions"


async def test_whole_answers_carry_usage_headers_and_pass_the_body_unchanged() -> None:
    proxy = build_proxy()
    async with proxy.client() as client:
        response = await client.post(CHAT_PATH, json={**CHAT, "max_tokens": 3}, headers={"x-request-id": "mine-1"})
    assert response.status_code == 200
    assert response.content == b"".join(proxy.upstream.forwarded_answers()[0].chunks)
    assert response.headers["x-meshnet-usage-prompt-tokens"] == str(CHAT_PROMPT_TOKENS)
    assert response.headers["x-meshnet-usage-completion-tokens"] == "3"
    assert response.headers["x-meshnet-request-id"] == "mine-1"
    assert response.headers["content-length"] == str(len(response.content))
    # llama-server's hop headers describe its connection, not ours.
    for hop in ("server", "keep-alive", "access-control-allow-origin"):
        assert hop not in response.headers, hop
    (sent,) = proxy.upstream.forwarded()
    assert sent.url == UPSTREAM_URL + CHAT_PATH and sent.headers["authorization"] == f"Bearer {INTERNAL_KEY}"
    assert sent.json() == {**CHAT, "max_tokens": 3}  # a whole answer's body goes as the client sent it
    (record,) = proxy.sink.records
    assert (record.request_id, record.route, record.model, record.status, record.stream) == ("mine-1", CHAT_PATH, ALIAS, 200, False)
    assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (CHAT_PROMPT_TOKENS, CACHED_TOKENS, 3)
    assert record.finish_reason == "length" and record.decode_tokens_per_s == 1000.0


async def test_request_ids_are_the_clients_when_sane_and_fresh_otherwise() -> None:
    proxy = build_proxy()
    async with proxy.client() as client:
        given = await client.post(CHAT_PATH, json=CHAT, headers={"x-request-id": "trace:abc/1=2"})
        spaced = await client.post(CHAT_PATH, json=CHAT, headers={"x-request-id": "has spaces\tand tabs"})
        long = await client.post(CHAT_PATH, json=CHAT, headers={"x-request-id": "a" * 129})
        none = await client.post(CHAT_PATH, json=CHAT)
        refused = await client.post(CHAT_PATH, content=b"{nope", headers={"x-request-id": "bad-body-1", "content-type": "application/json"})
    assert given.headers["x-meshnet-request-id"] == "trace:abc/1=2"
    fresh = [r.headers["x-meshnet-request-id"] for r in (spaced, long, none)]
    assert all(rid.startswith("req-") for rid in fresh) and len(set(fresh)) == 3
    assert refused.headers["x-meshnet-request-id"] == "bad-body-1"  # an error names the request too
    assert [r.request_id for r in proxy.sink.records] == ["trace:abc/1=2", *fresh]


async def test_the_openai_sdk_works_unmodified_on_every_route() -> None:
    proxy = build_proxy()
    async with openai.AsyncOpenAI(base_url=BASE_URL + "/v1", api_key="unused", http_client=proxy.client()) as client:
        raw = await client.chat.completions.with_raw_response.create(model=ALIAS, messages=CHAT["messages"], max_tokens=3)
        assert raw.headers["x-meshnet-usage-completion-tokens"] == "3"
        answer = raw.parse()
        assert answer.choices[0].message.content == "xxx" and answer.usage is not None
        assert (await client.completions.create(model=ALIAS, prompt="hi", max_tokens=2)).choices[0].text == "xx"
        assert (await client.embeddings.create(model=ALIAS, input="hi")).data[0].embedding == [0.1, 0.2]
        assert [m.id async for m in client.models.list()] == [ALIAS]
        with pytest.raises(openai.APIStatusError) as refused:
            huge = [{"role": "user", "content": "x" * MAX_BODY_BYTES}]
            await client.chat.completions.create(model=ALIAS, messages=huge, max_tokens=3)
    assert refused.value.status_code == 413 and "exceeds" in refused.value.message
    assert [(r.route, r.completion_tokens) for r in proxy.sink.records] == [
        (CHAT_PATH, 3), ("/v1/completions", 2), ("/v1/embeddings", 0)
    ]  # fmt: skip
    assert proxy.sink.records[-1].prompt_tokens == len("hi") and proxy.sink.records[-1].finish_reason == "stop"


async def test_a_broken_answer_from_llama_server_is_a_502_and_counts_as_an_error() -> None:
    broken = FakeAnswer(200, [b'{"choices":'], break_after=1)
    proxy = build_proxy(upstream=FakeLlamaUpstream(Scripted([broken])))
    async with proxy.client() as client:
        response = await client.post(CHAT_PATH, json=CHAT)
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_failed"
    assert proxy.slots.in_flight == 0 and broken.closed
    (record,) = proxy.sink.records
    assert (record.status, record.finish_reason) == (502, "error")


async def test_one_broken_usage_sink_does_not_take_the_request_or_the_other_sinks_down() -> None:
    class Broken:
        async def record(self, usage: UsageRecord) -> None:
            raise RuntimeError("disk full")

    proxy = build_proxy(extra_sinks=(Broken(),))
    async with proxy.client() as client:
        response = await client.post(CHAT_PATH, json=CHAT)
    assert response.status_code == 200
    assert len(proxy.sink.records) == 1


async def test_metrics_and_health_are_served_without_reaching_llama_server() -> None:
    async def metrics() -> tuple[int, bytes, str]:
        return 200, b"meshnet_up 1\n", "text/plain; version=0.0.4"

    proxy = build_proxy(metrics=metrics)
    async with proxy.client() as client:
        scraped = await client.get("/metrics")
        posted = await client.post("/metrics")
        health = await client.get("/health")
        head = await client.head("/health")
    assert scraped.status_code == 200 and scraped.text == "meshnet_up 1\n"
    assert scraped.headers["content-type"] == "text/plain; version=0.0.4"
    assert posted.status_code == 405 and posted.json()["error"]["code"] == "method_not_allowed"
    assert health.status_code == 200 and health.json()["state"] == "ready" and health.json()["model"] == ALIAS
    assert health.headers["cache-control"] == "no-cache"
    assert head.status_code == 200
    assert proxy.upstream.requests == []


# llama-server b10434's answer to /v1/embeddings when started without --embeddings (recorded).
LLAMA_NO_EMBEDDINGS = (
    b'{"error":{"code":501,"message":"This server does not support embeddings. Start it with `--embeddings`","type":"not_supported_error"}}'
)


async def test_embeddings_turned_off_tell_the_client_the_nodes_flag_not_llama_servers() -> None:
    off = FakeAnswer(501, [LLAMA_NO_EMBEDDINGS])
    other = FakeAnswer(501, [b'{"error":{"code":501,"message":"not today","type":"not_supported_error"}}'])
    proxy = build_proxy(upstream=FakeLlamaUpstream(Scripted([off, other])))
    # No retries: the SDK retries a 5xx, and each answer here is scripted once.
    async with openai.AsyncOpenAI(base_url=BASE_URL + "/v1", api_key="unused", http_client=proxy.client(), max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.embeddings.create(model=ALIAS, input="hi")
        with pytest.raises(openai.APIStatusError) as unrelated:
            await client.embeddings.create(model=ALIAS, input="hi")
    assert refused.value.status_code == 501
    assert "--llama-arg=--embeddings" in refused.value.message and "Start it with" not in refused.value.message
    assert refused.value.response.headers["content-length"] == str(len(refused.value.response.content))
    # Only that one hint is rewritten: llama-server's other errors pass as it wrote them.
    assert unrelated.value.status_code == 501 and "not today" in unrelated.value.message
