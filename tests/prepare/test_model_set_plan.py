"""Several models on one node, as `serve` reads and plans them: a repeated `--gguf` and `[[models]]` in the TOML file,
each model with its quant, context and slots; the set placed together in this machine's memory (the pinned first
model, and each other model in what it leaves, on the GPU and in all) and refused naming the model that would not
fit; a name two models would answer to refused before anything is launched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.hardware_fixtures import FIXTURES, write_recorded_llama

from meshnet_gguf.common.model_entries import ModelEntry, parse_model_flag
from meshnet_gguf.common.settings import CONFIG_FILE_ENV, NodeSettings
from meshnet_gguf.hardware.report import MemoryCapacity
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
from meshnet_gguf.prepare.model_set_plan import ModelNeed, ModelSetDoesNotFit, Room, fit_together
from meshnet_gguf.prepare.pipeline import NodeSetupError, prepare_launch

GB = 10**9
CLOSED_HUB = "http://127.0.0.1:9"  # nothing listens: a dry run that tried the hub would fail loudly
DRY_RUN_TIMEOUT_S = 120
BIG = "deepseek-v4-flash:UD-IQ3_XXS"


@pytest.fixture(scope="module")
def recorded_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_recorded_llama(tmp_path_factory.mktemp("recorded-bin"))


def _dry_run(tmp_path: Path, box: str, *args: str, llama: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHNET_", "HF_"))}
    env.update(HF_ENDPOINT=CLOSED_HUB, HF_HOME=str(tmp_path / "hf-home"), MESHNET_HARDWARE_FIXTURE=str(FIXTURES / box))
    argv = [
        sys.executable, "-m", "meshnet_gguf", "serve", *args, "--dry-run", "--llama-server", str(llama),
        "--download-dir", str(tmp_path / "models"), "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S)


def test_a_gguf_after_the_first_carries_its_own_quant_context_slots_idle_time_and_pin() -> None:
    entry = parse_model_flag("owner/name:Q4_K_M,ctx=4096,slots=2,idle=60,alias=small,gpu-layers=0,pin")
    assert entry == ModelEntry(
        gguf="owner/name:Q4_K_M", ctx_size=4096, parallel=2, idle_unload_s=60.0, alias="small", n_gpu_layers="0", pinned=True
    )
    assert parse_model_flag("tiny.gguf") == ModelEntry(gguf="tiny.gguf")  # one slot, unpinned, the node's idle time
    for bad, said in (
        ("a.gguf,colour=red", "unknown option 'colour'"),
        ("a.gguf,ctx=lots", "ctx_size"),
        ("a.gguf,idle=", "idle needs a value"),
    ):
        with pytest.raises(ValueError, match=said):
            parse_model_flag(bad)


def test_the_toml_file_lists_more_models_as_tables_and_a_mistyped_key_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "node.toml"
    config.write_text(
        'gguf = "big.gguf"\n\n[[models]]\ngguf = "small.gguf"\nctx_size = 2048\nidle_unload_s = 120\n\n'
        '[[models]]\ngguf = "demo"\npinned = true\n'
    )
    monkeypatch.setenv(CONFIG_FILE_ENV, str(config))
    settings = NodeSettings()
    assert settings.gguf == "big.gguf"
    assert settings.models == [ModelEntry(gguf="small.gguf", ctx_size=2048, idle_unload_s=120.0), ModelEntry(gguf="demo", pinned=True)]
    config.write_text('[[models]]\ngguf = "small.gguf"\nctx = 2048\n')
    with pytest.raises(ValueError, match="ctx"):
        NodeSettings()


def test_the_pinned_models_must_fit_together_and_each_other_model_in_what_they_leave() -> None:
    box = MemoryCapacity(total_bytes=100 * GB, gpu_bytes=60 * GB, gpu_name="gpu", unified=False)
    big = ModelNeed("big", gpu_bytes=50 * GB, host_bytes=20 * GB, pinned=True)
    # 30 GB left in all, 10 GB of it on the GPU: the small model fits.
    room = fit_together(big, [ModelNeed("small", 8 * GB, 2 * GB, pinned=False)], box)
    assert room == Room(total_bytes=30 * GB, gpu_bytes=10 * GB)
    # Each other model alone beside the pinned: two that fit one at a time are a set that fits (one is unloaded for the other).
    a, b = ModelNeed("a", 9 * GB, 0, False), ModelNeed("b", 9 * GB, 0, False)
    room = fit_together(big, [a, b], box)
    # In the one figure the children count room in, each costs its GPU bytes scaled by the GPU's scarcer room:
    # the two cannot be loaded together (18 GB on a GPU with 10 left), and the count says so.
    assert room.cost(a) == 27 * GB and room.cost(a) + room.cost(b) > room.total_bytes
    assert room.cost(ModelNeed("cpu", 0, 5 * GB, False)) == 5 * GB  # RAM alone: its bytes
    with pytest.raises(ModelSetDoesNotFit, match=r"^mid .* does not fit beside the pinned models \(big\)"):
        fit_together(big, [ModelNeed("mid", 12 * GB, 0, pinned=False)], box)  # the GPU's 10 GB left are too few
    with pytest.raises(ModelSetDoesNotFit, match=r"^wide .* does not fit"):
        fit_together(big, [ModelNeed("wide", 0, 31 * GB, pinned=False)], box)  # RAM
    with pytest.raises(ModelSetDoesNotFit, match="the pinned models do not fit together: big .*, second"):
        fit_together(big, [ModelNeed("second", 15 * GB, 0, pinned=True)], box)
    pinned = ModelNeed("kept", 4 * GB, 0, pinned=True)  # costs 12 GB of the 30: the others get what is left
    with pytest.raises(
        ModelSetDoesNotFit, match=r"^small .* beside the pinned models \(big, kept\): they leave 18.0 GB \(6.0 GB on the GPU\)"
    ):
        fit_together(big, [pinned, ModelNeed("small", 7 * GB, 0, pinned=False)], box)


def test_strix_halo_keeps_the_big_model_and_plans_a_small_one_in_what_it_leaves(tmp_path: Path, recorded_llama: Path) -> None:
    done = _dry_run(tmp_path, "strix-halo-128", "--gguf", BIG, "--ctx-size", "65536", "--gguf", "demo,ctx=4096", llama=recorded_llama)
    assert done.returncode == 0, done.stderr
    assert "also:      demo:Q4_K_M (" in done.stdout and "loaded on demand, unloaded after 900 s idle" in done.stdout
    assert "left by the first model for the others" in done.stdout

    second = _dry_run(
        tmp_path, "strix-halo-128", "--gguf", BIG, "--ctx-size", "65536", "--gguf", f"{BIG},alias=second", llama=recorded_llama
    )
    assert second.returncode == 2
    assert "error: second" in second.stderr and f"does not fit beside the pinned models ({BIG})" in second.stderr


def test_a_model_named_as_the_first_is_refused_before_anything_runs(tmp_path: Path, recorded_llama: Path) -> None:
    first = write_tiny_model(tmp_path / "tiny-a.gguf", TinyModelSpec(seed=1, name="tiny-a"))
    other = write_tiny_model(tmp_path / "other.gguf", TinyModelSpec(seed=2, name="other"))
    settings = NodeSettings(
        gguf=str(first), ctx_size=512, llama_server=recorded_llama, hardware_fixture=FIXTURES / "cpu-only",
        download_dir=tmp_path / "models", models=[ModelEntry(gguf=str(other), ctx_size=512, alias="tiny-a")],
    )  # fmt: skip
    with pytest.raises(NodeSetupError, match="tiny-a: the first model already answers to this name"):
        prepare_launch(settings, dry_run=True)
    ok = settings.model_copy(update={"models": [ModelEntry(gguf=str(other), ctx_size=512, idle_unload_s=30)]})
    launch = prepare_launch(ok, dry_run=True)
    assert launch.others is not None
    (model,) = launch.others.models
    assert model.alias == "other" and model.context == 512 and model.slots == 1 and model.idle_unload_s == 30
    assert model.memory_bytes and launch.others.children["other"].args[-2:] == ["--alias", "other"]


def test_with_demo_every_gguf_is_served_beside_the_demo(tmp_path: Path, recorded_llama: Path) -> None:
    tiny = write_tiny_model(tmp_path / "tiny-b.gguf", TinyModelSpec(seed=2, name="tiny-b"))
    done = _dry_run(tmp_path, "cpu-only", "--demo", "--gguf", f"{tiny},ctx=512,idle=60", "--ctx-size", "2048", llama=recorded_llama)
    assert done.returncode == 0, done.stderr
    assert "model:     demo:Q4_K_M (" in done.stdout
    assert f"also:      tiny-b ({tiny}): loaded on demand, unloaded after 60 s idle" in done.stdout
