"""Node metrics: usage records in, Prometheus text out; llama-server's metrics renamed."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.contract.protocol import UsageRecord
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.upstream.choice import make_upstream_client
from meshnet_gguf.ops.metrics import (
    LLAMACPP_PREFIX,
    NodeMetrics,
    fetch_llama_metrics,
    rename_llama_metric,
    rewrite_llama_metrics,
)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "llamacpp_metrics.txt"


def _usage(**overrides: object) -> UsageRecord:
    fields: dict[str, object] = {
        "request_id": "r1",
        "route": "/v1/chat/completions",
        "model": "tiny",
        "status": 200,
        "stream": True,
        "prompt_tokens": 12,
        "cached_tokens": 4,
        "completion_tokens": 30,
        "finish_reason": "stop",
        "started_at": time.time(),
        "duration_s": 0.8,
        "ttft_s": 0.12,
        "decode_tokens_per_s": 42.0,
    }
    fields.update(overrides)
    return UsageRecord.model_validate(fields)


def _samples(body: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_usage_records_become_counters_and_histograms() -> None:
    metrics = NodeMetrics()
    metrics.observe(_usage())
    anyio.run(metrics.record, _usage(completion_tokens=10, ttft_s=3.0, decode_tokens_per_s=8.0))
    metrics.observe(_usage(status=499, finish_reason="cancelled", completion_tokens=2, ttft_s=None, decode_tokens_per_s=None))
    metrics.observe(_usage(route="/v1/embeddings", stream=False, completion_tokens=0, ttft_s=None, decode_tokens_per_s=None))
    metrics.count_request("/v1/chat/completions", 503)

    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    s = _samples(body)
    chat = (("route", "/v1/chat/completions"),)
    assert s[("meshnet_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] == 2
    assert s[("meshnet_requests_total", (("route", "/v1/chat/completions"), ("status", "499")))] == 1
    assert s[("meshnet_requests_total", (("route", "/v1/chat/completions"), ("status", "503")))] == 1
    assert s[("meshnet_requests_total", (("route", "/v1/embeddings"), ("status", "200")))] == 1
    assert s[("meshnet_prompt_tokens_total", chat)] == 36
    assert s[("meshnet_cached_prompt_tokens_total", chat)] == 12
    assert s[("meshnet_completion_tokens_total", chat)] == 42
    assert s[("meshnet_requests_finished_total", (("finish_reason", "cancelled"),))] == 1
    assert s[("meshnet_time_to_first_token_seconds_count", ())] == 2
    assert s[("meshnet_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 1
    assert s[("meshnet_time_to_first_token_seconds_sum", ())] == pytest.approx(3.12)
    assert s[("meshnet_decode_tokens_per_second_bucket", (("le", "10.0"),))] == 1
    assert s[("meshnet_request_duration_seconds_count", ())] == 4


def test_state_is_read_at_scrape_time_from_the_owners() -> None:
    state = {"in_flight": 0, "busy": 0, "sup": "loading", "restarts": 0, "progress": 0.4}
    metrics = NodeMetrics(
        in_flight=lambda: state["in_flight"],
        slots_busy=lambda: state["busy"],
        slots_total=lambda: 4,
        supervisor_state=lambda: state["sup"],
        restarts=lambda: state["restarts"],
        load_progress=lambda: state["progress"],
        info=lambda: {"version": "0.1.0", "model": "tiny"},
    )
    s = _samples(metrics.render()[0])
    assert s[("meshnet_supervisor_state", (("state", "loading"),))] == 1
    assert s[("meshnet_supervisor_state", (("state", "ready"),))] == 0
    assert s[("meshnet_load_progress", ())] == 0.4
    assert s[("meshnet_node_info", (("model", "tiny"), ("version", "0.1.0")))] == 1

    state.update(in_flight=3, busy=3, sup="ready", restarts=2, progress=None)
    s = _samples(metrics.render()[0])
    assert s[("meshnet_requests_in_flight", ())] == 3
    assert s[("meshnet_slots_busy", ())] == 3
    assert s[("meshnet_slots_total", ())] == 4
    assert s[("meshnet_supervisor_state", (("state", "ready"),))] == 1
    assert s[("meshnet_supervisor_restarts_total", ())] == 2
    assert ("meshnet_load_progress", ()) not in s  # not loading: no value, not a stale one


def test_optional_sources_absent_and_failing_sources_do_not_break_a_scrape() -> None:
    def broken() -> int:
        raise RuntimeError("ledger closed")

    metrics = NodeMetrics(outbox_depth=broken, in_flight=lambda: 1)
    s = _samples(metrics.render()[0])
    assert ("meshnet_billing_outbox_depth", ()) not in s
    assert s[("meshnet_requests_in_flight", ())] == 1
    assert not any(name.startswith("meshnet_supervisor") for name, _ in s)

    metrics = NodeMetrics(outbox_depth=lambda: 7)
    assert _samples(metrics.render()[0])[("meshnet_billing_outbox_depth", ())] == 7


def test_download_bytes_and_private_registry() -> None:
    first, second = NodeMetrics(), NodeMetrics()  # two nodes in one process must not collide
    first.count_download_bytes(1000)
    first.count_download_bytes(0)
    assert _samples(first.render()[0])[("meshnet_download_bytes_total", ())] == 1000
    assert _samples(second.render()[0])[("meshnet_download_bytes_total", ())] == 0
    assert b"process_cpu_seconds" not in first.render()[0]  # the global default registry stays out


def test_hot_path_is_cheap() -> None:
    metrics = NodeMetrics()
    usage = _usage()
    metrics.observe(usage)
    rounds = 20_000
    started = time.perf_counter()
    for _ in range(rounds):
        metrics.observe(usage)
    per_call = (time.perf_counter() - started) / rounds
    # A few microseconds here; the bound leaves room for a loaded CI box.
    assert per_call < 100e-6, f"observe() took {per_call * 1e6:.1f} µs"


@pytest.mark.parametrize(
    ("name", "renamed"),
    [
        ("llamacpp:prompt_tokens_total", "meshnet_llamacpp_prompt_tokens_total"),
        ("llamacpp:kv_cache:usage_ratio", "meshnet_llamacpp_kv_cache_usage_ratio"),
        ("process_start_time_seconds", "meshnet_llamacpp_process_start_time_seconds"),
    ],
)
def test_rename(name: str, renamed: str) -> None:
    assert rename_llama_metric(name) == renamed


def test_rewrite_of_real_llama_server_metrics() -> None:
    original = FIXTURE.read_text()
    rewritten = rewrite_llama_metrics(original)
    assert "llamacpp:" not in rewritten
    families = {f.name: f for f in text_string_to_metric_families(rewritten)}
    originals = {f.name: f for f in text_string_to_metric_families(original)}
    assert len(families) == len(originals) > 10
    prompt = families["meshnet_llamacpp_prompt_tokens"]
    assert prompt.type == "counter"
    assert prompt.documentation == originals["llamacpp:prompt_tokens"].documentation
    assert families["meshnet_llamacpp_requests_processing"].type == "gauge"


def test_rewrite_keeps_labels_values_and_timestamps() -> None:
    text = 'llamacpp:slot_tokens{slot="0",kind="a:b"} 12.5 1700000000000\n\n# a free comment\nnot a sample line {\n'
    assert rewrite_llama_metrics(text) == ('meshnet_llamacpp_slot_tokens{slot="0",kind="a:b"} 12.5 1700000000000\n# a free comment\n')


def test_scrape_appends_llama_metrics() -> None:
    async def upstream() -> str:
        return "# TYPE meshnet_llamacpp_up gauge\nmeshnet_llamacpp_up 1\n"

    metrics = NodeMetrics(llama_metrics=upstream)
    status, body, _ = anyio.run(metrics.scrape)
    assert status == 200
    assert _samples(body)[("meshnet_llamacpp_up", ())] == 1


# --- against the real llama-server --------------------------------------------


@pytest.fixture(scope="module")
def llama_with_metrics(real_llama: BinaryInfo, tiny_gguf: Path) -> Iterator[tuple[str, str]]:
    binary, model = real_llama, tiny_gguf
    port, key = free_local_port(), "metrics-test-key"
    env = binary.environment()
    env["LLAMA_API_KEY"] = key
    child = subprocess.Popen(
        [str(binary.path), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "1", "--metrics"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.05)
        yield base, key
    finally:
        child.terminate()
        child.wait(timeout=30)


@pytest.mark.real_llama
def test_fetch_real_llama_server_metrics(llama_with_metrics: tuple[str, str]) -> None:
    base, key = llama_with_metrics

    async def fetch(api_key: str | None) -> str:
        client = make_upstream_client("aiohttp", 2)
        try:
            deadline = time.monotonic() + 30
            while True:
                text = await fetch_llama_metrics(client, base, api_key)
                # Parsed, not searched: the HELP line itself reads "..._up 1 if llama-server's ...".
                up = _samples(text.encode()).get((f"{LLAMACPP_PREFIX}up", ()))
                if up == 1 or api_key is None or time.monotonic() > deadline:
                    return text
                await anyio.sleep(0.1)  # still loading: /metrics answers 503
        finally:
            await client.aclose()

    text = anyio.run(fetch, key)
    samples = _samples(text.encode())
    assert samples[("meshnet_llamacpp_up", ())] == 1
    assert ("meshnet_llamacpp_prompt_tokens_total", ()) in samples
    # Without the internal key llama-server refuses; the scrape still answers, with up 0.
    refused = _samples(anyio.run(fetch, None).encode())
    assert refused == {("meshnet_llamacpp_up", ()): 0}


@pytest.mark.real_llama
def test_fetch_from_nothing_listening_is_up_zero() -> None:
    async def fetch() -> str:
        client = make_upstream_client("aiohttp", 1)
        try:
            return await fetch_llama_metrics(client, f"http://127.0.0.1:{free_local_port()}", "k", timeout_s=2)
        finally:
            await client.aclose()

    assert _samples(anyio.run(fetch).encode()) == {("meshnet_llamacpp_up", ()): 0}
