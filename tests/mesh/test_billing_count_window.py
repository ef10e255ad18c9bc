"""A meshed node bills a completed answer from llama-server's own count and counts the prompt only
for an answer cut short, so there is a window in which a request reached llama-server and its
prompt is known nowhere yet. A node killed in that window still bills the prompt, exactly once:
the ledger row opened before forwarding keeps the request body, and the restarted node counts it
once llama-server is up, then settles the row into one receipt. And when it is llama-server that
goes away in that window, the row waits (parked, with its body) until the restarted llama-server
counts the prompt, then settles once."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import anyio
import httpx
import pytest

from meshnet_gguf.contract.protocol import ROUTE_HEADER
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.mesh.ledger import RowState
from support.billing_harness import LlamaChild, Tracker, serve_front
from support.relay_processes import ledger_rows
from support.tracker_process import TrackerProcess, tracker, wait_for  # noqa: F401

CONTENT = "count me after the crash"
# The fake llama-server renders a chat as "<role>content" and counts one token per character.
EXPECTED_PROMPT_TOKENS = len(f"<user>{CONTENT}")
# Long enough that the kill surely lands before any count (were one asked for) or the answer's end.
COUNT_DELAY_S = 60
SLOW_TOKENS = {"FAKE_LLAMA_COUNT_DELAY_S": str(COUNT_DELAY_S), "FAKE_LLAMA_TOKEN_DELAY_S": "1"}


def start(start_node, tracker: TrackerProcess, gguf: Path, fake_llama_path: Path, workdir: Path, **env: str):  # type: ignore[no-untyped-def]
    workdir.mkdir(parents=True, exist_ok=True)
    node = start_node(
        "--gguf", str(gguf), "--llama-server", str(fake_llama_path), "--tracker", tracker.url, "--parallel", "2",
        env={**tracker.enrolment(), "MESHNET_TRACKER_PUBLIC_KEY": tracker.public_key(), **env}, workdir=workdir,
    )  # fmt: skip
    node.wait_ready()
    wait_for(lambda: tracker.models() == [gguf.stem], "the node to become routable", node.log_path)
    return node


def test_a_node_killed_after_forwarding_and_before_the_count_bills_the_prompt_once_after_restart(  # type: ignore[no-untyped-def]
    tracker, tiny_gguf, fake_llama_path, start_node, tmp_path
) -> None:
    workdir = tmp_path / "node"
    forwarded = tmp_path / "forwarded.jsonl"
    node = start(start_node, tracker, tiny_gguf, fake_llama_path, workdir, **SLOW_TOKENS, FAKE_LLAMA_REQUEST_LOG=str(forwarded))
    chat = {"model": tiny_gguf.stem, "messages": [{"role": "user", "content": CONTENT}], "stream": True, "max_tokens": 8}
    outcome: list[str] = []

    def client() -> None:
        try:
            with httpx.Client(timeout=30) as http, http.stream("POST", tracker.url + "/v1/chat/completions", json=chat) as answer:
                outcome.append(answer.read().decode(errors="replace"))
        except httpx.HTTPError as exc:
            outcome.append(type(exc).__name__)

    asker = threading.Thread(target=client)
    asker.start()
    # llama-server has the request and is generating it: the kill lands before its answer ends.
    wait_for(lambda: forwarded.exists() and forwarded.read_text().strip() != "", "the request forwarded", node.log_path)
    # The row is synced while llama-server works (protocol §6, rule 1), well before the answer's end.
    wait_for(lambda: len(ledger_rows(node.state_dir)) == 1, "the row durable", node.log_path)
    [row] = ledger_rows(node.state_dir)
    assert row["state"] == RowState.OPEN and row["prompt"] == 0 and row["has_body"]  # on disk, with its body
    node.signal(signal.SIGKILL)
    node.wait_exit()
    asker.join(60)
    assert outcome and "[DONE]" not in outcome[0]  # the answer was cut off by the kill

    restarted = start(start_node, tracker, tiny_gguf, fake_llama_path, workdir)
    wait_for(lambda: ledger_rows(restarted.state_dir)[0]["reported_at"] is not None, "the receipt delivered", restarted.log_path)
    [row] = ledger_rows(restarted.state_dir)
    assert row["state"] == RowState.SETTLED and row["has_receipt"] and not row["has_body"]
    assert row["prompt"] == EXPECTED_PROMPT_TOKENS and row["finish_reason"] == "error"
    # Billed exactly once: one receipt at the tracker, for the request it forwarded, with the prompt.
    assert tracker.receipt_rows() == [row["request_id"]]
    [usage] = [u for u in tracker.usage() if u["request_id"] == row["request_id"]]
    assert usage["node"]["prompt_tokens"] == EXPECTED_PROMPT_TOKENS


@pytest.mark.anyio
async def test_llama_server_gone_after_forwarding_and_before_the_count_still_bills_the_prompt_once(
    fake_llama: BinaryInfo, tiny_gguf: Path, tmp_path: Path
) -> None:
    forwarded = tmp_path / "forwarded.jsonl"
    slow = {**SLOW_TOKENS, "FAKE_LLAMA_REQUEST_LOG": str(forwarded)}
    child = LlamaChild(fake_llama, tiny_gguf, env=slow)  # killed mid-answer, its count held back
    restarted: LlamaChild | None = None
    tracker = Tracker()
    state = tmp_path / "state"
    try:
        async with serve_front(child.url, tracker=tracker, state_dir=state) as front, httpx.AsyncClient(timeout=30) as http:
            assert front.identity is not None
            body = f'{{"model": "tiny", "messages": [{{"role": "user", "content": "{CONTENT}"}}], "stream": true}}'.encode()
            headers = {
                "content-type": "application/json",
                ROUTE_HEADER: tracker.route(front.identity.node_id, "/v1/chat/completions", body),
            }

            async def ask() -> None:
                await http.post(front.url + "/v1/chat/completions", content=body, headers=headers)

            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                with anyio.fail_after(10):
                    while not (forwarded.exists() and forwarded.read_text().strip()):
                        await anyio.sleep(0.02)
                child.kill()  # llama-server had the request; its count never comes
                restarted = LlamaChild(fake_llama, tiny_gguf)
                front.upstream_url[0] = restarted.url  # the supervisor's restart, as the proxy sees it
            [record] = await front.sink.wait_for(1)
            assert record.prompt_tokens == 0  # the request itself ended without its prompt counted

            def settled() -> list[dict[str, object]]:
                return [r for r in ledger_rows(state) if r["state"] == RowState.SETTLED]

            with anyio.fail_after(30):
                while not settled():
                    await anyio.sleep(0.05)
            [row] = ledger_rows(state)
            assert row["has_receipt"] and not row["has_body"] and row["prompt"] == EXPECTED_PROMPT_TOKENS
    finally:
        child.close()
        if restarted is not None:
            restarted.close()


@pytest.mark.anyio
async def test_a_meshed_node_bills_completed_answers_from_llama_servers_count_and_counts_only_a_cut_one(
    fake_llama: BinaryInfo, tiny_gguf: Path, tmp_path: Path
) -> None:
    counted = tmp_path / "counted.jsonl"
    child = LlamaChild(fake_llama, tiny_gguf, env={"FAKE_LLAMA_COUNT_LOG": str(counted), "FAKE_LLAMA_TOKEN_DELAY_S": "0.05"})
    tracker = Tracker()
    state = tmp_path / "state"

    def count_requests() -> list[str]:
        return [line for line in counted.read_text().splitlines() if line] if counted.exists() else []

    try:
        async with serve_front(child.url, tracker=tracker, state_dir=state) as front, httpx.AsyncClient(timeout=30) as http:
            assert front.identity is not None

            def routed(stream: bool) -> tuple[bytes, dict[str, str]]:
                body = (f'{{"model": "tiny", "messages": [{{"role": "user", "content": "{CONTENT}"}}], '
                        f'"max_tokens": 8, "stream": {str(stream).lower()}}}').encode()  # fmt: skip
                route = tracker.route(front.identity.node_id, "/v1/chat/completions", body)  # type: ignore[union-attr]
                return body, {"content-type": "application/json", ROUTE_HEADER: route}

            for stream in (True, False):
                body, headers = routed(stream)
                answer = await http.post(front.url + "/v1/chat/completions", content=body, headers=headers)
                assert answer.status_code == 200
            assert count_requests() == []  # both answers said how long the prompt was
            body, headers = routed(True)
            async with http.stream("POST", front.url + "/v1/chat/completions", content=body, headers=headers) as answer:
                async for line in answer.aiter_lines():
                    if '"content"' in line:
                        break  # the client leaves after its first token
            records = await front.sink.wait_for(3)
            assert len(count_requests()) == 2  # the cut one only: its template, then its tokens
            assert [r.finish_reason for r in records] == ["length", "length", "cancelled"]
            assert all(r.prompt_tokens > 0 for r in records)
            assert records[2].prompt_tokens == EXPECTED_PROMPT_TOKENS
    finally:
        child.close()
