"""Real one-way reachability: the node lives in its own network namespace, joined to the host by one
veth pair. It can dial the tracker and the relay on the host side; nothing can dial it (it listens on
the namespace's own loopback). The openai SDK still gets streamed and plain answers, through
tracker -> relay -> node."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator

import openai
import pytest

from meshnet_gguf.common.ports import free_local_port
from support.relay_processes import models, node_env, relay_process, tracker_key, tracker_process, wait_for

pytestmark = [pytest.mark.real_llama, pytest.mark.slow]
NODE_READY_S = 60.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def namespace() -> Iterator[tuple[str, str, str]]:
    """(namespace, host-side address, namespace-side address); always deleted afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed: cannot build a network namespace")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root); not root here")
    tag = uuid.uuid4().hex[:6]
    name = f"relay-test-{os.getpid()}-{tag}"
    host_if, ns_if = f"rl{tag}h", f"rl{tag}n"
    a, b = random.randrange(16, 250), random.randrange(0, 63) * 4
    host_ip, ns_ip = f"10.{a}.{b}.1", f"10.{a}.{b}.2"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"`ip netns add` is not available here: {getattr(exc, 'stderr', b'') or exc!r}")
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        _ip("netns", "exec", name, "ip", "link", "set", ns_if, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name, host_ip, ns_ip
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def test_a_node_nothing_can_dial_serves_the_openai_sdk_through_the_relay(real_llama, tiny_gguf, namespace, tmp_path) -> None:  # type: ignore[no-untyped-def]
    name, host_ip, ns_ip = namespace
    # The relay's address is private (10.x): the tracker must be told to accept it.
    tracker = tracker_process(tmp_path, host=host_ip, allow_private=True).start()
    relay = relay_process(tmp_path, tracker, host=host_ip).start()
    node_port = free_local_port()
    node_log = tmp_path / "node.log"
    argv = [
        "ip", "netns", "exec", name, sys.executable, "-m", "meshnet_gguf", "serve", "--gguf", str(tiny_gguf),
        "--port", str(node_port), "--state-dir", str(tmp_path / "node"), "--download-dir", str(tmp_path / "models"),
        "--tracker", tracker.url, "--tracker-public-key", tracker_key(tracker), "--relay", relay.url,
        "--parallel", "2", "--ctx-size", "2048", "--drain-grace", "2",
    ]  # fmt: skip
    node = subprocess.Popen(argv, stdout=node_log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, **node_env(tracker)},
                            start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: models(tracker) == [tiny_gguf.stem], "the namespaced node to be routable",
                 [tracker.log_path, relay.log_path, node_log], timeout=NODE_READY_S)  # fmt: skip
        # Nothing can dial the node: not at its namespace address, not on the host's loopback.
        for address in (ns_ip, "127.0.0.1"):
            with pytest.raises(OSError):
                socket.create_connection((address, node_port), timeout=1).close()

        client = openai.OpenAI(base_url=tracker.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        messages = [{"role": "user", "content": "Say hello."}]
        plain = client.chat.completions.create(model=tiny_gguf.stem, messages=messages, max_tokens=6, extra_body={"ignore_eos": True})
        assert plain.usage is not None and plain.usage.completion_tokens == 6
        chunks = list(client.chat.completions.create(
            model=tiny_gguf.stem, messages=messages, max_tokens=6, stream=True, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        ))  # fmt: skip
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    finally:
        if node.poll() is None:
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(20)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
        relay.close()
        tracker.close()
        for log in (tracker.log_path, relay.log_path, node_log):
            print(f"----- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
