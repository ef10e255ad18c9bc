#!/usr/bin/env python3
"""A fake llama-server: a real HTTP server process that can misbehave on request.

It speaks the slice of llama-server's HTTP API the node uses (`/health`,
`/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/models`,
`/slots`), takes the same flags, reads `LLAMA_API_KEY`, and is steered by
`FAKE_LLAMA_*` environment variables so tests can make it load slowly, crash,
hang, die mid-stream, send keep-alive pings, or stream as fast as it can (the
benchmark). Standard library only: it must start instantly and never be the
bottleneck it is used to measure.

    FAKE_LLAMA_LOAD_S          seconds /health answers 503 "Loading model" (default 0)
    FAKE_LLAMA_SILENT_LOAD     "1": print nothing while loading (to trip the stall timer)
    FAKE_LLAMA_LOAD_DOTS       "1": print the tensor phase and a line of dots per percent loaded, as
                               builds with a progress bar do (the node's load fraction then moves)
    FAKE_LLAMA_EXIT_ON_START   exit with this code right after start, printing an error
    FAKE_LLAMA_TOKENS          tokens per answer (default 8; the request's max_tokens caps it)
    FAKE_LLAMA_TOKEN_DELAY_S   pause between streamed tokens (default 0)
    FAKE_LLAMA_FIRST_TOKEN_DELAY_S pause before a stream's first token, as prefill takes (default 0)
    FAKE_LLAMA_PING_EVERY      send an SSE ": ping" comment after every N tokens
    FAKE_LLAMA_DIE_AFTER       os._exit(1) after streaming this many tokens
    FAKE_LLAMA_HANG_AFTER_S    /health stops answering this long after start (a wedged server)
    FAKE_LLAMA_EVENTS_PER_WRITE events coalesced per socket write when streaming (default 1)
    FAKE_LLAMA_HOLD_AFTER_DONE_S pause between a stream's `data: [DONE]` and its end (default 0), as a busy
                               llama-server may: a client has the whole answer before the stream closes
    FAKE_LLAMA_REQUEST_LOG     append one JSON line per inference request (path + body)
    FAKE_LLAMA_COUNT_DELAY_S   pause before answering /apply-template and /tokenize (default 0)
    FAKE_LLAMA_COUNT_LOG       append one JSON line per /apply-template or /tokenize request (path)
    FAKE_LLAMA_WARMUP_LOG      the same for the node's warm-up requests (header x-meshnet-warmup)
    FAKE_LLAMA_ENV_DUMP        write the environment it was started with to this file (JSON)
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

HELP = """usage: llama-server [options]
-m,    --model FNAME                    model path
-a,    --alias STRING                   model alias
-c,    --ctx-size N                     context size
-np,   --parallel N                     number of slots
-ngl,  --n-gpu-layers N                 layers on GPU
-lm,   --load-mode MODE                 model loading mode
--mmap, --no-mmap                       memory-map the model
--host HOST                             ip address to listen, or bind to an UNIX socket if the address ends
                                        with .sock (default: 127.0.0.1)
--port PORT                             port to listen
--metrics                               enable metrics
--list-devices                          print list of available devices and exit
"""


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name) or default)


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)


class FakeLlama:
    def __init__(self, argv: list[str]) -> None:
        self.args = parse_args(argv)
        self.alias = self.args.get("--alias") or os.path.basename(self.args.get("--model", "fake.gguf"))
        self.slots = int(self.args.get("--parallel", "4"))
        self.busy: set[int] = set()
        self.key = os.environ.get("LLAMA_API_KEY")
        self.started = time.monotonic()
        self.load_s = env_float("FAKE_LLAMA_LOAD_S", 0)
        self.hang_after = env_float("FAKE_LLAMA_HANG_AFTER_S", 0)
        self.tokens = env_int("FAKE_LLAMA_TOKENS", 8)
        self.token_delay = env_float("FAKE_LLAMA_TOKEN_DELAY_S", 0)
        self.first_token_delay = env_float("FAKE_LLAMA_FIRST_TOKEN_DELAY_S", 0)
        self.ping_every = env_int("FAKE_LLAMA_PING_EVERY", 0)
        self.die_after = env_int("FAKE_LLAMA_DIE_AFTER", 0)
        self.per_write = max(1, env_int("FAKE_LLAMA_EVENTS_PER_WRITE", 1))
        self.hold_after_done = env_float("FAKE_LLAMA_HOLD_AFTER_DONE_S", 0)
        self.request_log = os.environ.get("FAKE_LLAMA_REQUEST_LOG")
        self.warmup_log = os.environ.get("FAKE_LLAMA_WARMUP_LOG")
        self.task_id = 0

    def loading(self) -> bool:
        return time.monotonic() - self.started < self.load_s

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await read_request(reader)
                if request is None:
                    return
                method, path, headers, body = request
                keep = await self.route(method, path, headers, body, writer)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def route(self, method: str, path: str, headers: dict[str, str], body: bytes, writer: asyncio.StreamWriter) -> bool:
        if path == "/health":
            if self.loading():
                return await respond(writer, 503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
            if self.hang_after and time.monotonic() - self.started > self.hang_after:
                await asyncio.sleep(3600)
            return await respond(writer, 200, {"status": "ok"})
        if self.key and headers.get("authorization") != f"Bearer {self.key}":
            return await respond(writer, 401, {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}})
        if self.loading():
            return await respond(writer, 503, {"error": {"code": 503, "message": "Loading model"}})
        if path == "/slots":
            return await respond(writer, 200, [{"id": i, "is_processing": i in self.busy} for i in range(self.slots)])
        if path in ("/apply-template", "/tokenize") and method == "POST":
            if count_log := os.environ.get("FAKE_LLAMA_COUNT_LOG"):
                with open(count_log, "a") as fh:
                    fh.write(json.dumps({"path": path}) + "\n")
            await asyncio.sleep(env_float("FAKE_LLAMA_COUNT_DELAY_S", 0))
        if path == "/apply-template" and method == "POST":
            messages = json.loads(body).get("messages") or []
            text = "".join(f"<{m.get('role')}>{m.get('content')}" for m in messages if isinstance(m, dict))
            return await respond(writer, 200, {"prompt": text})
        if path == "/tokenize" and method == "POST":
            content = json.loads(body).get("content")
            tokens = content if isinstance(content, list) else [ord(c) for c in str(content)]
            return await respond(writer, 200, {"tokens": tokens})
        if path == "/v1/models":
            return await respond(writer, 200, {"object": "list", "data": [{"id": self.alias, "object": "model", "owned_by": "llamacpp"}]})
        if path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings") and method == "POST":
            payload = json.loads(body)
            # The node's own warm-up (before ready) is logged apart from client requests.
            log_to = self.warmup_log if headers.get("x-meshnet-warmup") else self.request_log
            if log_to:
                with open(log_to, "a") as fh:
                    fh.write(json.dumps({"path": path, "body": payload, "at": time.time()}) + "\n")
            if path == "/v1/embeddings":
                return await respond(
                    writer,
                    200,
                    {
                        "object": "list",
                        "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                        "model": self.alias,
                        "usage": {"prompt_tokens": 3, "total_tokens": 3},
                    },
                )
            slot = next(i for i in range(self.slots) if i not in self.busy) if len(self.busy) < self.slots else -1
            self.busy.add(slot)
            try:
                n = min(self.tokens, int(payload.get("max_tokens") or self.tokens))
                if payload.get("stream"):
                    return await self.stream(writer, path, payload, n, warmup=bool(headers.get("x-meshnet-warmup")))
                return await respond(writer, 200, self.whole_answer(path, n))
            finally:
                self.busy.discard(slot)
        return await respond(writer, 404, {"error": {"code": 404, "message": "File Not Found"}})

    def whole_answer(self, path: str, n: int) -> dict:
        text = "x" * n
        choice = {"index": 0, "finish_reason": "length" if n < 1000 else "stop"}
        choice.update({"message": {"role": "assistant", "content": text}} if path.endswith("chat/completions") else {"text": text})
        return {
            "id": "fake-1", "object": "chat.completion", "created": int(time.time()), "model": self.alias, "choices": [choice],
            "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n, "prompt_tokens_details": {"cached_tokens": 2}},
            "timings": {"prompt_n": 7, "prompt_per_second": 5000.0, "predicted_per_second": 1000.0},
        }  # fmt: skip

    async def stream(self, writer: asyncio.StreamWriter, path: str, payload: dict, n: int, warmup: bool = False) -> bool:
        # The node's warm-up is answered at once: deaths and delays asked for are for client requests.
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        chat = path.endswith("chat/completions")
        head = b'data: {"id":"fake-1","object":"chat.completion.chunk","model":"' + self.alias.encode() + b'","choices":[{"index":0,'
        token = head + (b'"delta":{"content":"x"},"finish_reason":null}]}\n\n' if chat else b'"text":"x","finish_reason":null}]}\n\n')
        batch: list[bytes] = []
        if self.first_token_delay and not warmup:
            await asyncio.sleep(self.first_token_delay)
        for i in range(n):
            batch.append(token)
            if self.ping_every and (i + 1) % self.ping_every == 0:
                batch.append(b": ping\n\n")
            if len(batch) >= self.per_write:
                await write_chunk(writer, b"".join(batch))
                batch.clear()
            if warmup:
                continue
            if self.die_after and i + 1 >= self.die_after:
                os._exit(1)
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
        # As llama-server does: a chat stream's counts come in a `"choices":[]` chunk when
        # include_usage is asked, else as `timings` in the finish chunk; a completion stream
        # puts usage and timings in its last content chunk either way.
        usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n, "prompt_tokens_details": {"cached_tokens": 2}}
        timings = {"cache_n": 2, "prompt_n": 5, "predicted_n": n, "predicted_per_second": 1000.0}
        wants_usage = (payload.get("stream_options") or {}).get("include_usage")
        if chat:
            tail = {} if wants_usage else {"timings": timings}
            end = (
                head
                + b'"delta":{},"finish_reason":"length"}]'
                + (b"," + json.dumps(tail, separators=(",", ":")).encode()[1:-1] if tail else b"")
                + b"}\n\n"
            )
        else:
            extra = json.dumps({"usage": usage, "timings": timings}, separators=(",", ":")).encode()[1:-1]
            end = head + b'"text":"","finish_reason":"length"}],' + extra + b"}\n\n"
        batch.append(end)
        if chat and wants_usage:
            chunk = {"id": "fake-1", "object": "chat.completion.chunk", "choices": [], "usage": usage, "timings": timings}
            batch.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
        batch.append(b"data: [DONE]\n\n")
        await write_chunk(writer, b"".join(batch))
        if self.hold_after_done and not warmup:
            await asyncio.sleep(self.hold_after_done)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


def parse_args(argv: list[str]) -> dict[str, str]:
    aliases = {"-m": "--model", "-a": "--alias", "-np": "--parallel", "-c": "--ctx-size", "-ngl": "--n-gpu-layers"}
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        key = aliases.get(argv[i], argv[i])
        if key.startswith("-") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[key] = argv[i + 1]
            i += 2
        else:
            out[key] = "1"
            i += 1
    return out


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes] | None:
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return method, path.split("?", 1)[0], headers, body


async def respond(writer: asyncio.StreamWriter, status: int, payload: object) -> bool:
    body = json.dumps(payload).encode()
    reason = {200: "OK", 401: "Unauthorized", 404: "Not Found", 503: "Service Unavailable"}.get(status, "X")
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    return True


async def write_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%b\r\n" % (len(data), data))
    await writer.drain()


async def main(argv: list[str]) -> int:
    if "--version" in argv:
        print("version: 0.0.0-fake (build 0, commit fake)", file=sys.stderr)
        return 0
    if "--help" in argv:
        print(HELP)
        return 0
    if "--list-devices" in argv:  # the node's hardware probe asks; a fake has no GPU
        print("Available devices:")
        return 0
    fake = FakeLlama(argv)
    if os.environ.get("FAKE_LLAMA_ENV_DUMP"):
        with open(os.environ["FAKE_LLAMA_ENV_DUMP"], "w") as fh:
            json.dump(dict(os.environ), fh)
    exit_code = os.environ.get("FAKE_LLAMA_EXIT_ON_START")
    print(f"main: loading model '{fake.args.get('--model')}'", flush=True)
    if exit_code:
        print("llama_model_load: error loading model: fake failure requested", flush=True)
        print("main: exiting due to model loading error", flush=True)
        return int(exit_code)
    host = fake.args.get("--host", "127.0.0.1")
    if host.endswith(".sock"):  # as llama-server does
        server = await asyncio.start_unix_server(fake.handle, host)
        print(f"main: server is listening on unix://{host}", flush=True)
    else:
        server = await asyncio.start_server(fake.handle, host, int(fake.args["--port"]))
        print(f"main: server is listening on http://127.0.0.1:{fake.args['--port']}", flush=True)
    if fake.load_s and os.environ.get("FAKE_LLAMA_SILENT_LOAD") != "1":
        dots = os.environ.get("FAKE_LLAMA_LOAD_DOTS") == "1"
        print("load_tensors: loading model tensors" if dots else "load_tensors: loading ...", flush=True)
        while fake.loading():
            await asyncio.sleep(0.2)
            share = (time.monotonic() - fake.started) / fake.load_s
            print("." * max(1, min(100, int(share * 100))) if dots else "load_tensors: loading ...", flush=True)
    async with server:
        await server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
