"""A model that failed to load, on the real llama-server: refused at once (no child per request) until its retry
time, then loaded again by the first request after it, so a file replaced since serves without a restart."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from support.supervisor_policies import FAST

from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.child import ChildSpec
from meshnet_gguf.llama.model_children import ModelChildren, ModelFailed
from meshnet_gguf.llama.model_set import ModelSet, ModelToServe
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model

pytestmark = [pytest.mark.anyio, pytest.mark.real_llama]
RETRY_S = 60.0


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """Short, as a node's is: each model's socket lives under it."""
    with tempfile.TemporaryDirectory(prefix="mr-") as folder:
        yield Path(folder)


async def test_a_failed_model_is_refused_until_its_retry_time_then_a_replaced_file_serves(
    real_llama: BinaryInfo, tmp_path: Path, state_dir: Path
) -> None:
    good = write_tiny_model(tmp_path / "good.gguf", TinyModelSpec(seed=5, name="late"))
    path = tmp_path / "late.gguf"
    data = good.read_bytes()
    path.write_bytes(data[:4096].replace(b"llama", b"llamx") + data[4096:])  # llama-server knows no such architecture
    later = [0.0]
    children = ModelChildren(
        ModelSet.checked([ModelToServe(path=path, alias="late", context=512)]),
        lambda m: ChildSpec(real_llama, m.llama_args()),
        FAST,
        state_dir,
        failed_retry_s=RETRY_S,
        clock=lambda: later[0],
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(children.run)
        try:
            with pytest.raises(ModelFailed, match="unknown model architecture"):
                await children.load("late")
            path.write_bytes(data)  # the operator replaces the file
            later[0] += RETRY_S / 2
            with pytest.raises(ModelFailed, match=r"tried again by a request in 30 s"):
                await children.load("late")  # refused at once: no child started for it
            assert children.status()[0].pid is None
            later[0] += RETRY_S / 2
            async with children.using("late") as llama:
                assert llama.is_ready()
            status = children.status()[0]
            assert status.state == "loaded" and status.error is None and status.loads == 1
        finally:
            await children.close()
