"""Fuzzing the node's front with hypothesis: whatever a client sends, the answer is never >= 500,
neither made by the node nor passed through from llama-server, and the node is healthy after.

Two runs: against the fake llama-server (the node's own answers; FUZZ_EXAMPLES, 800 in CI,
about 15 s on 2 cores) and against the real llama-server (its 500s passed through;
FUZZ_REAL_EXAMPLES, 300 in CI). Both were run with 5,000 by hand; the figures are in
bench/RESULTS.md.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.from_thread
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshnet_gguf.llama.binary import BinaryInfo
from support.billing_harness import LlamaChild, serve_front

FAKE_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "800"))
REAL_EXAMPLES = int(os.environ.get("FUZZ_REAL_EXAMPLES", "300"))
# Weighted towards the routes that reach llama-server.
ROUTES = ["/v1/chat/completions"] * 5 + ["/v1/completions"] * 4 + ["/v1/embeddings", "/v1/models", "/health", "/v1/nope"]
KNOWN_KEYS = [
    "messages", "prompt", "input", "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n_predict",
    "n", "n_cmpl", "temperature", "top_p", "top_k", "stop", "seed", "tools", "tool_choice", "response_format",
    "logprobs", "top_logprobs", "n_probs", "grammar", "json_schema", "logit_bias", "ignore_eos", "cache_prompt",
    "id_slot", "samplers", "chat_template_kwargs", "reasoning_format", "parallel_tool_calls", "return_progress",
]  # fmt: skip

json_scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
)  # fmt: skip
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8
)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x", 3]), "content": json_values}),
    min_size=0, max_size=3,
)  # fmt: skip


@st.composite
def request_bodies(draw: st.DrawFn) -> bytes:
    """Mostly near-valid requests with one field gone wrong; sometimes raw bytes or broken JSON text."""
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "raw", "text_tweak", "deep"]))
    if kind == "raw":
        return draw(st.binary(max_size=64))
    if kind == "deep":
        depth = draw(st.integers(min_value=30, max_value=3000))
        opener = draw(st.sampled_from(["[", '{"a":']))
        closer = "]" if opener == "[" else "}"
        return ('{"messages":' + opener * depth + closer * depth + "}").encode()
    body: dict[str, Any] = {
        "messages": draw(messages),
        "prompt": draw(st.one_of(st.text(max_size=20), json_values)),
        "max_tokens": draw(st.integers(min_value=-2, max_value=8)),
    }
    for key in draw(st.lists(st.sampled_from(KNOWN_KEYS), max_size=3)):
        body[key] = draw(json_values)
    if draw(st.booleans()):
        body["messages"] = [{"role": "user", "content": draw(st.text(max_size=20))}]
    text = json.dumps(body, ensure_ascii=draw(st.booleans()))
    if kind == "text_tweak":
        tweak = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", '"\\ud800"', '"\\udfff"', "1e999", "-1e400", "01", '"\\x"', "tru"]))
        text = (
            text.replace('"max_tokens": ', '"max_tokens": ' + tweak + ', "_": ', 1)
            if draw(st.booleans())
            else text[:-1] + ', "z": ' + tweak + "}"
        )
    encoding = draw(st.sampled_from(["utf-8"] * 8 + ["utf-16", "utf-32", "latin-1"]))
    try:
        return text.encode(encoding)
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def fake_child(fake_llama: BinaryInfo, tiny_gguf: Path) -> Iterator[LlamaChild]:
    child = LlamaChild(fake_llama, tiny_gguf, slots=4)
    yield child
    child.close()


@pytest.fixture(scope="module")
def real_child(real_llama: BinaryInfo, tiny_gguf: Path) -> Iterator[LlamaChild]:
    child = LlamaChild(real_llama, tiny_gguf, slots=4)
    yield child
    child.close()


def fuzz(child: LlamaChild, examples: int) -> Counter[int]:
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    with anyio.from_thread.start_blocking_portal() as portal, portal.wrap_async_context_manager(serve_front(child.url, slots=4)) as front:
        with httpx.Client(base_url=front.url, timeout=30) as client:

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            @given(body=request_bodies(), route=st.sampled_from(ROUTES), method=st.sampled_from(["POST"] * 12 + ["GET", "PUT"]),
                   content_type=st.sampled_from(["application/json"] * 12 + ["text/plain", "application/json; charset=utf-16", ""]))  # fmt: skip
            def one(body: bytes, route: str, method: str, content_type: str) -> None:
                headers = {"content-type": content_type} if content_type else {}
                answer = client.request(method, route, content=body, headers=headers)
                statuses[answer.status_code] += 1
                if answer.status_code >= 500 and answer.status_code != 503:
                    failures.append(f"{answer.status_code} {method} {route} {body[:200]!r} -> {answer.text[:300]}")
                # 503 is admission (all slots busy, llama-server not ready): never for a client's input.
                assert answer.status_code != 503 or "slots" in answer.text, answer.text

            one()
            assert not failures, "\n".join(failures[:20])
            assert client.get("/health").status_code == 200
            ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert ok.status_code == 200
            assert front.app.slots.in_flight == 0
    return statuses


def test_fuzz_against_the_fake_llama_server_never_gets_a_5xx(fake_child: LlamaChild) -> None:
    statuses = fuzz(fake_child, FAKE_EXAMPLES)
    print(f"fuzz (fake llama-server): {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")


@pytest.mark.real_llama
def test_fuzz_against_the_real_llama_server_never_gets_a_5xx(real_child: LlamaChild) -> None:
    statuses = fuzz(real_child, REAL_EXAMPLES)
    print(f"fuzz (real llama-server): {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
