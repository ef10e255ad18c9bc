"""The proxy end to end: a real node process, the real llama-server, the official openai SDK.

The proxy's behaviour in detail (admission, errors, byte passthrough, usage,
disconnects, a dying upstream) is tested in process, over a fake upstream
client: tests/serving/test_proxy_admission.py, test_proxy_answers.py, test_proxy_streaming.py.
What only the real thing shows is here: the SDK and llama-server agree with the
node's metering over real HTTP, streamed and not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from meshnet_gguf.contract.protocol import USAGE_COMMENT_PREFIX

MESSAGES = [{"role": "user", "content": "Say hello."}]
USAGE_MARK = b": " + USAGE_COMMENT_PREFIX.encode()


@pytest.mark.real_llama
def test_the_sdk_and_the_nodes_metering_agree_on_the_real_llama_server_streamed_and_not(  # type: ignore[no-untyped-def]
    real_llama, start_node, tiny_gguf: Path
) -> None:
    node = start_node("--gguf", str(tiny_gguf), "--ctx-size", "2048", "--parallel", "1")
    node.wait_ready()
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused")
    # ignore_eos: the random tiny model may sample its end token early; the counts must be exact.
    exact = {"ignore_eos": True}

    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=exact)
    answer = raw.parse()
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    assert raw.headers["x-meshnet-usage-completion-tokens"] == "4"
    assert raw.headers["x-meshnet-usage-prompt-tokens"] == str(answer.usage.prompt_tokens)

    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=6, stream=True, stream_options={"include_usage": True}, extra_body=exact
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) <= 6

    # The same stream as raw bytes: llama-server's usage chunk dropped (not asked), the node's comment before [DONE].
    body = {"messages": MESSAGES, "max_tokens": 5, "stream": True, **exact}
    streamed = httpx.post(node.url + "/v1/chat/completions", json=body, headers={"x-request-id": "e2e-1"}, timeout=30)
    assert streamed.status_code == 200 and streamed.headers["x-meshnet-request-id"] == "e2e-1"
    assert b'"choices":[]' not in streamed.content
    _, _, tail = streamed.content.partition(USAGE_MARK)
    usage_line, _, rest = tail.partition(b"\n\n")
    assert rest == b"data: [DONE]\n\n"
    usage = json.loads(usage_line)
    assert usage["request_id"] == "e2e-1" and usage["completion_tokens"] == 5 and usage["prompt_tokens"] > 0

    totals = node.health().json()["usage"]  # type: ignore[union-attr]
    assert totals["requests"] == 3 and totals["completion_tokens"] == 4 + 6 + 5


def test_cli_reports_setup_errors_clearly(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshnet_gguf", "serve", "--gguf", str(tmp_path / "missing.gguf"), "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "missing.gguf" in done.stderr and "Traceback" not in done.stderr
