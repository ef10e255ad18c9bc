"""A meshed node killed (kill -9) in the window forward-at-once opens: llama-server already has the
request, the ledger row is not synced yet, and the answer's first byte is held for it (protocol §6,
rule 1). The window is held open the way an operator's `meshnet-gguf usage` or a backup would:
another connection holds SQLite's write lock, so the row waits on the writer thread.

- killed before the row is durable: the client gets no byte, the node bills nothing; after the
  restart the route's one use is still there (the replay cache is seeded from the ledger, which
  never held it), so presenting it again is served once and billed once: the first try was
  answered to nobody and billed to nobody, and the tracker signed the route for one answer;
- killed once the row is durable: billed exactly once after the restart, and the route refused.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from meshnet_gguf.contract.protocol import ROUTE_HEADER
from meshnet_gguf.contract.signing import body_sha256, encode_token, load_or_create_private_key, tracker_issuer_for
from meshnet_gguf.mesh.ledger import LEDGER_FILE, RowState
from meshnet_gguf.reference.tracker.app import TRACKER_KEY_FILE
from support.relay_processes import ledger_rows
from support.tracker_process import TrackerProcess, start_meshed_fake_node, tracker, wait_for  # noqa: F401

pytestmark = [pytest.mark.slow]
CHAT_PATH = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hold me"}]


def routed_request(tracker: TrackerProcess, node_url: str, model: str) -> tuple[bytes, dict[str, str]]:
    """A route minted with the tracker's own key straight to the node, as test_billing_crash does."""
    node_id = httpx.get(tracker.url + "/v1/nodes").json()[0]["node_id"]
    key = load_or_create_private_key(tracker.state_dir / TRACKER_KEY_FILE)
    body = json.dumps({"model": model, "messages": MESSAGES, "stream": True, "max_tokens": 8}).encode()
    now = int(time.time())
    token = encode_token(
        {
            "iss": tracker_issuer_for(key.public_key()), "sub": node_id, "jti": f"req-window-{time.perf_counter_ns()}",
            "iat": now, "exp": now + 55, "path": CHAT_PATH, "model": model,
            "hops": [{"node_id": node_id, "first_layer": 0, "last_layer": 1}], "body_sha256": body_sha256(body),
        },
        key,
    )  # fmt: skip
    return body, {"content-type": "application/json", ROUTE_HEADER: token}


def ask(url: str, body: bytes, headers: dict[str, str], got: list[bytes | str]) -> threading.Thread:
    """Send the request in a thread; `got` gets every byte the client received, or the error's name."""

    def run() -> None:
        received = b""
        try:
            with httpx.Client(timeout=30) as http, http.stream("POST", url + CHAT_PATH, content=body, headers=headers) as answer:
                received = f"HTTP {answer.status_code}\n".encode()
                for chunk in answer.iter_raw():
                    received += chunk
            got.append(received)
        except httpx.HTTPError as exc:
            got.append(received or type(exc).__name__)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def hold_ledger(state_dir: Path) -> sqlite3.Connection:
    """Another connection's write transaction: the node's next synced row waits for it (busy timeout)."""
    holder = sqlite3.connect(state_dir / LEDGER_FILE, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def forwarded(log: Path) -> bool:
    """llama-server has this test's request (the node sends it other requests of its own: a speed probe)."""
    return log.exists() and any(json.loads(line)["body"].get("messages") == MESSAGES for line in log.read_text().splitlines())


def test_a_node_killed_before_its_row_is_durable_delivers_and_bills_nothing_and_the_route_is_served_once_after(  # type: ignore[no-untyped-def]
    tracker, tiny_gguf, fake_llama_path, start_node, tmp_path
) -> None:
    workdir, requests = tmp_path / "node", tmp_path / "forwarded.jsonl"
    node = start_meshed_fake_node(start_node, tracker, tiny_gguf, fake_llama_path, workdir, FAKE_LLAMA_REQUEST_LOG=str(requests))
    body, headers = routed_request(tracker, node.url, tiny_gguf.stem)
    holder = hold_ledger(node.state_dir)
    got: list[bytes | str] = []
    try:
        asker = ask(node.url, body, headers, got)
        wait_for(lambda: forwarded(requests), "llama-server to get the request", node.log_path)
        time.sleep(0.3)  # llama-server's answer is on its way back: only the row holds it
        assert got == []  # nothing yet: the first byte waits for the row
        node.signal(signal.SIGKILL)
        node.wait_exit()
    finally:
        holder.rollback()
        holder.close()
    asker.join(30)
    assert got and isinstance(got[0], str), got  # an error: not one byte, not even a status line
    assert ledger_rows(node.state_dir) == []  # billed nothing

    restarted = start_meshed_fake_node(start_node, tracker, tiny_gguf, fake_llama_path, workdir)
    first = httpx.post(restarted.url + CHAT_PATH, content=body, headers=headers, timeout=30)
    again = httpx.post(restarted.url + CHAT_PATH, content=body, headers=headers, timeout=30)
    assert first.status_code == 200 and b"[DONE]" in first.content
    assert (again.status_code, again.json()["error"]["code"]) == (403, "route_replayed")
    wait_for(
        lambda: [r["state"] for r in ledger_rows(restarted.state_dir)] == [RowState.SETTLED], "its one row settled", restarted.log_path
    )


def test_a_node_killed_once_its_row_is_durable_bills_it_exactly_once_after_restart(  # type: ignore[no-untyped-def]
    tracker, tiny_gguf, fake_llama_path, start_node, tmp_path
) -> None:
    workdir, requests = tmp_path / "node", tmp_path / "forwarded.jsonl"
    node = start_meshed_fake_node(start_node, tracker, tiny_gguf, fake_llama_path, workdir, FAKE_LLAMA_REQUEST_LOG=str(requests))
    body, headers = routed_request(tracker, node.url, tiny_gguf.stem)
    holder = hold_ledger(node.state_dir)
    got: list[bytes | str] = []
    try:
        asker = ask(node.url, body, headers, got)
        wait_for(lambda: forwarded(requests), "llama-server to get the request", node.log_path)
    finally:
        holder.rollback()  # the row goes in now
        holder.close()
    wait_for(lambda: len(ledger_rows(node.state_dir)) == 1, "the row durable", node.log_path)
    node.signal(signal.SIGKILL)  # the answer is still streaming (a token every 0.5 s)
    node.wait_exit()
    asker.join(30)
    [row] = ledger_rows(node.state_dir)
    assert row["state"] == RowState.OPEN and row["has_body"]

    restarted = start_meshed_fake_node(start_node, tracker, tiny_gguf, fake_llama_path, workdir)
    wait_for(lambda: ledger_rows(restarted.state_dir)[0]["state"] == RowState.SETTLED, "the row settled", restarted.log_path)
    replay = httpx.post(restarted.url + CHAT_PATH, content=body, headers=headers, timeout=30)
    assert (replay.status_code, replay.json()["error"]["code"]) == (403, "route_replayed")
    [row] = ledger_rows(restarted.state_dir)
    assert row["has_receipt"] and row["finish_reason"] == "error" and row["prompt"] > 0  # billed once, its prompt counted
