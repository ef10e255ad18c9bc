"""Log format choice, request ids, llama-server tagging and secret redaction, on real handlers."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from meshnet_gguf.common.logs import (
    LLAMA_LOGGER,
    REDACTED,
    bound_request_id,
    configure_logging,
    forget_secrets,
    llama_log_level,
    register_secret,
    request_id_var,
    resolve_format,
)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    forget_secrets()


def _json_lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.mark.parametrize(
    ("stream", "env", "expected"),
    [
        (FakeTTY(), {"JOURNAL_STREAM": "8:123"}, "text"),
        (io.StringIO(), {"JOURNAL_STREAM": "8:123"}, "json"),
        (io.StringIO(), {"INVOCATION_ID": "abc"}, "json"),
        (io.StringIO(), {}, "text"),
    ],
)
def test_auto_format(stream: io.StringIO, env: dict[str, str], expected: str) -> None:
    assert resolve_format("auto", stream, env) == expected


def test_explicit_format_wins_over_the_environment() -> None:
    assert resolve_format("json", FakeTTY(), {}) == "json"
    assert resolve_format("text", io.StringIO(), {"JOURNAL_STREAM": "8:1"}) == "text"


def test_json_lines_carry_request_id_source_and_extras() -> None:
    stream = io.StringIO()
    assert configure_logging("json", "DEBUG", stream=stream) == "json"
    log = logging.getLogger("meshnet_gguf.serving.proxy")
    log.info("before")
    with bound_request_id("req-42"):
        log.info("admitted %s", "/v1/chat/completions", extra={"slots_busy": 3})
        logging.getLogger(LLAMA_LOGGER).warning("W srv  llama_server: slot busy")
    log.info("after")

    before, admitted, llama, after = _json_lines(stream)
    assert "request_id" not in before and "request_id" not in after
    assert admitted["request_id"] == "req-42"
    assert admitted["msg"] == "admitted /v1/chat/completions"
    assert admitted["slots_busy"] == 3
    assert admitted["source"] == "node" and admitted["level"] == "info"
    assert llama["source"] == "llama-server" and llama["request_id"] == "req-42"
    assert str(admitted["ts"]).endswith("Z")


def test_request_id_follows_each_asyncio_task() -> None:
    stream = io.StringIO()
    configure_logging("json", "INFO", stream=stream)
    log = logging.getLogger("meshnet_gguf.serving.proxy")

    async def handle(request_id: str) -> None:
        with bound_request_id(request_id):
            await asyncio.sleep(0.01)
            log.info("done")

    async def main() -> None:
        await asyncio.gather(handle("a"), handle("b"), handle("c"))

    asyncio.run(main())
    assert sorted(str(line["request_id"]) for line in _json_lines(stream)) == ["a", "b", "c"]
    assert request_id_var.get() is None


def test_text_format_tags_llama_lines_and_requests() -> None:
    stream = io.StringIO()
    configure_logging("text", "INFO", stream=stream)
    with bound_request_id("r1"):
        logging.getLogger(LLAMA_LOGGER).info("I srv  load_model: loading model")
    line = stream.getvalue().strip()
    assert "[llama-server]" in line and "[req r1]" in line and line.endswith("load_model: loading model")


def test_registered_secret_never_printed_even_in_tracebacks_and_json() -> None:
    secret = 'k3y-"with\\quote'
    register_secret(secret)
    for fmt in ("text", "json"):
        stream = io.StringIO()
        configure_logging(fmt, "INFO", stream=stream)  # type: ignore[arg-type]
        log = logging.getLogger("meshnet_gguf.llama.supervisor")
        log.info("launching with key %s", secret)
        log.info("env", extra={"env": {"LLAMA_API_KEY": secret}})
        try:
            raise RuntimeError(f"bad key {secret}")
        except RuntimeError:
            log.exception("failed")
        out = stream.getvalue()
        assert "k3y-" not in out, fmt
        assert REDACTED in out


def test_noisy_libraries_are_quieted() -> None:
    configure_logging("text", "DEBUG", stream=io.StringIO())
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING


def test_reconfiguring_replaces_rather_than_stacks_handlers() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("text", "INFO", stream=first)
    configure_logging("json", "INFO", stream=second)
    logging.getLogger("meshnet_gguf").info("once")
    assert first.getvalue() == ""
    assert len(_json_lines(second)) == 1


@pytest.mark.parametrize(
    ("line", "level"),
    [
        ("0.00.078.593 W srv  llama_server: CORS is set to allow all origins", logging.WARNING),
        ("0.01.000.000 E srv  load_model: failed to load model", logging.ERROR),
        # Routine: at DEBUG, so an INFO log shows the node's own lines, not llama-server's chatter.
        ("0.00.080.101 I srv    load_model: loading model '/models/x.gguf'", logging.DEBUG),
        ("0.18.075.306 I slot print_timing: id  0 | task 0 | prompt eval time =  502.01 ms", logging.DEBUG),
        ("0.00.034.622 D load_all_data: no device found", logging.DEBUG),
        # Warnings llama-server prints on every prompt-cache hit (recorded from b10434): routine, not a problem.
        (
            "0.01.344.996 W slot   operator(): id  0 | task 16 | need to evaluate at least 1 token for each active slot "
            "(n_past = 21, task.n_tokens() = 21)",
            logging.DEBUG,
        ),
        ("0.01.345.009 W slot   operator(): id  0 | task 16 | n_past was set to 20", logging.DEBUG),
        ("AMX is not ready to be used!", logging.DEBUG),
        # Unlevelled lines that read like a failure keep a level an operator sees.
        ("/src/ggml-cpu.c:123: GGML_ASSERT(x) failed", logging.WARNING),
        ("terminate called after throwing an instance of 'std::runtime_error'  what():  bad", logging.WARNING),
    ],
)
def test_llama_levels(line: str, level: int) -> None:
    assert llama_log_level(line) == level


@pytest.mark.parametrize("inside_the_request", [True, False])
def test_the_usage_line_names_its_request_once(inside_the_request: bool) -> None:
    from meshnet_gguf.contract.protocol import UsageRecord
    from meshnet_gguf.serving.usage_stats import UsageLog

    stream = io.StringIO()
    configure_logging("text", "INFO", stream=stream)
    usage = UsageRecord(request_id="req-7f3a", route="/v1/chat/completions", model="m", status=200, stream=False, started_at=0.0)
    if inside_the_request:
        with bound_request_id(usage.request_id):
            asyncio.run(UsageLog().record(usage))
    else:
        asyncio.run(UsageLog().record(usage))
    line = stream.getvalue().strip()
    assert line.count("req-7f3a") == 1 and "[req req-7f3a] /v1/chat/completions status=200" in line, line
