"""The run probe: can this binary run this model's weight types on this CPU, asked once and remembered."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshnet_gguf.common.atomic_file import TEMP_SUFFIX
from meshnet_gguf.llama.binary import BinaryInfo, probe_binary
from meshnet_gguf.llama.run_probe import ProbeCache, RunProbe, model_weight_types, probe_run, probe_types
from meshnet_gguf.llama.runnable import quant_weight_types
from meshnet_gguf.models.gguf_convert import dequantize_to_f16
from meshnet_gguf.models.gguf_info import read_gguf_info
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
from support.bundled_wheel import shadowed_pythonpath


def _cache(tmp_path: Path) -> ProbeCache:
    return ProbeCache(tmp_path / "cache" / "llama-probes.json")


def test_a_binary_that_serves_passes_and_says_whether_it_has_a_web_ui(fake_llama: BinaryInfo, tmp_path: Path) -> None:
    probe = probe_run(fake_llama, ("F16", "Q8_0"), cache=_cache(tmp_path))
    assert probe.runs and probe.died_with is None
    assert probe.web_ui is False  # the fake answers 404 at `/`, as a build without the UI does
    assert probe.types == ("F16", "F32", "Q8_0")


def test_the_zen4_case_float_runs_and_quantized_dies(newer_cpu_llama_path: Path, tmp_path: Path) -> None:
    binary = probe_binary(newer_cpu_llama_path, "test")
    assert probe_run(binary, ("F16",), cache=_cache(tmp_path)).runs
    quantized = probe_run(binary, ("Q4_K",), cache=_cache(tmp_path))  # stood in for by Q8_0's kernels
    assert not quantized.runs and quantized.illegal_instruction
    problem = quantized.problem(binary)
    assert problem is not None and "dies with SIGILL on this CPU running Q8_0 weights" in problem


def test_the_avx2_case_even_a_float_model_dies(old_cpu_llama_path: Path, tmp_path: Path) -> None:
    # The old probe tried a quantized model only and took float kernels for granted: here they die too.
    binary = probe_binary(old_cpu_llama_path, "test")
    float_only = probe_run(binary, ("F16",), cache=_cache(tmp_path))
    assert not float_only.runs and float_only.died_with == "SIGILL"
    problem = float_only.problem(binary)
    assert problem is not None and "running F16 weights" in problem


def test_the_answer_is_kept_per_binary_cpu_and_types_and_asked_again_when_the_binary_changes(
    old_cpu_llama_path: Path, fake_llama_path: Path, tmp_path: Path
) -> None:
    cache = _cache(tmp_path)
    stand_in = tmp_path / "bin" / "llama-server"
    stand_in.parent.mkdir()
    shutil.copy2(old_cpu_llama_path, stand_in)  # a copy of its own: this test replaces it below
    binary = probe_binary(stand_in, "test")
    assert not probe_run(binary, ("F16",), cache=cache).runs
    # Kept: the same question is answered from the file, without starting anything.
    entries = cache._read()
    assert len(entries) == 1 and next(iter(entries.values()))["died_with"] == "SIGILL"
    key = next(iter(entries))
    cache.put(key, RunProbe(runs=True, web_ui=True, types=("F16", "F32")))  # a planted answer proves the lookup
    assert probe_run(binary, ("F16",), cache=cache).runs
    # Other types are another question.
    assert not probe_run(binary, ("Q8_0",), cache=cache).runs
    # A binary replaced at the same path (another size and mtime) is asked again.
    stand_in.write_text(fake_llama_path.read_text())
    assert probe_run(probe_binary(stand_in, "test"), ("F16",), cache=cache).runs
    assert not list(cache.path.parent.glob(f"*{TEMP_SUFFIX}"))


def test_a_torn_cache_file_means_probing_again(fake_llama: BinaryInfo, tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    cache.path.parent.mkdir(parents=True)
    cache.path.write_text("{not json")
    assert probe_run(fake_llama, ("F16",), cache=cache).runs


def test_weight_types_map_to_the_kernels_a_tiny_model_can_hold() -> None:
    assert probe_types(["Q4_K", "Q6_K", "F32"]) == ("F32", "Q8_0")
    assert probe_types(["IQ3_XXS"]) == ("F32", "Q8_0")
    assert probe_types(["BF16"]) == ("BF16", "F32")
    assert probe_types(["Q4_0", "F16"]) == ("F16", "F32", "Q4_0")
    assert quant_weight_types("UD-IQ3_XXS") == ("Q8_0",) and quant_weight_types("F16") == ("F16",)
    assert quant_weight_types("q8_0") == ("Q8_0",)


def test_a_models_header_gives_its_weight_types(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "mixed.gguf", TinyModelSpec(n_layers=2, weight_type="Q8_0", layer_types=("F16", "Q8_0")))
    header = read_gguf_info(model)
    assert model_weight_types(header.file_type, header.tensor_types) == ("F16", "F32", "Q8_0")


@pytest.mark.real_llama
def test_the_real_binary_runs_a_mix_of_every_writable_type(real_llama: BinaryInfo, tmp_path: Path) -> None:
    probe = probe_run(real_llama, ("F16", "BF16", "Q4_0", "Q5_1", "Q8_0"), cache=_cache(tmp_path))
    assert probe.runs, probe


@pytest.mark.real_llama
def test_dequantized_copy_keeps_the_model_and_runs_on_float_kernels(real_llama: BinaryInfo, tmp_path: Path) -> None:
    source = write_tiny_model(tmp_path / "q8.gguf", TinyModelSpec(weight_type="Q8_0", n_layers=3))
    copy = dequantize_to_f16(source, tmp_path / "f16.gguf")
    before, after = read_gguf_info(source), read_gguf_info(copy)
    assert (after.block_count, after.head_count_kv, after.tensor_count) == (before.block_count, before.head_count_kv, before.tensor_count)
    assert after.file_type == 1  # MOSTLY_F16
    assert not list(tmp_path.glob(f"*{TEMP_SUFFIX}"))  # the temporary file was renamed into place


def test_the_dry_run_says_serving_will_build_on_such_a_cpu(old_cpu_llama_path: Path, tmp_path: Path) -> None:
    # The bundled binary as an AVX2-only box has it: it dies on every model. The dry run builds nothing and says why.
    env = {
        "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_STATE_HOME": str(tmp_path / "state"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "PATH": "/usr/bin:/bin", "PYTHONPATH": shadowed_pythonpath(tmp_path, old_cpu_llama_path),
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "meshnet_gguf", "serve", "--demo", "--dry-run"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "serving first fetches llama.cpp's release build or, where none can be fetched, builds" in done.stdout
    assert "SIGILL" in done.stdout
    assert not (tmp_path / "data" / "meshnet" / "llama-server").exists()
