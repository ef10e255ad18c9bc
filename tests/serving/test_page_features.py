"""The node's page says what its llama-server can do, and links no chat that is not there."""

from __future__ import annotations

from pathlib import Path

import httpx

from support.node_process import NodeProcess


def test_a_build_without_a_web_ui_gets_no_chat_link_and_no_chat_route(  # type: ignore[no-untyped-def]
    fake_llama_path: Path, tiny_gguf: Path, start_node
) -> None:
    # The fake answers 404 at `/`, as llama-server built without npm does: the run probe sees no web UI.
    node: NodeProcess = start_node("--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path))
    node.wait_ready()
    status = httpx.get(node.url + "/status.json", timeout=10).json()
    assert status["chat"] is False  # the page's "Open the chat" link stays hidden
    assert "no web UI" in status["llama_server"] and str(fake_llama_path.resolve()) in status["llama_server"]
    assert httpx.get(node.url + "/chat/", timeout=10).status_code == 404
