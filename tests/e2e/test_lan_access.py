"""The LAN done safely: a real node answers the host names it is given, refuses every other,
and says so at start when it listens beyond this machine without a key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from support.node_process import StartNode

CLI_TIMEOUT_S = 120
MESSAGES = [{"role": "user", "content": "hi"}]


def test_an_allowed_host_is_served_and_a_host_not_configured_is_still_refused(
    start_node: StartNode, fake_llama_path: Path, tiny_gguf: Path
) -> None:
    node = start_node(
        "--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path),
        "--allowed-host", "node.lan", "--allowed-host", "Proxy.Example.NET",
    )  # fmt: skip
    node.wait_ready()
    for host in ("node.lan", f"node.lan:{node.port}", "proxy.example.net", "127.0.0.1"):
        client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, default_headers={"Host": host})
        assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices, host
        assert [m.id for m in client.models.list()] == ["tiny"], host
        assert httpx.get(node.url + "/status.json", headers={"Host": host}).status_code == 200, host
    # The attacker's side: a page on another site, reaching the node through a DNS name rebound to it.
    for host in ("evil.example", "node.lan.evil.example", "evil-node.lan", "proxy.example.net.evil.example"):
        client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, default_headers={"Host": host})
        with pytest.raises(openai.PermissionDeniedError) as refused:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert refused.value.code == "host_not_allowed", host
        with pytest.raises(openai.PermissionDeniedError):
            client.models.list()
        assert httpx.get(node.url + "/status.json", headers={"Host": host}).status_code == 403, host


def _dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MESHNET_")}
    return subprocess.run(
        [sys.executable, "-m", "meshnet_gguf", "serve", "--dry-run", *args], capture_output=True, text=True,
        timeout=CLI_TIMEOUT_S, env=env, check=False,
    )  # fmt: skip


def test_listening_beyond_loopback_without_a_key_is_warned_at_start(fake_llama_path: Path, tiny_gguf: Path) -> None:
    model = ["--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path)]
    open_node = _dry_run(*model, "--host", "0.0.0.0")
    assert open_node.returncode == 0, open_node.stderr
    assert "warning: listening on 0.0.0.0 without an API key: anyone who can reach this port can use the model" in open_node.stderr
    keyed = _dry_run(*model, "--host", "0.0.0.0", "--api-key", "a-long-operator-key")
    assert keyed.returncode == 0 and "without an API key" not in keyed.stderr
    assert "without an API key" not in _dry_run(*model).stderr  # 127.0.0.1, the default


def test_an_allowed_host_that_is_not_a_name_is_refused_in_one_line(tiny_gguf: Path) -> None:
    for given, said in (("http://node.lan", "is not a host name"), ("node.lan:8080", "is not a host name"), ("*", "a wildcard")):
        done = _dry_run("--gguf", str(tiny_gguf), "--allowed-host", given)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert done.stderr.startswith(f"error: --allowed-host / MESHNET_ALLOWED_HOSTS: {given!r}") and said in done.stderr, done.stderr
