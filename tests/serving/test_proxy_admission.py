"""The proxy's admission, in process: what is refused, how, and that nothing refused reaches llama-server."""

from __future__ import annotations

import pytest

from support.fake_upstream import FakeLlamaUpstream, llama_answer
from support.proxy_harness import CHAT, INTERNAL_KEY, MAX_BODY_BYTES, RETRY_AFTER_S, Exchange, build_proxy

pytestmark = pytest.mark.anyio

CHAT_PATH = "/v1/chat/completions"
JSON = {"content-type": "application/json"}


def _error(response) -> dict:  # type: ignore[no-untyped-def]
    error = response.json()["error"]
    assert error["message"] and error["type"], error
    return error


async def test_bad_input_gets_a_clear_error_and_never_reaches_llama_server() -> None:
    proxy = build_proxy()
    async with proxy.client() as client:
        cases = {
            "declared too large": (413, await client.post(CHAT_PATH, content=b"{" + b" " * MAX_BODY_BYTES + b"}", headers=JSON)),
            "invalid json": (400, await client.post(CHAT_PATH, content=b"{nope", headers=JSON)),
            "not an object": (400, await client.post(CHAT_PATH, json=[1, 2])),
            "no messages": (400, await client.post(CHAT_PATH, json={"max_tokens": 3})),
            "no prompt": (400, await client.post("/v1/completions", json={"messages": []})),
            "no input": (400, await client.post("/v1/embeddings", json={"prompt": "x"})),
            "unknown route": (404, await client.post("/v1/nope", json=CHAT)),
            "wrong method": (405, await client.get(CHAT_PATH)),
            "wrong method on models": (405, await client.post("/v1/models", json={})),
        }
    for name, (status, response) in cases.items():
        assert response.status_code == status, (name, response.text)
        _error(response)
    assert cases["invalid json"][1].json()["error"]["code"] == "invalid_json"
    assert cases["no messages"][1].json()["error"]["code"] == "missing_field"
    assert proxy.upstream.requests == []
    assert proxy.sink.records == []  # refused requests used nothing and are billed nothing
    assert proxy.slots.in_flight == 0
    inference_refusals = [s for name, (s, _) in cases.items() if name not in ("unknown route", "wrong method", "wrong method on models")]
    assert [status for _, status in proxy.rejected] == inference_refusals


async def test_a_body_over_the_limit_without_a_content_length_is_refused_while_it_arrives() -> None:
    proxy = build_proxy()

    async def chunks():  # type: ignore[no-untyped-def]
        yield b'{"messages": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b"x" * 1024

    async with proxy.client() as client:
        response = await client.post(CHAT_PATH, content=chunks(), headers=JSON)
    assert response.status_code == 413 and _error(response)["code"] == "body_too_large"
    assert proxy.upstream.requests == []


async def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_read() -> None:
    proxy = build_proxy()
    # Only the head has arrived: a client about to send more than the node takes is told at once.
    declared = {"content-length": str(MAX_BODY_BYTES + 1)}
    async with proxy.exchange("POST", CHAT_PATH, body=b"{", headers=declared) as exchange:
        await exchange.read_to_end()
    assert exchange.status == 413 and b"body_too_large" in exchange.body
    assert str(MAX_BODY_BYTES + 1).encode() in exchange.body


async def test_the_api_key_guards_every_inference_route_and_models() -> None:
    proxy = build_proxy(api_key="sesame")
    async with proxy.client() as client:
        missing = await client.post(CHAT_PATH, json=CHAT)
        wrong = await client.post(CHAT_PATH, json=CHAT, headers={"authorization": "Bearer nope"})
        internal = await client.post(CHAT_PATH, json=CHAT, headers={"authorization": f"Bearer {INTERNAL_KEY}"})
        models = await client.get("/v1/models")
        health = await client.get("/health")  # health stays open: trackers and load balancers poll it
        assert proxy.upstream.requests == []
        ok = await client.post(CHAT_PATH, json=CHAT, headers={"authorization": "Bearer sesame"})
    for refused in (missing, wrong, internal, models):
        assert refused.status_code == 401 and _error(refused)["type"] == "authentication_error"
    assert health.status_code == 200
    assert ok.status_code == 200
    # llama-server gets its own internal key, never the client's.
    assert proxy.upstream.forwarded() and all(r.headers["authorization"] == f"Bearer {INTERNAL_KEY}" for r in proxy.upstream.requests)


async def test_every_slot_busy_answers_503_with_retry_after_at_once_and_the_slot_comes_back() -> None:
    upstream = FakeLlamaUpstream(lambda request: llama_answer(request, hold_before=2))
    proxy = build_proxy(slots=1, upstream=upstream)
    async with proxy.exchange("POST", CHAT_PATH, json_body={**CHAT, "stream": True}) as first:
        await first.wait_until(lambda: b'"content":"x"' in first.body)
        assert proxy.slots.in_flight == 1
        async with proxy.client() as client:
            second = await client.post(CHAT_PATH, json=CHAT)
            health = (await client.get("/health")).json()
        assert second.status_code == 503
        assert second.headers["retry-after"] == str(RETRY_AFTER_S)
        assert "slots" in _error(second)["message"]
        assert health["slots_busy"] == 1
        assert len(upstream.forwarded()) == 1  # the refused one was never forwarded
        upstream.forwarded_answers()[0].release()
        assert (await first.read_to_end()).endswith(b"data: [DONE]\n\n")
    assert proxy.slots.in_flight == 0
    assert proxy.rejected == [(CHAT_PATH, 503)]
    async with proxy.client() as client:
        assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 200


async def test_a_slot_is_free_again_before_the_last_byte_of_an_answer_reaches_the_client() -> None:
    # A client that sends its next request the moment one ends must not be refused.
    proxy = build_proxy(slots=1)
    in_flight_at_last_byte: list[int] = []
    app = proxy.app

    async def watching_app(scope, receive, send):  # type: ignore[no-untyped-def]
        async def spy(message):  # type: ignore[no-untyped-def]
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                in_flight_at_last_byte.append(proxy.slots.in_flight)
            await send(message)

        await app(scope, receive, spy)

    for body in (CHAT, {**CHAT, "stream": True}):
        async with Exchange(watching_app, "POST", CHAT_PATH, json_body=body) as exchange:
            await exchange.read_to_end()
    assert in_flight_at_last_byte == [0, 0]


async def test_a_draining_node_refuses_new_requests_with_retry_after() -> None:
    proxy = build_proxy()
    proxy.slots.draining = True
    async with proxy.client() as client:
        refused = await client.post(CHAT_PATH, json=CHAT)
        health = await client.get("/health")
    assert refused.status_code == 503 and refused.headers["retry-after"] == str(RETRY_AFTER_S)
    assert "draining" in _error(refused)["message"]
    assert health.status_code == 503 and health.json()["state"] == "draining" and health.headers["retry-after"]
    assert proxy.upstream.requests == []


async def test_a_loading_node_answers_503_and_health_says_why() -> None:
    proxy = build_proxy()
    proxy.state = "loading"
    async with proxy.client() as client:
        health = await client.get("/health")
        chat = await client.post(CHAT_PATH, json=CHAT)
        models = await client.get("/v1/models")
        proxy.state = "ready"
        ready = await client.get("/health")
    assert health.status_code == 503 and health.headers["retry-after"] == str(RETRY_AFTER_S)
    assert health.json()["state"] == "loading"
    for refused in (chat, models):
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert "not ready" in _error(refused)["message"] and "loading" in _error(refused)["message"]
    assert proxy.upstream.requests == []
    assert ready.status_code == 200 and "retry-after" not in ready.headers


async def test_llama_server_not_answering_is_a_503_with_retry_after_and_frees_the_slot() -> None:
    proxy = build_proxy()
    proxy.upstream.unreachable = True
    async with proxy.client() as client:
        whole = await client.post(CHAT_PATH, json=CHAT)
        streamed = await client.post(CHAT_PATH, json={**CHAT, "stream": True})
        models = await client.get("/v1/models")
    for response in (whole, streamed, models):
        assert response.status_code == 503 and response.headers["retry-after"] == str(RETRY_AFTER_S)
        assert "not answer" in _error(response)["message"]
    assert proxy.slots.in_flight == 0
