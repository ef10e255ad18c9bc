"""A meshed node counts the prompt beside the generation, so there is a window in which a request
reached llama-server and its prompt is not counted yet. A node killed in that window still bills
the prompt, exactly once: the ledger row opened before forwarding keeps the request body, and the
restarted node counts it once llama-server is up, then settles the row into one receipt."""

from __future__ import annotations

import signal
import sqlite3
import threading
from pathlib import Path

import httpx

from meshnet_gguf.mesh.ledger import LEDGER_FILE
from support.tracker_process import TrackerProcess, tracker, wait_for  # noqa: F401

CONTENT = "count me after the crash"
# The fake llama-server renders a chat as "<role>content" and counts one token per character.
EXPECTED_PROMPT_TOKENS = len(f"<user>{CONTENT}")
# Long enough that the kill surely lands before the count does.
COUNT_DELAY_S = 60


def ledger_rows(state_dir: Path) -> list[dict[str, object]]:
    db = sqlite3.connect(f"file:{state_dir / LEDGER_FILE}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT request_id, in_flight, prompt_tokens, finish_reason, receipt != '', prompt_body IS NOT NULL, reported_at FROM usage"
        ).fetchall()
    finally:
        db.close()
    keys = ("request_id", "in_flight", "prompt", "finish_reason", "has_receipt", "has_body", "reported_at")
    return [dict(zip(keys, row)) for row in rows]


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
    node = start(start_node, tracker, tiny_gguf, fake_llama_path, workdir,
                 FAKE_LLAMA_COUNT_DELAY_S=str(COUNT_DELAY_S), FAKE_LLAMA_REQUEST_LOG=str(forwarded))  # fmt: skip
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
    # llama-server has the request; the count is held back: the kill lands between the two.
    wait_for(lambda: forwarded.exists() and forwarded.read_text().strip() != "", "the request forwarded", node.log_path)
    [row] = ledger_rows(node.state_dir)
    assert row["in_flight"] == 1 and row["prompt"] == 0 and row["has_body"]  # on disk before forwarding, with its body
    node.signal(signal.SIGKILL)
    node.wait_exit()
    asker.join(60)
    assert outcome and '"content"' not in outcome[0]  # no output left the node before the count was recorded

    restarted = start(start_node, tracker, tiny_gguf, fake_llama_path, workdir)
    wait_for(lambda: ledger_rows(restarted.state_dir)[0]["reported_at"] is not None, "the receipt delivered", restarted.log_path)
    [row] = ledger_rows(restarted.state_dir)
    assert row["in_flight"] == 0 and row["has_receipt"] and not row["has_body"]
    assert row["prompt"] == EXPECTED_PROMPT_TOKENS and row["finish_reason"] == "error"
    # Billed exactly once: one receipt at the tracker, for the request it forwarded, with the prompt.
    assert tracker.receipt_rows() == [row["request_id"]]
    [usage] = [u for u in tracker.usage() if u["request_id"] == row["request_id"]]
    assert usage["node"]["prompt_tokens"] == EXPECTED_PROMPT_TOKENS
