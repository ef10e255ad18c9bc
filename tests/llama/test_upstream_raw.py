"""The raw hop client (asyncio protocol + httptools) against small servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from meshnet_gguf.llama.upstream import UpstreamError
from meshnet_gguf.common import http1_client as raw_upstream
from meshnet_gguf.common.http1_client import unix_socket_url
from meshnet_gguf.llama.upstream.raw import RawUpstream

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Server:
    """A UNIX-socket HTTP server whose answer to each request is scripted by `handler`."""

    def __init__(self, path: Path, handler) -> None:  # type: ignore[no-untyped-def]
        self.path, self.handler = path, handler
        self.connections = 0

    async def __aenter__(self) -> Server:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next((int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")), 0)
                    body = await reader.readexactly(length)
                    if not await self.handler(head, body, writer):
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()

        self.server = await asyncio.start_unix_server(serve, str(self.path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    @property
    def url(self) -> str:
        return unix_socket_url(str(self.path))


async def ok_json(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
    answer = b'{"ok":true,"echo":%d}' % len(body)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
    await writer.drain()
    return True


async def test_answers_of_known_length_reuse_one_connection(tmp_path: Path) -> None:
    async with Server(tmp_path / "s.sock", ok_json) as server:
        client = RawUpstream(2)
        for _ in range(5):
            response = await client.send("POST", server.url + "/v1/x", {"content-type": "application/json"}, b"{}")
            assert response.status == 200 and await response.read() == b'{"ok":true,"echo":2}'
            await response.aclose()
        assert server.connections == 1
        await client.aclose()


async def test_a_streamed_answer_arrives_whole_and_its_connection_is_not_reused(tmp_path: Path) -> None:
    events = [b"data: %d\n\n" % i for i in range(50)]

    async def stream(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True  # announces keep-alive, as llama-server does, then is closed by it

    async with Server(tmp_path / "s.sock", stream) as server:
        client = RawUpstream(2)
        for _ in range(2):
            response = await client.send("POST", server.url + "/v1/chat/completions", {}, b"{}")
            assert b"".join([c async for c in response.iter_chunks()]) == b"".join(events)
            await response.aclose()
        assert server.connections == 2
        await client.aclose()


async def test_with_keep_streamed_a_streamed_answer_keeps_its_connection(tmp_path: Path) -> None:
    async def stream(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        await writer.drain()
        return True  # a server that keeps it, as the node's uvicorn does

    async with Server(tmp_path / "s.sock", stream) as server:
        client = raw_upstream.Http1Client(2, keep_streamed=True)
        for _ in range(3):
            response = await client.send("POST", server.url + "/v1/chat/completions", {}, b"{}")
            assert await response.read() == b"hello"
            await response.aclose()
        assert server.connections == 1 and client.opened == 1
        await client.aclose()


async def test_bytes_sent_on_an_idle_connection_never_answer_the_next_request(tmp_path: Path) -> None:
    """A server (or whoever sits on the wire) that writes a forged answer ahead of the next request:
    a pooled connection that receives bytes unasked is dropped, and the request goes out on a new one."""
    requests = 0

    async def answer_then_forge(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        nonlocal requests
        requests += 1
        await ok_json(head, body, writer)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged")
        await writer.drain()
        return True

    async with Server(tmp_path / "s.sock", answer_then_forge) as server:
        client = RawUpstream(2)
        for _ in range(3):
            response = await client.send("POST", server.url + "/v1/x", {}, b"{}")
            assert await response.read() == b'{"ok":true,"echo":2}'
            await response.aclose()
            await asyncio.sleep(0.05)  # the forged bytes arrive while the connection is pooled
        assert requests == 3 and server.connections == 3
        await client.aclose()


async def test_a_pooled_connection_closed_by_the_server_is_retried_on_a_fresh_one(tmp_path: Path) -> None:
    answered = 0

    async def once_per_connection(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        nonlocal answered
        answered += 1
        await ok_json(head, body, writer)
        return False  # close right after answering, though the answer said nothing of it

    async with Server(tmp_path / "s.sock", once_per_connection) as server:
        client = RawUpstream(2)
        for _ in range(3):
            response = await client.send("GET", server.url + "/health", {}, None)
            assert await response.read() == b'{"ok":true,"echo":0}'
            await response.aclose()
            await asyncio.sleep(0.05)  # the server's close arrives while the connection is pooled
        assert answered == 3
        await client.aclose()


async def test_silence_and_a_cut_answer_are_errors_not_hangs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(raw_upstream, "READ_IDLE_TIMEOUT_S", 0.3)

    async def silent(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(5)
        return False

    async def cut(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        return False

    async with Server(tmp_path / "silent.sock", silent) as server:
        client = RawUpstream(1)
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamError, match="sent nothing"):
            await client.send("GET", server.url + "/health", {}, None)
        assert asyncio.get_running_loop().time() - started < 2
        await client.aclose()
    async with Server(tmp_path / "cut.sock", cut) as server:
        client = RawUpstream(1)
        response = await client.send("GET", server.url + "/x", {}, None)
        with pytest.raises(UpstreamError, match="mid-answer"):
            await response.read()
        await response.aclose()
        await client.aclose()


async def test_nothing_listening_is_an_upstream_error(tmp_path: Path) -> None:
    with pytest.raises(UpstreamError, match="unreachable"):
        await RawUpstream(1).send("GET", unix_socket_url(str(tmp_path / "none.sock")) + "/health", {}, None)


async def test_a_header_cannot_smuggle_a_second_request(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="line break"):
        await RawUpstream(1).send("GET", "http://127.0.0.1:9/x", {"authorization": "Bearer k\r\nGET /slots"}, None)


@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True}), "asyncio"])
async def test_a_burst_beyond_the_sockets_accept_queue_is_served_not_refused(tmp_path: Path, anyio_backend) -> None:  # type: ignore[no-untyped-def]
    # llama-server's accept queue is short; a UNIX socket refuses the overflow at once (EAGAIN)
    # where TCP would queue it. 64 simultaneous requests against a queue of 1 must all succeed.
    path = tmp_path / "busy.sock"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await ok_json(b"", b"", writer)
        writer.close()

    server = await asyncio.start_unix_server(serve, str(path), backlog=1)
    client = RawUpstream(64)

    async def one() -> int:
        response = await client.send("GET", unix_socket_url(str(path)) + "/health", {}, None)
        await response.read()
        await response.aclose()
        return response.status

    try:
        assert await asyncio.gather(*(one() for _ in range(64))) == [200] * 64
    finally:
        server.close()
        await client.aclose()
