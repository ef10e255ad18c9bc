from __future__ import annotations

from pathlib import Path

import pytest

from meshnet_gguf.common.atomic_file import TEMP_SUFFIX
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.cpu_compat import quantized_kernels_work
from meshnet_gguf.models.gguf_convert import dequantize_to_f16
from meshnet_gguf.models.gguf_info import read_gguf_info
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model


def test_a_binary_that_serves_passes_the_probe(fake_llama: BinaryInfo) -> None:
    assert quantized_kernels_work(fake_llama) is True


def test_a_binary_dying_with_sigill_fails_the_probe(tmp_path: Path) -> None:
    from meshnet_gguf.llama.binary import probe_binary

    assert quantized_kernels_work(probe_binary(_sigill_binary(tmp_path), "test")) is False


@pytest.mark.real_llama
def test_dequantized_copy_keeps_the_model_and_runs_on_float_kernels(real_llama: BinaryInfo, tmp_path: Path) -> None:
    source = write_tiny_model(tmp_path / "q8.gguf", TinyModelSpec(weight_type="Q8_0", n_layers=3))
    copy = dequantize_to_f16(source, tmp_path / "f16.gguf")
    before, after = read_gguf_info(source), read_gguf_info(copy)
    assert (after.block_count, after.head_count_kv, after.tensor_count) == (before.block_count, before.head_count_kv, before.tensor_count)
    assert after.file_type == 1  # MOSTLY_F16
    assert not list(tmp_path.glob(f"*{TEMP_SUFFIX}"))  # the temporary file was renamed into place


def _sigill_binary(tmp_path: Path) -> Path:
    script = tmp_path / "llama-server"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in --help) echo "--port PORT"; exit 0;; --version) echo "version: 1 (b1)"; exit 0;; esac\n'
        "kill -ILL $$\n"
    )
    script.chmod(0o755)
    return script


def test_one_explanation_of_a_build_too_new_for_this_cpu(tmp_path: Path) -> None:
    from meshnet_gguf.llama.binary import probe_binary
    from meshnet_gguf.llama.cpu_compat import kernel_support

    support = kernel_support(probe_binary(_sigill_binary(tmp_path), "test"))
    assert support.quantized is False and support.demo_quant("Q4_K_M") == "F16"
    note = support.demo_note()
    assert note is not None and "SIGILL" in note and "F16 copy" in note and "meshnet-gguf build-llama-server" in note


def test_the_dry_run_plans_what_serving_will_run_on_such_a_cpu(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_STATE_HOME": str(tmp_path / "state"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "meshnet_gguf", "serve", "--demo", "--dry-run", "--llama-server", str(_sigill_binary(tmp_path))],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "demo:F16" in done.stdout and "demo:Q4_K_M" not in done.stdout
    assert "SIGILL" in done.stdout and "build-llama-server" in done.stdout
