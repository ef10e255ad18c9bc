"""The reference tracker killed (kill -9) in the window forward-at-once opens at the tracker: the node
already has the request (and has answered into the tracker), the tracker's forwarded row is not synced
yet, and the answer's first byte to the client is held for it (protocol §6, rule 5). The window is held
open as in the node's tests (test_durability_window_faults): another connection holds the tracker
ledger's write lock, so the row waits on the ledger's writer thread (busy timeout 10 s).

- killed before its row is durable: the client gets no byte, the restarted tracker holds no row and
  refuses the node's receipt (`unknown_request`): billed by nobody. The route died with it: the client
  never saw it, the tracker never resends one, and the node refuses it as replayed (its own row holds
  the id); the client's retry is a new request, served and billed once;
- killed once its row is durable, mid-stream: the restarted tracker settles the row `interrupted` and
  bills the node's receipt exactly once, within the route's bounds: both ledgers name the one request
  with the same figures.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from meshnet_gguf.contract.protocol import ROUTE_HEADER
from meshnet_gguf.contract.signing import body_sha256, encode_token, load_or_create_private_key, tracker_issuer_for
from meshnet_gguf.reference.tracker.app import TRACKER_KEY_FILE
from meshnet_gguf.reference.tracker.ledger import TRACKER_LEDGER_FILE
from support.relay_processes import ledger_rows
from support.tracker_process import TrackerProcess, start_meshed_fake_node, tracker, wait_for  # noqa: F401

pytestmark = [pytest.mark.slow]
CHAT_PATH = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hold me"}]


def chat_body(model: str) -> bytes:
    return json.dumps({"model": model, "messages": MESSAGES, "stream": True, "max_tokens": 8}).encode()


class Asker:
    """One streamed request in a thread; `received` grows with every byte the client gets (the status line
    first, as "HTTP 200\\n"), `error` names the error that ended it, if one did."""

    def __init__(self, url: str, body: bytes) -> None:
        self.received = b""
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(url, body))
        self._thread.start()

    def _run(self, url: str, body: bytes) -> None:
        try:
            with (
                httpx.Client(timeout=30) as http,
                http.stream("POST", url + CHAT_PATH, content=body, headers={"content-type": "application/json"}) as answer,
            ):
                self.received += f"HTTP {answer.status_code}\n".encode()
                for chunk in answer.iter_raw():
                    self.received += chunk
        except httpx.HTTPError as exc:
            self.error = type(exc).__name__

    def join(self) -> None:
        self._thread.join(30)
        assert not self._thread.is_alive()


def hold_tracker_ledger(tracker: TrackerProcess) -> sqlite3.Connection:
    """Another connection's write transaction: the tracker's next synced row waits for it (busy timeout)."""
    holder = sqlite3.connect(tracker.state_dir / TRACKER_LEDGER_FILE, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def tracker_rows(tracker: TrackerProcess) -> list[dict[str, object]]:
    """The tracker's forwarded rows, read without taking part in its writes."""
    db = sqlite3.connect(f"file:{tracker.state_dir / TRACKER_LEDGER_FILE}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in db.execute("SELECT request_id, outcome, flagged FROM forwarded")]
    finally:
        db.close()


def forwarded(log: Path) -> bool:
    """llama-server has this test's request (the node sends it other requests of its own: a speed probe)."""
    return log.exists() and any(json.loads(line)["body"].get("messages") == MESSAGES for line in log.read_text().splitlines())


def replayed_route(tracker: TrackerProcess, node_id: str, request_id: str, model: str, body: bytes) -> dict[str, str]:
    """The route the tracker signed for `request_id`, signed again with its key: the same id, so the same route
    as far as any replay check goes (the client never saw the original; whoever presents it has only this)."""
    key = load_or_create_private_key(tracker.state_dir / TRACKER_KEY_FILE)
    now = int(time.time())
    token = encode_token(
        {
            "iss": tracker_issuer_for(key.public_key()), "sub": node_id, "jti": request_id, "iat": now, "exp": now + 55,
            "path": CHAT_PATH, "model": model, "hops": [{"node_id": node_id, "first_layer": 0, "last_layer": 1}],
            "body_sha256": body_sha256(body),
        },
        key,
    )  # fmt: skip
    return {"content-type": "application/json", ROUTE_HEADER: token}


def test_a_tracker_killed_before_its_row_is_durable_delivers_and_bills_nothing_and_its_route_is_never_served_again(  # type: ignore[no-untyped-def]
    tracker, tiny_gguf, fake_llama_path, start_node, tmp_path
) -> None:
    requests = tmp_path / "forwarded.jsonl"
    node = start_meshed_fake_node(start_node, tracker, tiny_gguf, fake_llama_path, tmp_path / "node", FAKE_LLAMA_REQUEST_LOG=str(requests))
    node_id = httpx.get(tracker.url + "/v1/nodes").json()[0]["node_id"]
    body = chat_body(tiny_gguf.stem)
    holder = hold_tracker_ledger(tracker)
    try:
        asker = Asker(tracker.url, body)
        wait_for(lambda: forwarded(requests), "llama-server to get the request", node.log_path)
        # The node's own row is synced and its answer is on its way to the tracker: only the tracker's row holds it.
        wait_for(lambda: len(ledger_rows(node.state_dir)) == 1, "the node's row durable", node.log_path)
        time.sleep(0.3)
        assert asker.received == b""  # nothing yet: the first byte waits for the tracker's row
        tracker.kill()
    finally:
        holder.rollback()
        holder.close()
    asker.join()
    assert (asker.received, asker.error) == (b"", asker.error) and asker.error, asker.received  # an error, not one byte
    assert tracker_rows(tracker) == []  # no row: nothing to bill

    tracker.start()
    [lost] = ledger_rows(node.state_dir)
    # The node settles what it served and reports it; the tracker, never having routed it durably, refuses it.
    wait_for(lambda: ledger_rows(node.state_dir)[0]["rejected"] is not None, "the node's receipt refused", node.log_path)
    assert "never routed" in ledger_rows(node.state_dir)[0]["rejected"]
    assert tracker.receipt_rows() == [] and tracker.usage() == []  # billed nothing
    # Presented again, that route is refused: the node's row holds its id (the tracker has none, so nothing to bill).
    replay = httpx.post(
        node.url + CHAT_PATH, content=body, headers=replayed_route(tracker, node_id, lost["request_id"], tiny_gguf.stem, body)
    )
    assert (replay.status_code, replay.json()["error"]["code"]) == (403, "route_replayed")

    # The client's retry is a new request: served, and billed once.
    wait_for(lambda: tracker.models() == [tiny_gguf.stem], "the node routable again", node.log_path)
    retry = httpx.post(tracker.url + CHAT_PATH, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert retry.status_code == 200 and b"[DONE]" in retry.content
    wait_for(lambda: len(tracker.receipt_rows()) == 1, "the retry's receipt", node.log_path)
    [usage] = tracker.usage()
    assert usage["request_id"] != lost["request_id"] and usage["outcome"] == "complete" and usage["agreement"] == "agree"
    assert tracker.receipt_rows() == [usage["request_id"]]


def test_a_tracker_killed_once_its_row_is_durable_bills_the_request_exactly_once_after_restart(  # type: ignore[no-untyped-def]
    tracker, tiny_gguf, fake_llama_path, start_node, tmp_path
) -> None:
    requests = tmp_path / "forwarded.jsonl"
    node = start_meshed_fake_node(start_node, tracker, tiny_gguf, fake_llama_path, tmp_path / "node", FAKE_LLAMA_REQUEST_LOG=str(requests))
    body = chat_body(tiny_gguf.stem)
    holder = hold_tracker_ledger(tracker)
    try:
        asker = Asker(tracker.url, body)
        wait_for(lambda: forwarded(requests), "llama-server to get the request", node.log_path)
        assert asker.received == b""
    finally:
        holder.rollback()  # the tracker's row goes in now
        holder.close()
    wait_for(lambda: len(tracker_rows(tracker)) == 1, "the tracker's row durable", tracker.log_path)
    wait_for(lambda: b"data:" in asker.received, "the answer's first token at the client", tracker.log_path)
    tracker.kill()  # the answer is still streaming (a token every 0.5 s)
    asker.join()
    assert asker.received.startswith(b"HTTP 200\n") and b"[DONE]" not in asker.received  # cut short: the tracker died
    [row] = tracker_rows(tracker)
    assert row["outcome"] == "in_flight"

    tracker.start()
    wait_for(lambda: tracker.receipt_rows() == [row["request_id"]], "the node's receipt billed", node.log_path)
    wait_for(lambda: ledger_rows(node.state_dir)[0]["reported_at"] is not None, "the node's receipt acknowledged", node.log_path)
    [served] = ledger_rows(node.state_dir)
    [usage] = tracker.usage()
    assert served["request_id"] == usage["request_id"] == row["request_id"]  # one request on both sides
    assert usage["outcome"] == "interrupted" and usage["flagged"]
    # Billed once, the node's figures within the route's bounds (8 tokens at most).
    assert usage["node"] == {"prompt_tokens": served["prompt"], "completion_tokens": served["completion"]}
    assert served["prompt"] > 0 and usage["billed"] == {
        "prompt_tokens": served["prompt"],
        "completion_tokens": min(served["completion"], 8),
    }
