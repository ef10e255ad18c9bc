"""The proxy with each real upstream client (aiohttp, httpx) over loopback to the fake llama-server
process: what the in-process fake cannot show is how a real socket delivers, breaks and closes."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.contract.protocol import USAGE_COMMENT_PREFIX
from meshnet_gguf.llama.upstream.choice import make_upstream_client
from support.proxy_harness import CHAT, INTERNAL_KEY, build_proxy

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("client_kind", ["aiohttp", "httpx"])]

CHAT_PATH = "/v1/chat/completions"
STARTUP_TIMEOUT_S = 10.0
# How soon llama-server must see a gone client's slot free: it stops at its next token write.
SLOT_FREED_WITHIN_S = 2.0
USAGE_MARK = b": " + USAGE_COMMENT_PREFIX.encode()


@pytest.fixture
def fake_llama(fake_llama_path: Path) -> Iterator[Callable[..., str]]:
    """Start the fake llama-server process (with the internal key) steered by FAKE_LLAMA_* settings; returns its URL."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str, **fake_env: str) -> str:
        port = free_local_port()
        env = {**os.environ, "LLAMA_API_KEY": INTERNAL_KEY, **fake_env}
        argv = [str(fake_llama_path), "--port", str(port), "--alias", "tiny", *args]
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    return url
            except httpx.HTTPError:
                time.sleep(0.02)
        raise AssertionError("the fake llama-server did not start")

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=5)


async def test_stream_bytes_arrive_unchanged_through_a_real_client(client_kind: str, fake_llama) -> None:  # type: ignore[no-untyped-def]
    url = fake_llama(FAKE_LLAMA_PING_EVERY="2", FAKE_LLAMA_TOKENS="6")
    body = {**CHAT, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    auth = {"authorization": f"Bearer {INTERNAL_KEY}"}
    direct = httpx.post(url + CHAT_PATH, json=body, headers=auth).content
    client = make_upstream_client(client_kind, 2)
    try:
        proxy = build_proxy(real_client=client, upstream_url=url)
        async with proxy.client() as http:
            via = await http.post(CHAT_PATH, json=body)
            whole = await http.post(CHAT_PATH, json={**CHAT, "max_tokens": 3})
            models = await http.get("/v1/models")
    finally:
        await client.aclose()
    head, _, tail = via.content.partition(USAGE_MARK)
    usage, _, rest = tail.partition(b"\n\n")
    assert head + rest == direct and b": ping\n\n" in head
    assert json.loads(usage)["completion_tokens"] == 6
    assert whole.status_code == 200 and whole.headers["x-meshnet-usage-completion-tokens"] == "3"
    assert models.json()["data"][0]["id"] == "tiny"


async def test_llama_server_dying_mid_stream_ends_the_stream_with_an_error_event(client_kind: str, fake_llama) -> None:  # type: ignore[no-untyped-def]
    url = fake_llama(FAKE_LLAMA_DIE_AFTER="3", FAKE_LLAMA_TOKEN_DELAY_S="0.05", FAKE_LLAMA_TOKENS="50")
    client = make_upstream_client(client_kind, 2)
    try:
        proxy = build_proxy(real_client=client, upstream_url=url)
        async with proxy.client() as http:
            started = time.monotonic()
            body = (await http.post(CHAT_PATH, json={**CHAT, "max_tokens": 50, "stream": True})).content
            took = time.monotonic() - started
    finally:
        await client.aclose()
    assert took < 1.5  # three 50 ms tokens, then the end as soon as the socket closes
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and events[-3].startswith(b'data: {"error"')
    usage = json.loads(events[-2].removeprefix(USAGE_MARK))
    assert (usage["completion_tokens"], usage["finish_reason"]) == (3, "error")
    assert proxy.slots.in_flight == 0


async def test_a_client_hanging_up_frees_the_llama_server_slot_at_once(client_kind: str, fake_llama) -> None:  # type: ignore[no-untyped-def]
    url = fake_llama("--parallel", "1", FAKE_LLAMA_TOKEN_DELAY_S="0.05", FAKE_LLAMA_TOKENS="200")
    slots_url, auth = url + "/slots", {"authorization": f"Bearer {INTERNAL_KEY}"}
    client = make_upstream_client(client_kind, 1)
    try:
        proxy = build_proxy(slots=1, real_client=client, upstream_url=url)
        async with proxy.exchange("POST", CHAT_PATH, json_body={**CHAT, "max_tokens": 200, "stream": True}) as exchange:
            await exchange.wait_until(lambda: exchange.body.count(b'"content":"x"') >= 3)
            async with httpx.AsyncClient() as probe:
                assert any(s["is_processing"] for s in (await probe.get(slots_url, headers=auth)).json())
                exchange.hang_up()
                await exchange.app_done.wait()
                hung_up_at = time.monotonic()
                while any(s["is_processing"] for s in (await probe.get(slots_url, headers=auth)).json()):
                    assert time.monotonic() - hung_up_at < SLOT_FREED_WITHIN_S, "llama-server kept generating for a gone client"
                    await anyio.sleep(0.02)
    finally:
        await client.aclose()
    assert proxy.slots.in_flight == 0
    (record,) = proxy.sink.records
    assert record.finish_reason == "cancelled" and 3 <= record.completion_tokens < 200
