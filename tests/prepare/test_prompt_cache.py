"""llama-server's host prompt cache stays within the plan: its RSS levels off under distinct prompts.

llama-server keeps the KV state of every finished prompt in RAM (`--cache-ram`,
8 GiB by default) so a returning conversation skips its prefill. Measured with
`bench/soak_prompt_cache.py` on a model with 8 KiB of KV per token and
1,500-token prompts: RSS grows ~12 MiB per distinct prompt without a limit
(+196 MiB after 16), stays flat with `--cache-ram 0`, and levels off with
`--cache-ram 32` (+37 MiB above the first request: the limit plus one state
that had already been stored when the limit was checked). Beside it, the KV
cache llama-server allocates at load becomes resident as requests touch it.
This test runs the plan's own argv on the real binary and holds RSS to what the
plan counts for both.
"""

from __future__ import annotations

import random
import string
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.common.units import MiB
from meshnet_gguf.hardware.report import probe_hardware
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.models.gguf_info import read_gguf_info
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
from meshnet_gguf.prepare.memory import ModelFacts
from meshnet_gguf.prepare.plan import plan_launch
from support.hardware_fixtures import choices

# 2 layers x 16 KV heads x 64 dims x (K + V) x 2 bytes (f16 cache) = 8,192 bytes of KV per token.
KV_HEAVY = TinyModelSpec(n_layers=2, n_embd=1024, n_head=16, n_head_kv=16, n_ff=256, context_length=2048)
KV_BYTES_PER_TOKEN = 2 * 16 * 64 * 2 * 2
CTX = 2048
# The tiny model's vocabulary is the ASCII bytes: one letter is one token. 600 tokens leave
# 600 x 8 KiB = 4.7 MiB of state each; 12 of them would be 56 MiB without a limit.
PROMPT_TOKENS = 600
REQUESTS = 12
# RSS moves in pages and malloc arenas; a few MiB either way are not the cache.
RSS_SLACK_BYTES = 4 * MiB
READY_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


@pytest.mark.real_llama
@pytest.mark.slow
def test_llama_server_rss_levels_off_within_the_planned_prompt_cache(real_llama: BinaryInfo, tmp_path: Path) -> None:
    if not real_llama.supports("--cache-ram"):
        pytest.skip("this llama-server keeps no prompt cache in RAM (no --cache-ram)")
    model = write_tiny_model(tmp_path / "kv-heavy.gguf", KV_HEAVY)
    facts = ModelFacts.from_gguf(read_gguf_info(model), model.stat().st_size, path=model)
    assert facts.kv_bytes_per_token() == KV_BYTES_PER_TOKEN
    plan = plan_launch(facts, probe_hardware(real_llama), choices(parallel=1, ctx_size=CTX, n_gpu_layers="0"), real_llama)

    # One more context's worth of states: 8,192 B x 2,048 tokens = 16 MiB, the plan's --cache-ram.
    argv = list(plan.argv)
    assert argv[argv.index("--cache-ram") + 1] == "16"
    assert plan.memory.prompt_cache == 16 * MiB and plan.memory.prompt_cache <= plan.host_bytes

    port = free_local_port()
    log = (tmp_path / "llama-server.log").open("wb")
    child = subprocess.Popen(
        [str(real_llama.path), *argv, "--host", "127.0.0.1", "--port", str(port)],
        env=real_llama.environment(), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait_ready(child, port)
        loaded = psutil.Process(child.pid).memory_info().rss
        rss = _rss_after_each_request(child.pid, port)
    finally:
        child.terminate()
        try:
            child.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        log.close()

    state_bytes = KV_BYTES_PER_TOKEN * PROMPT_TOKENS
    kv_cache_bytes = plan.memory.kv_host  # 8,192 B x 2,048 tokens = 16 MiB, all in RAM (CPU only)
    assert kv_cache_bytes == KV_BYTES_PER_TOKEN * CTX
    # The KV cache is allocated at load and becomes resident as requests touch it; the prompt
    # cache grows to its limit, plus the one state stored before the limit is checked.
    growth = max(rss) - loaded
    assert growth <= kv_cache_bytes + plan.memory.prompt_cache + state_bytes + RSS_SLACK_BYTES, (
        f"RSS after load {loaded / MiB:.1f} MiB, after each request: {[round(r / MiB, 1) for r in rss]}"
    )
    # Levelled off: the second half of the run adds no more than one state.
    half = len(rss) // 2
    assert rss[-1] - rss[half] <= state_bytes + RSS_SLACK_BYTES
    # Well within the plan's RAM figure (weights, the whole KV cache, compute buffers, prompt cache).
    assert max(rss) <= plan.host_bytes


def _wait_ready(child: subprocess.Popen[bytes], port: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        assert child.poll() is None, f"llama-server exited with {child.returncode}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"llama-server was not ready within {READY_TIMEOUT_S:.0f} s")


def _rss_after_each_request(pid: int, port: int) -> list[int]:
    rng = random.Random(0)
    process = psutil.Process(pid)
    rss = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=REQUEST_TIMEOUT_S) as client:
        for _ in range(REQUESTS):
            prompt = "".join(rng.choice(string.ascii_letters) for _ in range(PROMPT_TOKENS))
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
            client.post("/v1/chat/completions", json=body).raise_for_status()
            rss.append(process.memory_info().rss)
    return rss
