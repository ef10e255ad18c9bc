"""One answer shape, two clients: the lean client's response and httpx's adapted one (`common/httpx_answer`)
read the same server the same way, and fail the same way (real loopback servers, no mocks)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from meshnet_gguf.common.http1_client import Http1Client, HttpAnswer, HttpClientError, HttpConnectError
from meshnet_gguf.common.httpx_answer import send_through_httpx
from meshnet_gguf.common.ports import free_local_port

pytestmark = pytest.mark.anyio
PEER = "test server"
BODY = b"data: one\n\ndata: two\n\n"
# An answer whose head promises more than the server sends before it hangs up.
CUT_SHORT = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 100\r\n\r\nonly ten b"
WHOLE = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-kept: yes\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)

Send = Callable[[str], Awaitable[HttpAnswer]]


@asynccontextmanager
async def raw_server(answer: bytes) -> AsyncIterator[str]:
    """A loopback server that reads a request head, writes `answer` and hangs up."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1/chat/completions"
    finally:
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def both_clients() -> AsyncIterator[dict[str, Send]]:
    lean = Http1Client(4, peer=PEER)
    async with httpx.AsyncClient(timeout=5) as http:

        async def via_lean(url: str) -> HttpAnswer:
            return await lean.send("POST", url, {"content-type": "application/json"}, b"{}")

        async def via_httpx(url: str) -> HttpAnswer:
            return await send_through_httpx(http, http.build_request("POST", url, content=b"{}"), peer=PEER)

        try:
            yield {"lean": via_lean, "httpx": via_httpx}
        finally:
            await lean.aclose()


async def test_both_clients_read_one_answer_alike() -> None:
    async with both_clients() as clients:
        for name, send in clients.items():
            async with raw_server(WHOLE) as url:
                answer = await send(url)
                try:
                    assert answer.status == 200, name
                    assert ("x-kept", "yes") in [(k.lower(), v) for k, v in answer.headers], name
                    assert await answer.read() == BODY, name
                finally:
                    await answer.aclose()


async def test_a_server_that_is_not_there_is_a_connect_error_from_both() -> None:
    url = f"http://127.0.0.1:{free_local_port()}/v1/chat/completions"
    async with both_clients() as clients:
        for send in clients.values():
            with pytest.raises(HttpConnectError, match=PEER):
                await send(url)


async def test_an_answer_cut_short_is_a_client_error_not_a_connect_error_from_both() -> None:
    async with both_clients() as clients:
        for name, send in clients.items():
            async with raw_server(CUT_SHORT) as url:
                answer = await send(url)
                try:
                    with pytest.raises(HttpClientError, match=PEER) as broke:
                        async for _ in answer.iter_chunks():
                            pass
                    # The request was delivered: another node must not be tried with it.
                    assert not isinstance(broke.value, HttpConnectError), name
                finally:
                    await answer.aclose()
